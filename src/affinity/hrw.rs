//! Keyed, weighted rendezvous hashing (HRW).
//!
//! Every gateway replica configured with the same `affinity.hash_key` computes
//! the same scores, so they agree on a session's backend without talking to each
//! other; without the key an outsider cannot predict (or aim) a session's
//! backend. The session key is hashed once with SipHash; each candidate then
//! costs one 64-bit mix with its precomputed, keyed seed (and a logarithm when
//! weights differ), which keeps a choice over 1,024 backends in microseconds.

use crate::secret::{Derived, IdKey};
use siphasher::sip::SipHasher13;
use siphasher::sip128::{
    Hasher128, SipHasher13 as SipHasher13_128, SipHasher24 as SipHasher24_128,
};
use std::hash::Hasher;

/// Separates the hash inputs of client sessions from subagent groups, so no
/// client-sent session id can ever hash to a group's key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum KeyKind {
    Session = 1,
    Group = 2,
    /// A conversation named by its prompt (`affinity.prefix`), not by the client.
    Prompt = 3,
    /// A stored response's id (`previous_response_id`).
    Response = 4,
}

/// The keyed hash functions of one fleet (one `hash_key`), each use keyed
/// with its own subkey ([`crate::secret`]).
#[derive(Clone, Debug)]
pub struct HrwHasher {
    /// Placement: session hashes, backend seeds, the prompt block seed.
    k0: u64,
    k1: u64,
    /// Binding and tenant fingerprints.
    f0: u64,
    f1: u64,
    /// Tenants' cache salts.
    s0: u64,
    s1: u64,
    /// The key response ids are issued under, then the retired keys they
    /// still open under (`affinity.retired_hash_keys`).
    ids: std::sync::Arc<[IdKey]>,
}

impl HrwHasher {
    pub fn new(hash_key: &str) -> Self {
        Self::with_retired(hash_key, &[])
    }

    /// The hasher of `hash_key`, whose response ids also open under the
    /// `retired` keys (an operator rotating the secret).
    pub fn with_retired(hash_key: &str, retired: &[String]) -> Self {
        let d = Derived::of(hash_key);
        let ids = std::iter::once(d.ids)
            .chain(retired.iter().map(|r| Derived::of(r).ids))
            .collect();
        HrwHasher {
            k0: d.placement[0],
            k1: d.placement[1],
            f0: d.fingerprint[0],
            f1: d.fingerprint[1],
            s0: d.salt[0],
            s1: d.salt[1],
            ids,
        }
    }

    /// The key response ids are issued under, then those they still open
    /// under.
    pub fn id_keys(&self) -> &[IdKey] {
        &self.ids
    }

    /// The per-request hash a session is scored with.
    pub fn session_hash(&self, kind: KeyKind, tier: &str, id: &str) -> u64 {
        self.session_hash_bytes(kind, tier, id.as_bytes())
    }

    /// [`HrwHasher::session_hash`] of an id that is not text (a digest).
    pub fn session_hash_bytes(&self, kind: KeyKind, tier: &str, id: &[u8]) -> u64 {
        let mut h = SipHasher13::new_with_keys(self.k0, self.k1);
        h.write_u8(kind as u8);
        h.write(tier.as_bytes());
        h.write_u8(0xff);
        h.write(id);
        h.finish()
    }

    /// The identity of a binding in the table: a 128-bit keyed fingerprint of
    /// (kind, tier, id). Storing it instead of the id bounds the memory of a
    /// binding regardless of how long the client's id is.
    pub fn fingerprint(&self, kind: KeyKind, tier: &str, id: &str) -> u128 {
        self.fingerprint_bytes(kind, tier, id.as_bytes())
    }

    /// [`HrwHasher::fingerprint`] of an id that is not text (a digest).
    pub fn fingerprint_bytes(&self, kind: KeyKind, tier: &str, id: &[u8]) -> u128 {
        let mut h = SipHasher13_128::new_with_keys(self.f0, self.f1);
        h.write_u8(kind as u8);
        h.write(tier.as_bytes());
        h.write_u8(0xff);
        h.write(id);
        let v = h.finish128();
        ((v.h1 as u128) << 64) | v.h2 as u128
    }

    /// A 128-bit tag of `message` under `scope`, keyed by the fleet's
    /// cache-salt subkey (SipHash-2-4, a keyed PRF for short messages):
    /// what a tenant's `cache_salt` is made of, so that only a gateway of
    /// this fleet makes it.
    pub fn salt_tag(&self, scope: &str, message: &[u8]) -> u128 {
        let mut h = SipHasher24_128::new_with_keys(self.s0, self.s1);
        h.write_u64(scope.len() as u64);
        h.write(scope.as_bytes());
        h.write(message);
        let v = h.finish128();
        ((v.h1 as u128) << 64) | v.h2 as u128
    }

    /// The seed prompts' block hashes start from (`affinity.prefix`): every
    /// gateway with this key cuts and names prompts alike, and outsiders
    /// cannot aim blocks at an index entry.
    pub fn prefix_seed(&self) -> u64 {
        mix(self.k0 ^ mix(self.k1 ^ 0x7072_6566_6978))
    }

    /// The seed a backend is scored with; computed once per config load.
    pub fn backend_seed(&self, backend_id: &str) -> u64 {
        let mut h = SipHasher13::new_with_keys(self.k1 ^ 0x5bd1_e995, self.k0);
        h.write(backend_id.as_bytes());
        h.finish()
    }
}

/// A bijective 64-bit finalizer (splitmix64): every output bit depends on
/// every input bit, so `mix(session ^ seed)` behaves as an independent hash per
/// (session, backend) pair.
#[inline]
pub fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The weighted score `-w / ln(u)` with `u` uniform in (0, 1): the backend
/// with the highest score wins, and backend `i` wins with probability
/// `w_i / Σw`.
#[inline]
pub fn weighted_score(session: u64, seed: u64, weight: u32) -> f64 {
    let h = mix(session ^ seed);
    let u = ((h >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
    -(weight as f64) / u.ln()
}

/// One backend as HRW sees it.
pub trait Scored {
    fn seed(&self) -> u64;
    fn weight(&self) -> u32;
}

/// Index of the HRW winner among `items`, or `None` when empty.
pub fn choose<T: Scored>(session: u64, items: &[T]) -> Option<usize> {
    choose_where(session, items, |_| true)
}

/// Index of the highest-ranked item that `allowed` accepts: the first of the
/// session's HRW order that passes, found in one pass without sorting.
pub fn choose_where<T: Scored>(
    session: u64,
    items: &[T],
    allowed: impl Fn(usize) -> bool,
) -> Option<usize> {
    let first = items.first()?;
    let uniform = items.iter().all(|b| b.weight() == first.weight());
    let allowed_items = items.iter().enumerate().filter(|&(i, _)| allowed(i));
    if uniform {
        // Equal weights: -w/ln(u) is monotonic in u, so the raw hash orders the same.
        allowed_items
            .max_by_key(|&(_, b)| mix(session ^ b.seed()))
            .map(|(i, _)| i)
    } else {
        allowed_items
            .map(|(i, b)| (i, weighted_score(session, b.seed(), b.weight())))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(i, _)| i)
    }
}

/// Index of the item with the least `key` (`None`: not allowed), the
/// session's HRW order breaking ties; one pass, and an item's hash is scored
/// only when its key ties or beats the least so far.
pub fn choose_least<T: Scored>(
    session: u64,
    items: &[T],
    key: impl Fn(usize) -> Option<u64>,
) -> Option<usize> {
    let first = items.first()?;
    if items.iter().all(|b| b.weight() == first.weight()) {
        // Equal weights: the raw hash orders as the weighted score does.
        least_then_highest(items, key, |b| mix(session ^ b.seed()))
    } else {
        least_then_highest(items, key, |b| {
            weighted_score(session, b.seed(), b.weight())
        })
    }
}

fn least_then_highest<T, S: PartialOrd + Copy>(
    items: &[T],
    key: impl Fn(usize) -> Option<u64>,
    score: impl Fn(&T) -> S,
) -> Option<usize> {
    let mut least = Least::default();
    for (i, item) in items.iter().enumerate() {
        if let Some(k) = key(i) {
            least.offer(i, k, || score(item));
        }
    }
    least.index()
}

/// The item with the least key offered so far, the highest score breaking
/// ties; an item is scored only when its key ties or beats the least.
struct Least<S> {
    best: Option<(usize, u64, S)>,
}

impl<S> Default for Least<S> {
    fn default() -> Self {
        Least { best: None }
    }
}

impl<S: PartialOrd + Copy> Least<S> {
    fn offer(&mut self, i: usize, k: u64, score: impl FnOnce() -> S) {
        if self.best.is_some_and(|(_, least, _)| k > least) {
            return;
        }
        let s = score();
        if !self
            .best
            .is_some_and(|(_, least, top)| k == least && s <= top)
        {
            self.best = Some((i, k, s));
        }
    }

    fn index(&self) -> Option<usize> {
        self.best.map(|(i, _, _)| i)
    }
}

/// [`choose_least`] over two sets in one pass: `key(i)` gives an item's key
/// and whether it is in the narrower set (`None`: in neither). Returns the
/// least of the narrower set and the least of all offered.
pub fn choose_least_of_two<T: Scored>(
    session: u64,
    items: &[T],
    key: impl Fn(usize) -> Option<(u64, bool)>,
) -> (Option<usize>, Option<usize>) {
    let Some(first) = items.first() else {
        return (None, None);
    };
    if items.iter().all(|b| b.weight() == first.weight()) {
        least_of_two(items, key, |b| mix(session ^ b.seed()))
    } else {
        least_of_two(items, key, |b| {
            weighted_score(session, b.seed(), b.weight())
        })
    }
}

fn least_of_two<T, S: PartialOrd + Copy>(
    items: &[T],
    key: impl Fn(usize) -> Option<(u64, bool)>,
    score: impl Fn(&T) -> S,
) -> (Option<usize>, Option<usize>) {
    let (mut narrow, mut all) = (Least::default(), Least::default());
    for (i, item) in items.iter().enumerate() {
        let Some((k, in_narrow)) = key(i) else {
            continue;
        };
        // Scored at most once, for whichever set asks first.
        let mut scored = None;
        if in_narrow {
            narrow.offer(i, k, || *scored.get_or_insert_with(|| score(item)));
        }
        all.offer(i, k, || *scored.get_or_insert_with(|| score(item)));
    }
    (narrow.index(), all.index())
}

/// Candidates in descending HRW order (the failover order for a session).
pub fn ranked<T: Scored>(session: u64, items: &[T]) -> Vec<usize> {
    let mut idx: Vec<(f64, usize)> = items
        .iter()
        .enumerate()
        .map(|(i, b)| (weighted_score(session, b.seed(), b.weight()), i))
        .collect();
    idx.sort_by(|a, b| b.0.total_cmp(&a.0));
    idx.into_iter().map(|(_, i)| i).collect()
}

/// A hasher for keys that are uniform hashes already (binding keys, block
/// hashes, tenant ids, conversation keys): it takes the key's low bits as
/// they are instead of hashing them again.
#[derive(Default)]
pub struct Uniform(u64);

impl std::hash::Hasher for Uniform {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
    fn write_u128(&mut self, v: u128) {
        self.0 = v as u64;
    }
}

/// A map keyed by uniform hashes ([`Uniform`]).
pub type UniformMap<K, V> = std::collections::HashMap<K, V, std::hash::BuildHasherDefault<Uniform>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone)]
    struct B {
        seed: u64,
        weight: u32,
    }
    impl Scored for B {
        fn seed(&self) -> u64 {
            self.seed
        }
        fn weight(&self) -> u32 {
            self.weight
        }
    }

    fn fleet(h: &HrwHasher, n: usize, weight: impl Fn(usize) -> u32) -> Vec<B> {
        (0..n)
            .map(|i| B {
                seed: h.backend_seed(&format!("vllm-{i}")),
                weight: weight(i),
            })
            .collect()
    }

    fn owner(h: &HrwHasher, fleet: &[B], key: usize) -> usize {
        choose(
            h.session_hash(KeyKind::Session, "t", &format!("s{key}")),
            fleet,
        )
        .unwrap()
    }

    #[test]
    fn choose_least_takes_the_least_key_and_breaks_ties_in_hrw_order() {
        let h = HrwHasher::new("k");
        for weights in [[1u32, 1, 1, 1, 1], [1, 2, 3, 1, 2]] {
            let f = fleet(&h, 5, |i| weights[i]);
            for s in 0..2_000u64 {
                // All tie: the HRW winner. Some not allowed: the HRW winner of
                // the rest (as choose_where).
                assert_eq!(choose_least(s, &f, |_| Some(7)), choose(s, &f));
                assert_eq!(
                    choose_least(s, &f, |i| (i % 2 == 0).then_some(0)),
                    choose_where(s, &f, |i| i % 2 == 0)
                );
                // Keys 3, 1, 2, 1, 5: backends 1 and 3 tie at the least, hash decides.
                let keys = [3u64, 1, 2, 1, 5];
                assert_eq!(
                    choose_least(s, &f, |i| Some(keys[i])),
                    choose_where(s, &f, |i| keys[i] == 1)
                );
            }
            assert_eq!(choose_least(1, &f, |_| None), None);
        }
    }

    #[test]
    fn choose_least_of_two_is_choose_least_of_each_set_in_one_pass() {
        let h = HrwHasher::new("k");
        let keys = [3u64, 1, 2, 1, 5, 0, 2];
        for weights in [[1u32; 7], [1, 2, 3, 1, 2, 1, 3]] {
            let f = fleet(&h, 7, |i| weights[i]);
            for s in 0..2_000u64 {
                // Backend 6 is in neither set; the narrower one is 0, 2, 4.
                let key = |i: usize| (i != 6).then(|| (keys[i], i.is_multiple_of(2)));
                let narrow =
                    choose_least(s, &f, |i| (i.is_multiple_of(2) && i != 6).then(|| keys[i]));
                let all = choose_least(s, &f, |i| (i != 6).then(|| keys[i]));
                assert_eq!(choose_least_of_two(s, &f, key), (narrow, all));
            }
            assert_eq!(choose_least_of_two(1, &f, |_| None), (None, None));
        }
    }

    #[test]
    fn removing_one_backend_moves_only_its_sessions() {
        let h = HrwHasher::new("k");
        let full = fleet(&h, 8, |_| 1);
        let removed = 3;
        let mut less = full.clone();
        less.remove(removed);
        for key in 0..20_000 {
            let before = owner(&h, &full, key);
            let after = owner(&h, &less, key);
            let after_in_full = if after >= removed { after + 1 } else { after };
            if before != removed {
                assert_eq!(
                    before, after_in_full,
                    "session {key} moved off a live backend"
                );
            }
        }
    }

    #[test]
    fn adding_one_backend_moves_about_one_in_n_plus_one() {
        let h = HrwHasher::new("k");
        let n = 7;
        let small = fleet(&h, n, |_| 1);
        let big = fleet(&h, n + 1, |_| 1);
        let keys = 50_000;
        let moved = (0..keys)
            .filter(|&k| owner(&h, &small, k) != owner(&h, &big, k))
            .count();
        let share = moved as f64 / keys as f64;
        let ideal = 1.0 / (n + 1) as f64;
        assert!((share - ideal).abs() < 0.01, "moved {share}, ideal {ideal}");
        // Every moved session went to the new backend.
        for k in 0..keys {
            let (a, b) = (owner(&h, &small, k), owner(&h, &big, k));
            assert!(a == b || b == n);
        }
    }

    #[test]
    fn weights_are_honoured_within_a_few_percent() {
        let h = HrwHasher::new("k");
        let weights = [1u32, 2, 3, 4];
        let f = fleet(&h, 4, |i| weights[i]);
        let keys = 100_000;
        let mut counts = [0usize; 4];
        for k in 0..keys {
            counts[owner(&h, &f, k)] += 1;
        }
        let total: u32 = weights.iter().sum();
        for i in 0..4 {
            let expected = weights[i] as f64 / total as f64;
            let got = counts[i] as f64 / keys as f64;
            assert!(
                (got - expected).abs() / expected < 0.03,
                "backend {i}: got {got}, expected {expected}"
            );
        }
    }

    #[test]
    fn uniform_spread_is_balanced() {
        let h = HrwHasher::new("k");
        let f = fleet(&h, 3, |_| 1);
        let mut counts = [0usize; 3];
        for k in 0..30_000 {
            counts[owner(&h, &f, k)] += 1;
        }
        for c in counts {
            assert!((c as f64 - 10_000.0).abs() < 400.0, "{counts:?}");
        }
    }

    #[test]
    fn hash_key_changes_placement_and_kinds_are_separate() {
        let a = HrwHasher::new("fleet-a");
        let b = HrwHasher::new("fleet-b");
        let same_a = HrwHasher::new("fleet-a");
        assert_eq!(
            a.session_hash(KeyKind::Session, "t", "s1"),
            same_a.session_hash(KeyKind::Session, "t", "s1")
        );
        assert_ne!(
            a.session_hash(KeyKind::Session, "t", "s1"),
            b.session_hash(KeyKind::Session, "t", "s1")
        );
        assert_ne!(
            a.fingerprint(KeyKind::Session, "t", "p"),
            a.fingerprint(KeyKind::Group, "t", "p")
        );
        // Different keys disagree on roughly (n-1)/n of placements.
        let fa = fleet(&a, 4, |_| 1);
        let fb = fleet(&b, 4, |_| 1);
        let differ = (0..4000)
            .filter(|&k| owner(&a, &fa, k) != owner(&b, &fb, k))
            .count();
        assert!(differ > 2500, "{differ}");
    }

    #[test]
    fn ranked_starts_with_the_winner() {
        let h = HrwHasher::new("k");
        let f = fleet(&h, 16, |i| 1 + (i % 3) as u32);
        for k in 0..1000 {
            let s = h.session_hash(KeyKind::Session, "t", &format!("s{k}"));
            let r = ranked(s, &f);
            assert_eq!(r[0], choose(s, &f).unwrap());
            assert_eq!(r.len(), 16);
        }
    }
}
