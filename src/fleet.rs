//! A gateway in a fleet: keeping its binding table in step with the shared
//! store (`affinity.store: redis`, see `affinity/store.rs`). The proxy calls
//! [`sync_in`] before choosing a backend and [`publish`] after; the store
//! service runs the subscription and writes back what an outage left behind.

use crate::affinity::store::{local_binding, SharedStore, StoreError, Stored, StoredMoves};
use crate::affinity::table::{Binding, Moves};
use crate::affinity::{BindingKey, Candidate, Reason, Selection, SessionRef};
use crate::gateway::Gateway;
use crate::upstream::Tier;
use std::sync::Arc;
use std::time::Duration;

fn ttl_ms(gw: &Gateway) -> u64 {
    gw.affinity.ttl().map_or(0, |t| t.as_millis() as u64)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// This gateway's binding as the store keeps it: its moves travel with it,
/// so soft mode's cap and cooldown hold fleet-wide.
fn as_stored(gw: &Gateway, local: &Binding, backend: String) -> Stored {
    Stored {
        version: local.version,
        backend,
        moves: StoredMoves::from_table(local.moves, gw.affinity.now_ms(), unix_ms()),
    }
}

/// A stored binding's moves on this gateway's table clock.
fn moves_here(gw: &Gateway, s: &Stored) -> Moves {
    s.moves.to_table(gw.affinity.now_ms(), unix_ms())
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
    let affinity = &gw.affinity;
    let now = gw.affinity.now_ms();
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
        let _ = reconcile(gw, store, key, tier, local, known).await;
    }
}

/// What this gateway knows of the store's binding for a key.
enum InStore {
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
async fn reconcile(
    gw: &Gateway,
    store: &SharedStore,
    key: BindingKey,
    tier: &Tier,
    local: Binding,
    mut known: InStore,
) -> Result<Option<u32>, StoreError> {
    let ttl = ttl_ms(gw);
    let affinity = &gw.affinity;
    let Some(id) = backend_id(tier, local.backend) else {
        return Ok(None);
    };
    // Our write may meet another binding: the next round compares with it
    // (and, only if it is older still, writes once more).
    let ours = as_stored(gw, &local, id.clone());
    for _ in 0..3 {
        let now = gw.affinity.now_ms();
        let answer = match &known {
            InStore::Absent => store.create(key, &tier.name, &ours, ttl).await,
            InStore::Older => store.rebind(key, &tier.name, &ours, ttl).await,
            InStore::Found(s) if s.version < local.version => {
                store.rebind(key, &tier.name, &ours, ttl).await
            }
            InStore::Found(s) if s.version == local.version && s.backend == id => {
                affinity.mark_synced(key, now);
                return Ok(None);
            }
            InStore::Found(s) => {
                return Ok(match tier.backend_by_id(&s.backend) {
                    Some(b) => {
                        let deadline = now + ttl;
                        let won = local_binding(s, b.slot, tier.index, deadline, moves_here(gw, s));
                        affinity.adopt(key, won, true, now);
                        Some(b.slot)
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

fn backend_id(tier: &Tier, slot: u32) -> Option<String> {
    tier.backend_by_slot(slot).map(|b| b.id.to_string())
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
    if !store.healthy() {
        store.remember_unsynced(sref.key);
        return None;
    }
    let moves = gw
        .affinity
        .binding(sref.key)
        .filter(|b| b.version == sel.version)
        .map(|b| b.moves)
        .unwrap_or_default();
    let local = Binding {
        backend: sel.backend,
        version: sel.version,
        tier: tier.index,
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
    let slot = reconcile(gw, store, sref.key, tier, local, known)
        .await
        .ok()
        .flatten()?;
    candidates.iter().position(|c| c.slot == slot)
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
    let affinity = &gw.affinity;
    let now = gw.affinity.now_ms();
    let Some(stored) = stored else {
        affinity.forget(key);
        return;
    };
    let routing = gw.routing();
    let Some(tier) = routing.tier_by_name(tier) else {
        return;
    };
    // A message is what the store accepted: it wins over a local binding
    // as new as it.
    if let Some(b) = tier.backend_by_id(&stored.backend) {
        affinity.adopt(
            key,
            local_binding(
                &stored,
                b.slot,
                tier.index,
                now + ttl_ms(gw),
                moves_here(gw, &stored),
            ),
            true,
            now,
        );
    }
}

/// Bindings made while Redis was unreachable, written back create-if-absent:
/// where another gateway wrote one meanwhile, this gateway adopts it.
async fn write_back(gw: &Gateway, store: &SharedStore) {
    let routing = gw.routing();
    let affinity = &gw.affinity;
    let (mut settled, mut adopted) = (0, 0);
    let mut keys = store.take_unsynced().into_iter();
    while let Some(key) = keys.next() {
        let Some(b) = affinity.binding(key) else {
            continue;
        };
        let Some(tier) = routing.tiers.iter().find(|t| t.index == b.tier) else {
            continue;
        };
        match reconcile(gw, store, key, tier, b, InStore::Absent).await {
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
    let mut heartbeat = tokio::time::interval(store.config().heartbeat);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                // Down (or not connected yet): connect, then check it answers.
                let up = store.healthy() || (store.connect().await && store.ping().await);
                if up && store.has_unsynced() {
                    write_back(&gw, &store).await;
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
