//! A fleet's shared bindings ([`Fleet`], the router's
//! [`BindingStore`] when `affinity.store: redis`): kept in step with the
//! store by the invariant of [`reconcile`]; its background work
//! ([`Fleet::run`]) is the subscription, the heartbeat, and writing back what
//! an outage left behind.

use super::store::{SharedStore, StoreError, Stored, StoredMoves};
use crate::affinity::shared::{BindingStore, LocalBindings, TierBackends, Tiers};
use crate::affinity::{Binding, BindingKey, Reason, Selection};
use std::sync::Arc;
use std::time::Duration;

/// A fleet of gateways sharing bindings through Redis.
pub struct Fleet {
    pub store: Arc<SharedStore>,
}

#[async_trait::async_trait]
impl BindingStore for Fleet {
    async fn sync_in(
        &self,
        affinity: &dyn LocalBindings,
        key: BindingKey,
        tier: &dyn TierBackends,
    ) {
        sync_in(affinity, &self.store, key, tier).await
    }

    async fn publish(
        &self,
        affinity: &dyn LocalBindings,
        key: BindingKey,
        tier: &dyn TierBackends,
        sel: &Selection,
    ) -> Option<u32> {
        publish(affinity, &self.store, key, tier, sel).await
    }

    fn forget(&self, key: BindingKey, own: Option<(u32, String)>) {
        let store = Arc::clone(&self.store);
        tokio::spawn(async move {
            let own = own.as_ref().map(|(v, b)| (*v, b.as_str()));
            let _ = store.delete(key, own).await;
        });
    }

    async fn forget_now(&self, key: BindingKey) {
        let _ = self.store.delete(key, None).await;
    }
}

/// This gateway's binding as the store keeps it: its moves travel with it,
/// so soft mode's cap and cooldown hold fleet-wide.
fn as_stored(affinity: &dyn LocalBindings, local: &Binding, backend: String) -> Stored {
    Stored {
        version: local.version,
        backend,
        moves: StoredMoves::from_table(local.moves, affinity.now_ms(), crate::clock::unix_ms()),
    }
}

/// Take the store's binding `s` for `key` in (its backend is `slot` here),
/// as the store said it at `checked_ms`: it wins over a local binding as new
/// as it (the store decided a race), and keeps the moves it made elsewhere.
pub(super) fn adopt_stored(
    affinity: &dyn LocalBindings,
    key: BindingKey,
    s: &Stored,
    slot: u32,
    tier: &dyn TierBackends,
    checked_ms: u64,
) {
    let b = Binding {
        backend: slot,
        version: s.version,
        tier: tier.index(),
        deadline_ms: checked_ms + affinity.ttl_ms(),
        moves: s.moves.to_table(affinity.now_ms(), crate::clock::unix_ms()),
        ..Binding::default()
    };
    affinity.adopt(key, b, true, checked_ms);
}

/// Bring `key`'s local binding up to the store's when it was last checked
/// too long ago. A key this gateway holds no binding for is not looked up:
/// its first binding is written create-if-absent, which answers with the
/// fleet's binding if there is one. Never fails a request: on a store error
/// the local state stands.
async fn sync_in(
    affinity: &dyn LocalBindings,
    store: &SharedStore,
    key: BindingKey,
    tier: &dyn TierBackends,
) {
    let ttl = affinity.ttl_ms();
    if ttl == 0 || !store.healthy() {
        return;
    }
    let now = affinity.now_ms();
    // 0: never checked (placed or restored while the store was away).
    let fresh = match affinity.synced_ms(key) {
        None => true,
        Some(t) => {
            t > 0
                && t >= store.resync_since()
                && now.saturating_sub(t) < store.config().revalidate.as_millis() as u64
        }
    };
    if fresh {
        return;
    }
    let Ok(stored) = store.sync(key, ttl).await else {
        return;
    };
    if let Some(local) = affinity.binding(key) {
        let known = match stored {
            Some(s) => InStore::Found(s),
            None => InStore::Absent,
        };
        let _ = reconcile(affinity, store, key, tier, local, known).await;
    }
}

/// What this gateway knows of the store's binding for a key.
pub(super) enum InStore {
    /// None there (or a new binding of ours, to write create-if-absent).
    Absent,
    /// Older than ours (a rebind of ours, to write as a compare-and-set).
    Older,
    Found(Stored),
}

/// Bring the store and this gateway to one binding for `key`, whose local
/// binding is `local` and of whose stored one this gateway knows `known`:
/// the store's invariant. The newer version wins, whichever side holds it — the store's
/// is adopted, ours is written over it (a compare-and-set that never
/// overwrites a newer one); at the same version the store's word stands (it
/// decided a race). The key is marked synced only once both agree. Returns
/// the slot the session's turns go to now when the store's binding won and
/// this gateway has its backend.
///
/// A stored backend this gateway does not have in the tier (a reload that
/// added it elsewhere first) is the one exception: the session is served
/// from local state and the key marked synced, without overwriting the
/// store; once a reload here adds the backend, the next check follows it.
pub(super) async fn reconcile(
    affinity: &dyn LocalBindings,
    store: &SharedStore,
    key: BindingKey,
    tier: &dyn TierBackends,
    local: Binding,
    mut known: InStore,
) -> Result<Option<u32>, StoreError> {
    let ttl = affinity.ttl_ms();
    let Some(id) = tier.backend_id(local.backend).map(str::to_string) else {
        return Ok(None);
    };
    // Our write may meet another binding: the next round compares with it
    // (and, only if it is older still, writes once more).
    let ours = as_stored(affinity, &local, id.clone());
    for _ in 0..3 {
        let now = affinity.now_ms();
        let answer = match &known {
            InStore::Absent => store.create(key, tier.name(), &ours, ttl).await,
            InStore::Older => store.rebind(key, tier.name(), &ours, ttl).await,
            InStore::Found(s) if s.version < local.version => {
                store.rebind(key, tier.name(), &ours, ttl).await
            }
            InStore::Found(s) if s.version == local.version && s.backend == id => {
                affinity.mark_synced(key, now);
                return Ok(None);
            }
            InStore::Found(s) => {
                return Ok(match tier.backend_slot(&s.backend) {
                    Some(slot) => {
                        adopt_stored(affinity, key, s, slot, tier, now);
                        Some(slot)
                    }
                    None => {
                        affinity.mark_synced(key, now);
                        None
                    }
                });
            }
        };
        match answer {
            Ok(None) => {
                affinity.mark_synced(key, now);
                return Ok(None);
            }
            Ok(Some(other)) => known = InStore::Found(other),
            Err(e) => {
                store.remember_unsynced(key);
                return Err(e);
            }
        }
    }
    Ok(None)
}

/// Tell the store what this request bound (see [`BindingStore::publish`]).
async fn publish(
    affinity: &dyn LocalBindings,
    store: &SharedStore,
    key: BindingKey,
    tier: &dyn TierBackends,
    sel: &Selection,
) -> Option<u32> {
    let ttl = affinity.ttl_ms();
    if ttl == 0 || sel.lease.is_none() {
        return None;
    }
    let first = match sel.reason {
        _ if sel.created => true,
        r if r.new_binding() => true,
        Reason::Broken | Reason::Moved => false,
        _ => return None,
    };
    if !store.healthy() {
        store.remember_unsynced(key);
        return None;
    }
    let moves = affinity
        .binding(key)
        .filter(|b| b.version == sel.version)
        .map(|b| b.moves)
        .unwrap_or_default();
    let local = Binding {
        backend: sel.backend,
        version: sel.version,
        tier: tier.index(),
        in_flight: 1,
        deadline_ms: 0,
        pending: false,
        moves,
    };
    // A new binding is written create-if-absent (a gateway that raced on
    // the same new session may have written first), a rebind as a
    // compare-and-set; either way the newer binding wins.
    let known = if first {
        InStore::Absent
    } else {
        InStore::Older
    };
    reconcile(affinity, store, key, tier, local, known)
        .await
        .ok()
        .flatten()
}

/// Another gateway bound, rebound or dropped `key` in `tier`: take it into
/// the local table, so this gateway's next turn of the session needs no
/// lookup.
fn apply_remote(
    affinity: &dyn LocalBindings,
    tiers: &dyn Tiers,
    key: BindingKey,
    tier: &str,
    stored: Option<Stored>,
) {
    let now = affinity.now_ms();
    let Some(stored) = stored else {
        affinity.forget_here(key);
        return;
    };
    let Some(tier) = tiers.by_name(tier) else {
        return;
    };
    // A message is what the store accepted: it wins over a local binding
    // as new as it.
    if let Some(slot) = tier.backend_slot(&stored.backend) {
        adopt_stored(affinity, key, &stored, slot, &*tier, now);
    }
}

/// The store came back without what it held: every local binding is
/// written back create-if-absent (the newer version wins where gateways
/// differ), so that the fleet agrees again at once, not only as each
/// binding is next revalidated.
async fn reseed(affinity: &dyn LocalBindings, tiers: &dyn Tiers, store: &SharedStore) {
    let bindings = affinity.bindings();
    log::warn!(
        "binding store lost its data (a new epoch); writing back {} bindings",
        bindings.len()
    );
    let mut left = bindings.into_iter();
    while let Some((key, b)) = left.next() {
        let Some(tier) = tiers.by_index(b.tier) else {
            continue;
        };
        if reconcile(affinity, store, key, &*tier, b, InStore::Absent)
            .await
            .is_err()
        {
            // Down again: what is left is written back when it returns.
            for (rest, _) in left {
                store.remember_unsynced(rest);
            }
            break;
        }
    }
    store.reseeded();
}

/// Bindings made while Redis was unreachable, written back create-if-absent:
/// where another gateway wrote one meanwhile, this gateway adopts it.
async fn write_back(affinity: &dyn LocalBindings, tiers: &dyn Tiers, store: &SharedStore) {
    let (mut settled, mut adopted) = (0, 0);
    let mut keys = store.take_unsynced().into_iter();
    while let Some(key) = keys.next() {
        let Some(b) = affinity.binding(key) else {
            continue;
        };
        let Some(tier) = tiers.by_index(b.tier) else {
            continue;
        };
        match reconcile(affinity, store, key, &*tier, b, InStore::Absent).await {
            Ok(None) => settled += 1,
            Ok(Some(_)) => adopted += 1,
            // Down again: this key is remembered (by reconcile) and so is
            // every one not tried yet, for the next time it is back.
            Err(_) => {
                for rest in keys {
                    store.remember_unsynced(rest);
                }
                break;
            }
        }
    }
    if settled + adopted > 0 {
        log::info!(
            "binding store back: {settled} bindings made during the outage in step, {adopted} replaced by newer ones"
        );
    }
}

impl Fleet {
    /// The store's background work: the invalidation subscription, the
    /// heartbeat that proves it alive, and while Redis is down, probing it
    /// and writing back when it returns. `tiers`: the configuration in force.
    pub async fn run(&self, affinity: Arc<dyn LocalBindings>, tiers: Arc<dyn Tiers>) {
        let store = &self.store;
        let (sub_affinity, sub_tiers) = (Arc::clone(&affinity), Arc::clone(&tiers));
        let (resync_affinity, resync_store) = (Arc::clone(&affinity), Arc::clone(store));
        tokio::spawn(Arc::clone(store).run_subscriber(
            move |key, tier: &str, stored| {
                apply_remote(&*sub_affinity, &*sub_tiers, key, tier, stored)
            },
            move || resync_store.mark_resync(resync_affinity.now_ms()),
        ));
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        let mut heartbeat = tokio::time::interval(store.config().heartbeat);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    // Down (or not connected yet): connect, then check it answers.
                    let up = store.healthy() || (store.connect().await && store.ping().await);
                    if up && store.lost_its_data().await.unwrap_or(false) {
                        reseed(&*affinity, &*tiers, store).await;
                    }
                    if up && store.has_unsynced() {
                        write_back(&*affinity, &*tiers, store).await;
                    }
                }
                _ = heartbeat.tick() => {
                    if store.healthy() {
                        let _ = store.heartbeat().await;
                    }
                }
            }
        }
    }
}
