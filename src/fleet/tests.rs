//! The store's invariant, rule by rule, against the real Redis these
//! machines run on 127.0.0.1:6379 (each test under its own key prefix).
use super::bindings::*;
use super::store::{SharedStore, StoreConfig, StoreKind, StoreTls, Stored, StoredMoves};
use crate::affinity::shared::TierBackends;
use crate::affinity::{Affinity, Binding};
use std::sync::Arc;
use std::time::Duration;

struct TestTier(Vec<&'static str>);

impl TierBackends for TestTier {
    fn name(&self) -> &str {
        "default"
    }
    fn index(&self) -> u16 {
        0
    }
    fn backend_id(&self, slot: u32) -> Option<&str> {
        self.0.get(slot as usize).copied()
    }
    fn backend_slot(&self, id: &str) -> Option<u32> {
        self.0.iter().position(|b| *b == id).map(|i| i as u32)
    }
}

async fn store(test: &str) -> Arc<SharedStore> {
    let cfg = StoreConfig {
        kind: StoreKind::Redis,
        url: "redis://127.0.0.1:6379".into(),
        key_prefix: format!("agw-unit-{test}-{}:", std::process::id()),
        timeout: Duration::from_secs(2),
        revalidate: Duration::from_secs(60),
        tls: StoreTls::default(),
        required: false,
        heartbeat: Duration::from_secs(5),
    };
    let s = SharedStore::new(cfg, Arc::new(crate::metrics::Metrics::new())).unwrap();
    assert!(
        s.connect().await && s.ping().await,
        "Redis on 127.0.0.1:6379 (scripts/setup.sh installs it)"
    );
    s
}

fn stored(version: u32, backend: &str) -> Stored {
    Stored {
        version,
        backend: backend.into(),
        moves: StoredMoves::default(),
    }
}

/// A router holding `key` at `version` on `slot`, and what the store says.
async fn setup(
    test: &str,
    version: u32,
    slot: u32,
    in_store: Option<Stored>,
) -> (Arc<Affinity>, Arc<SharedStore>, Binding) {
    let a = Affinity::new(100, Some(Duration::from_secs(600)));
    let local = Binding {
        backend: slot,
        version,
        deadline_ms: a.now_ms() + 600_000,
        ..Binding::default()
    };
    assert!(a.adopt(7, local, false, a.now_ms()));
    let s = store(test).await;
    s.delete(7, None).await.unwrap();
    if let Some(v) = in_store {
        assert_eq!(s.create(7, "default", &v, 600_000).await.unwrap(), None);
    }
    (a, s, local)
}

const TIER: &[&str] = &["b0", "b1", "b2"];

#[tokio::test]
async fn a_newer_local_binding_is_written_over_an_older_stored_one() {
    let (a, s, local) = setup("newer-local", 2, 1, Some(stored(1, "b0"))).await;
    let known = InStore::Found(s.peek(7).await.unwrap().unwrap());
    let tier = TestTier(TIER.to_vec());
    assert_eq!(
        reconcile(&*a, &s, 7, &tier, local, known).await.unwrap(),
        None
    );
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(2, "b1")));
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((1, 2)));
    assert!(a.synced_ms(7).is_some_and(|t| t > 0), "in step now");
}

#[tokio::test]
async fn an_older_local_binding_takes_the_stored_one() {
    let (a, s, local) = setup("older-local", 1, 0, Some(stored(3, "b2"))).await;
    let known = InStore::Found(s.peek(7).await.unwrap().unwrap());
    let tier = TestTier(TIER.to_vec());
    assert_eq!(
        reconcile(&*a, &s, 7, &tier, local, known).await.unwrap(),
        Some(2)
    );
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((2, 3)));
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(3, "b2")), "untouched");
}

#[tokio::test]
async fn at_the_same_version_the_store_decided_the_race() {
    // Two gateways bound one new session at once: the store's wins.
    let (a, s, local) = setup("same-version", 1, 0, Some(stored(1, "b1"))).await;
    let tier = TestTier(TIER.to_vec());
    let r = reconcile(&*a, &s, 7, &tier, local, InStore::Absent).await;
    assert_eq!(
        r.unwrap(),
        Some(1),
        "create-if-absent answered with the store's"
    );
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((1, 1)));
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(1, "b1")));
}

#[tokio::test]
async fn a_stored_backend_this_gateway_lacks_is_neither_taken_nor_overwritten() {
    // Another gateway's reload added "b9" first.
    let (a, s, local) = setup("unknown-backend", 1, 0, Some(stored(5, "b9"))).await;
    let known = InStore::Found(s.peek(7).await.unwrap().unwrap());
    let tier = TestTier(TIER.to_vec());
    assert_eq!(
        reconcile(&*a, &s, 7, &tier, local, known).await.unwrap(),
        None
    );
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((0, 1)));
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(5, "b9")));
    assert!(a.synced_ms(7).is_some_and(|t| t > 0));
}

#[tokio::test]
async fn a_write_that_meets_a_newer_binding_takes_it() {
    // Ours is version 2, believed to be over an older copy; the store
    // meanwhile holds version 4 elsewhere: the compare-and-set refuses
    // and the newer binding is adopted.
    let (a, s, local) = setup("meets-newer", 2, 0, Some(stored(4, "b2"))).await;
    let tier = TestTier(TIER.to_vec());
    let r = reconcile(&*a, &s, 7, &tier, local, InStore::Older).await;
    assert_eq!(r.unwrap(), Some(2));
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((2, 4)));
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(4, "b2")));
}

#[tokio::test]
async fn a_delete_leaves_a_newer_binding_and_takes_its_own() {
    let s = store("versioned-delete").await;
    s.delete(9, None).await.unwrap();
    assert_eq!(
        s.create(9, "default", &stored(3, "b1"), 600_000)
            .await
            .unwrap(),
        None
    );
    // A gateway forgetting its version 2 leaves the fleet's version 3.
    s.delete(9, Some(2)).await.unwrap();
    assert_eq!(s.peek(9).await.unwrap(), Some(stored(3, "b1")));
    // Its own version goes; the operator's delete takes any.
    s.delete(9, Some(3)).await.unwrap();
    assert_eq!(s.peek(9).await.unwrap(), None);
    assert_eq!(
        s.create(9, "default", &stored(5, "b2"), 600_000)
            .await
            .unwrap(),
        None
    );
    s.delete(9, None).await.unwrap();
    assert_eq!(s.peek(9).await.unwrap(), None);
}
