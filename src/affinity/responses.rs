//! Stored responses: a response id is a route.
//!
//! vLLM and SGLang keep what the Responses API stores in the memory of the
//! replica that answered; a follow-up naming it by `previous_response_id`
//! anywhere else gets 404. The gateway learns each response's id from its
//! answer (the JSON body's `id`, or a stream's `response.created` event) and
//! sends a follow-up to the backend that holds it, as a turn of the session
//! that made it: its binding, prefix holdings, class and metrics are that
//! session's. When that backend is gone, the chain's state is gone with it,
//! and the follow-up gets `previous_response_not_found`, never another
//! replica (which could only answer 404 itself, or worse, a stale copy).
//!
//! Routes are kept like bindings: for the bindings' TTL after they were
//! learned, at most `affinity.max_bindings` of them (the oldest go first),
//! scoped by tier and tenant (one tenant's response ids route nothing of
//! another's), and shared through the fleet's store when there is one, so
//! that any gateway routes a follow-up.

use super::hrw::{HrwHasher, KeyKind, UniformMap};
use super::table::BindingKey;
use parking_lot::Mutex;
use std::collections::VecDeque;

/// Where a stored response lives, and whose it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResponseRoute {
    /// The backend that stored it.
    pub slot: u32,
    /// The session its request was a turn of (binding key and hash).
    pub key: BindingKey,
    pub hash: u64,
}

#[derive(Clone, Copy)]
struct Entry {
    route: ResponseRoute,
    learned_ms: u64,
}

struct Inner {
    map: UniformMap<u64, Entry>,
    /// (id, when learned) in learning order: capacity and age.
    order: VecDeque<(u64, u64)>,
    cap: usize,
    ttl_ms: u64,
}

pub struct ResponseRoutes {
    inner: Mutex<Inner>,
}

/// The key a response id is kept under: keyed by `affinity.hash_key` and
/// scoped by `scope` (tier and tenant).
pub fn response_key(hasher: &HrwHasher, scope: &str, id: &str) -> u64 {
    let fp = hasher.fingerprint(KeyKind::Response, scope, id);
    (fp >> 64) as u64 ^ fp as u64
}

/// A route as the fleet's store keeps it: the backend's id (slots are each
/// gateway's own), then the session's key and hash.
pub fn stored_value(backend: &str, route: &ResponseRoute) -> String {
    format!("{backend} {:032x} {:016x}", route.key, route.hash)
}

/// [`stored_value`] read back: the backend's id and the route without its
/// slot, which the reader finds by that id.
pub fn parse_stored(value: &str) -> Option<(&str, BindingKey, u64)> {
    let mut parts = value.rsplitn(3, ' ');
    let hash = u64::from_str_radix(parts.next()?, 16).ok()?;
    let key = BindingKey::from_str_radix(parts.next()?, 16).ok()?;
    let backend = parts.next().filter(|b| !b.is_empty())?;
    Some((backend, key, hash))
}

impl ResponseRoutes {
    pub fn new(cap: usize, ttl_ms: u64) -> Self {
        ResponseRoutes {
            inner: Mutex::new(Inner {
                map: UniformMap::default(),
                order: VecDeque::new(),
                cap: cap.max(1),
                ttl_ms,
            }),
        }
    }

    /// Apply what a reload may change: the bound and the TTL.
    pub fn configure(&self, cap: usize, ttl_ms: u64) {
        let mut inner = self.inner.lock();
        inner.cap = cap.max(1);
        inner.ttl_ms = ttl_ms;
    }

    /// The response kept under `id` (see [`response_key`]) was stored by
    /// `route.slot`.
    pub fn learn(&self, id: u64, route: ResponseRoute, now_ms: u64) {
        let mut inner = self.inner.lock();
        inner.map.insert(
            id,
            Entry {
                route,
                learned_ms: now_ms,
            },
        );
        inner.order.push_back((id, now_ms));
        inner.trim(now_ms);
    }

    /// Where the response kept under `id` lives, while its route is live.
    pub fn find(&self, id: u64, now_ms: u64) -> Option<ResponseRoute> {
        let inner = self.inner.lock();
        let e = inner.map.get(&id)?;
        (now_ms.saturating_sub(e.learned_ms) <= inner.ttl_ms).then_some(e.route)
    }

    /// How long a route lives after it was learned.
    pub fn ttl_ms(&self) -> u64 {
        self.inner.lock().ttl_ms
    }

    /// Routes kept now.
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Background upkeep: routes past their TTL go. Returns how many.
    pub fn sweep(&self, now_ms: u64) -> usize {
        let mut inner = self.inner.lock();
        let before = inner.map.len();
        inner.trim(now_ms);
        before - inner.map.len()
    }

    /// `slot`'s backend left and the slot may come to name another: no
    /// route may send a follow-up there.
    pub fn forget_backend(&self, slot: u32) {
        self.inner.lock().map.retain(|_, e| e.route.slot != slot);
    }
}

impl Inner {
    /// Drop the oldest routes while over the bound or past the TTL.
    fn trim(&mut self, now_ms: u64) {
        while let Some(&(id, at)) = self.order.front() {
            let expired = now_ms.saturating_sub(at) > self.ttl_ms;
            if !expired && self.map.len() <= self.cap && self.order.len() <= 2 * self.cap {
                break;
            }
            self.order.pop_front();
            // Only the route this place was made for: one learned again
            // since has a later place of its own.
            if self.map.get(&id).is_some_and(|e| e.learned_ms == at) {
                self.map.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn route(slot: u32) -> ResponseRoute {
        ResponseRoute {
            slot,
            key: 7,
            hash: 9,
        }
    }

    #[test]
    fn a_learned_response_routes_to_its_backend_until_its_ttl() {
        let r = ResponseRoutes::new(10, 1_000);
        r.learn(1, route(2), 100);
        assert_eq!(r.find(1, 100), Some(route(2)));
        assert_eq!(r.find(1, 1_100), Some(route(2)));
        assert_eq!(r.find(1, 1_101), None, "past its TTL");
        assert_eq!(r.find(2, 100), None, "never learned");
        assert_eq!(r.sweep(1_101), 1);
        assert!(r.is_empty());
    }

    #[test]
    fn routes_are_bounded_and_the_oldest_go_first() {
        let r = ResponseRoutes::new(3, 60_000);
        for id in 0..10 {
            r.learn(id, route(id as u32), id);
        }
        assert_eq!(r.len(), 3);
        assert_eq!(r.find(6, 10), None);
        assert_eq!(r.find(9, 10), Some(route(9)));
        // A route learned again keeps its newer place.
        r.learn(7, route(1), 20);
        r.learn(100, route(0), 21);
        r.learn(101, route(0), 22);
        assert_eq!(r.find(7, 30), Some(route(1)));
        assert_eq!(r.find(8, 30), None);
    }

    #[test]
    fn a_backend_that_left_keeps_no_route() {
        let r = ResponseRoutes::new(10, 60_000);
        r.learn(1, route(2), 0);
        r.learn(2, route(3), 0);
        r.forget_backend(2);
        assert_eq!(r.find(1, 1), None);
        assert_eq!(r.find(2, 1), Some(route(3)));
    }

    #[test]
    fn a_stored_route_reads_back_and_junk_does_not() {
        let r = ResponseRoute {
            slot: 3,
            key: u128::MAX - 5,
            hash: 0xabc,
        };
        let v = stored_value("vllm 1", &r);
        assert_eq!(parse_stored(&v), Some(("vllm 1", r.key, r.hash)));
        for junk in ["", "vllm-1", "vllm-1 zz 12", " 00 12", "a b"] {
            assert_eq!(parse_stored(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn ids_are_scoped_by_tier_and_tenant() {
        let h = HrwHasher::new("k");
        let a = response_key(&h, "default", "resp_1");
        assert_ne!(a, response_key(&h, "default\u{1f}tenant-b", "resp_1"));
        assert_ne!(a, response_key(&h, "default", "resp_2"));
        assert_eq!(a, response_key(&h, "default", "resp_1"));
    }
}
