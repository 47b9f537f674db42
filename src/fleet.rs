//! A gateway in a fleet: keeping its binding table in step with the shared
//! store (`affinity.store: redis`, see `affinity/store.rs`). The proxy calls
//! [`sync_in`] before choosing a backend and [`publish`] after; the store
//! service runs the subscription and writes back what an outage left behind.

use crate::affinity::store::{local_binding, SharedStore, Stored};
use crate::affinity::{BindingKey, Candidate, Reason, Selection, SessionRef};
use crate::gateway::Gateway;
use crate::upstream::Tier;
use std::sync::Arc;
use std::time::Duration;

fn ttl_ms(gw: &Gateway) -> u64 {
    gw.affinity.ttl().map_or(0, |t| t.as_millis() as u64)
}

/// Bring `key`'s local binding up to the store's when it was last checked
/// too long ago. A key this gateway holds no binding for is not looked up:
/// its first binding is written create-if-absent, which answers with the
/// fleet's binding if there is one. Never fails a request: on a store error
/// the local state stands.
pub async fn sync_in(gw: &Gateway, store: &SharedStore, key: BindingKey, tier: &Tier) {
    let ttl = ttl_ms(gw);
    if ttl == 0 || !store.healthy() {
        return;
    }
    let table = gw.affinity.table();
    let now = gw.affinity.now_ms();
    // 0: never checked (placed or restored while the store was away).
    let fresh = match table.synced_ms(key, now) {
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
    match store.sync(key, ttl).await {
        Ok(Some(stored)) => match tier.backend_by_id(&stored.backend) {
            Some(b) => {
                // The store is the truth: as new but elsewhere, it wins too.
                table.adopt(
                    key,
                    local_binding(&stored, b.slot, tier.index, now + ttl),
                    true,
                    now,
                );
            }
            // A backend this gateway does not have in the tier (a reload
            // that added it elsewhere first): serve from local state without
            // overwriting the store; once a reload here adds the backend,
            // the next check follows the store.
            None => table.mark_synced(key, now),
        },
        Ok(None) => {
            // Not in the store (first turn, or its copy expired during a
            // long request): a live local binding is written back below.
            if let Some(b) = table.get(key, now) {
                if let Some(id) = backend_id(tier, b.backend) {
                    match store.create(key, &tier.name, b.version, &id, ttl).await {
                        Ok(Some(winner)) => {
                            adopt_winner(gw, key, tier, &winner);
                        }
                        Ok(None) => table.mark_synced(key, now),
                        Err(_) => store.remember_unsynced(key),
                    }
                }
            }
        }
        Err(_) => {}
    }
}

fn backend_id(tier: &Tier, slot: u32) -> Option<String> {
    tier.backend_by_slot(slot).map(|b| b.id.to_string())
}

/// Take the store's binding over ours (it won a race or is newer).
fn adopt_winner(gw: &Gateway, key: BindingKey, tier: &Tier, winner: &Stored) -> Option<u32> {
    let b = tier.backend_by_id(&winner.backend)?;
    let now = gw.affinity.now_ms();
    gw.affinity.table().adopt(
        key,
        local_binding(winner, b.slot, tier.index, now + ttl_ms(gw)),
        true,
        now,
    );
    Some(b.slot)
}

/// Tell the store what this request bound. Returns the candidate index to
/// use instead when the store already had another answer (a gateway that
/// raced on the same new session, or a newer rebind) that this gateway can
/// reach.
pub async fn publish(
    gw: &Gateway,
    store: &SharedStore,
    sref: &SessionRef,
    tier: &Tier,
    candidates: &[Candidate],
    sel: &Selection,
) -> Option<usize> {
    let ttl = ttl_ms(gw);
    if ttl == 0 || sel.lease.is_none() {
        return None;
    }
    let first = match sel.reason {
        r if r.new_binding() => true,
        Reason::Broken | Reason::Moved => false,
        _ => return None,
    };
    let id = backend_id(tier, sel.backend)?;
    if !store.healthy() {
        store.remember_unsynced(sref.key);
        return None;
    }
    let answer = if first {
        store
            .create(sref.key, &tier.name, sel.version, &id, ttl)
            .await
    } else {
        store
            .rebind(sref.key, &tier.name, sel.version, &id, ttl)
            .await
    };
    match answer {
        Ok(None) => {
            gw.affinity
                .table()
                .mark_synced(sref.key, gw.affinity.now_ms());
            None
        }
        Ok(Some(other)) if other.backend == id => {
            gw.affinity
                .table()
                .mark_synced(sref.key, gw.affinity.now_ms());
            None
        }
        Ok(Some(other)) => {
            let slot = adopt_winner(gw, sref.key, tier, &other)?;
            candidates.iter().position(|c| c.slot == slot)
        }
        Err(_) => {
            store.remember_unsynced(sref.key);
            None
        }
    }
}

/// Forget a binding everywhere (admin delete, a session's final turn).
pub fn forget(gw: &Arc<Gateway>, key: BindingKey) {
    if let Some(store) = gw.store.clone() {
        tokio::spawn(async move {
            let _ = store.delete(key).await;
        });
    }
}

/// Another gateway bound, rebound or dropped `key` in `tier`: take it into
/// the local table, so this gateway's next turn of the session needs no
/// lookup.
fn apply_remote(gw: &Gateway, key: BindingKey, tier: &str, stored: Option<Stored>) {
    let table = gw.affinity.table();
    let now = gw.affinity.now_ms();
    let Some(stored) = stored else {
        table.remove(key);
        return;
    };
    let routing = gw.routing();
    let Some(tier) = routing.tier_by_name(tier) else {
        return;
    };
    // A message is what the store accepted: it wins over a local binding
    // as new as it.
    if let Some(b) = tier.backend_by_id(&stored.backend) {
        table.adopt(
            key,
            local_binding(&stored, b.slot, tier.index, now + ttl_ms(gw)),
            true,
            now,
        );
    }
}

/// Bindings made while Redis was unreachable, written back create-if-absent:
/// where another gateway wrote one meanwhile, this gateway adopts it.
async fn write_back(gw: &Gateway, store: &SharedStore) {
    let ttl = ttl_ms(gw);
    let routing = gw.routing();
    let table = gw.affinity.table();
    let mut written = 0;
    let mut adopted = 0;
    for key in store.take_unsynced() {
        let now = gw.affinity.now_ms();
        let Some(b) = table.get(key, now) else {
            continue;
        };
        let Some(tier) = routing.tiers.iter().find(|t| t.index == b.tier) else {
            continue;
        };
        let Some(id) = backend_id(tier, b.backend) else {
            continue;
        };
        match store.create(key, &tier.name, b.version, &id, ttl).await {
            Ok(None) => {
                table.mark_synced(key, now);
                written += 1;
            }
            Ok(Some(other)) if other.backend == id => table.mark_synced(key, now),
            Ok(Some(other)) => {
                adopt_winner(gw, key, tier, &other);
                adopted += 1;
            }
            Err(_) => {
                store.remember_unsynced(key);
                break;
            }
        }
    }
    if written + adopted > 0 {
        log::info!(
            "binding store back: {written} bindings made during the outage written, {adopted} replaced by newer ones"
        );
    }
}

/// The store's background work: the invalidation subscription, and while
/// Redis is down, probing it and writing back when it returns.
pub async fn run(gw: Arc<Gateway>, store: Arc<SharedStore>) {
    let sub_gw = Arc::clone(&gw);
    let resync_gw = Arc::clone(&gw);
    let resync_store = Arc::clone(&store);
    tokio::spawn(Arc::clone(&store).run_subscriber(
        move |key, tier: &str, stored| apply_remote(&sub_gw, key, tier, stored),
        move || resync_store.mark_resync(resync_gw.affinity.now_ms()),
    ));
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        // Down (or not connected yet): connect, then check it answers.
        let up = store.healthy() || (store.connect().await && store.ping().await);
        if !up {
            continue;
        }
        if store.has_unsynced() {
            write_back(&gw, &store).await;
        }
    }
}
