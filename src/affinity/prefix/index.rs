//! The approximate prefix index: which backends recently computed which
//! prompt prefixes, so placement can send a prompt where most of it is
//! cached (SGLang's cache-aware router keeps a radix tree of text; this keeps
//! the chained block hashes of [`super::prompt`], like Dynamo's KV router).
//!
//! An entry is one block hash — a whole prefix, since hashes are chained —
//! with up to [`HOLDERS`] backends and when each last served it. Entries are
//! sharded, kept on an LRU list per shard and capped by memory; a holder
//! older than the TTL no longer counts.
//!
//! **Fed by routing, corrected by the engines.** Every routed prompt marks
//! its blocks as held by its backend. When the engine's answer shows far
//! fewer cached tokens than the index predicted there, the backend evicted:
//! engines evict least recently used blocks first, so every entry of that
//! backend as old as the oldest one the prediction leaned on is dropped (the
//! backend's *horizon*), and the age it had reached becomes the backend's
//! cache *lifetime*: younger entries count, older ones no longer do. A
//! backend that keeps more than predicted doubles its lifetime back.

use crate::affinity::table::MAX_BACKENDS;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

/// Backends recorded per block. A block held by more (a system prompt on a
/// large fleet) keeps the most recent ones.
pub const HOLDERS: usize = 6;

const NIL: u32 = u32::MAX;
const NO_SLOT: u32 = u32::MAX;

/// A long prompt is looked up every this many blocks (see
/// [`PrefixIndex::lookup`]).
pub const STRIDE: usize = 16;

/// One tick of the index's clock, ms.
pub const TICK_MS: u64 = 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Holder {
    slot: u32,
    /// When it last served the block, and in the top bit whether an answer
    /// has confirmed it (see [`CONFIRMED`]).
    tick: u32,
}

/// A holder is recorded when a request is routed, before the backend has
/// computed anything: placement must see it at once, or the next request of
/// the same prefix goes elsewhere. Only once an answer comes back is it
/// confirmed; an engine's cached tokens are weighed only against confirmed
/// holders (a request sent while the first one with its prefix still
/// prefills finds nothing cached, and that is no eviction).
const CONFIRMED: u32 = 1 << 31;

/// A holder no answer has confirmed counts this long at most (a request
/// that failed, or is still prefilling a very long prompt).
const PENDING_TICKS: u32 = 6_000;

/// A learned cache lifetime is never taken shorter than this (1 s).
const LIFETIME_FLOOR_TICKS: u32 = 100;

impl Holder {
    fn at(self) -> u32 {
        self.tick & !CONFIRMED
    }

    fn confirmed(self) -> bool {
        self.tick & CONFIRMED != 0
    }
}

const EMPTY: Holder = Holder {
    slot: NO_SLOT,
    tick: 0,
};

#[derive(Clone, Copy)]
struct Node {
    hash: u64,
    holders: [Holder; HOLDERS],
    prev: u32,
    next: u32,
}

/// Block hashes are already uniform: the map uses them as they are.
type Map = crate::affinity::hrw::UniformMap<u64, u32>;

/// Heap bytes one entry costs at most: its node, and its share of the map's
/// buckets (a slot and a control byte each). A shard's map is made for twice
/// its cap, so the tombstones that churn leaves are rehashed away in place
/// instead of doubling it; with the power-of-two rounding that is under
/// 32/7 buckets an entry.
pub const ENTRY_BYTES: usize =
    std::mem::size_of::<Node>() + (std::mem::size_of::<(u64, u32)>() + 1) * 32 / 7 + 1;

struct Shard {
    map: Map,
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    cap: usize,
}

impl Shard {
    fn unlink(&mut self, i: u32) {
        let Node { prev, next, .. } = self.nodes[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn push_head(&mut self, i: u32) {
        let old = self.head;
        let n = &mut self.nodes[i as usize];
        n.prev = NIL;
        n.next = old;
        match old {
            NIL => self.tail = i,
            o => self.nodes[o as usize].prev = i,
        }
        self.head = i;
    }

    /// `hash`'s node, made (evicting the least recently used when full) if
    /// absent, moved to the head. Returns it and whether one was evicted.
    fn touch(&mut self, hash: u64) -> (u32, bool) {
        if let Some(&i) = self.map.get(&hash) {
            if self.head != i {
                self.unlink(i);
                self.push_head(i);
            }
            return (i, false);
        }
        let mut evicted = false;
        if self.map.len() >= self.cap && self.tail != NIL {
            let victim = self.tail;
            self.unlink(victim);
            let old = self.nodes[victim as usize].hash;
            self.map.remove(&old);
            self.free.push(victim);
            evicted = true;
        }
        let node = Node {
            hash,
            holders: [EMPTY; HOLDERS],
            prev: NIL,
            next: NIL,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                // Grown by hand: doubling past the cap would overshoot it.
                if self.nodes.len() == self.nodes.capacity() {
                    let want = (self.nodes.len() * 2).clamp(8, self.cap.max(8));
                    self.nodes.reserve_exact(want - self.nodes.len());
                }
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        };
        self.map.insert(hash, i);
        self.push_head(i);
        (i, evicted)
    }
}

/// The buckets behind a map's `capacity` (7/8 of them, or all below 8).
fn buckets(capacity: usize) -> usize {
    match capacity {
        0 => 0,
        c if c < 8 => (c + 1).next_power_of_two(),
        c => (c * 8 / 7).next_power_of_two(),
    }
}

/// How much of a prompt the index says one backend holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    /// Leading blocks of the prompt held there (confirmed or not).
    pub blocks: u32,
    /// Leading blocks whose holding an answer has confirmed.
    pub confirmed: u32,
    /// The oldest and newest last-served ticks among the confirmed ones.
    pub oldest: u32,
    pub newest: u32,
}

/// Counters exported as `agentserve_prefix_index_*`.
#[derive(Debug, Default)]
pub struct IndexStats {
    pub lookups: AtomicU64,
    /// Lookups that found some backend holding part of the prompt.
    pub matched: AtomicU64,
    pub evicted: AtomicU64,
    /// Backends found to have evicted what the index said they held.
    pub corrections: AtomicU64,
}

pub struct PrefixIndex {
    shards: Box<[Mutex<Shard>]>,
    shard_bits: u32,
    ttl_ticks: u32,
    epoch: Instant,
    /// Per backend slot: entries served at or before this tick are gone.
    horizon: Box<[AtomicU32]>,
    /// Per backend slot: entries older than this many ticks are taken to
    /// be gone (0: not learned).
    lifetime: Box<[AtomicU32]>,
    pub stats: IndexStats,
}

const SHARD_BITS: u32 = 6;

impl PrefixIndex {
    /// An index that holds at most `max_bytes` of entries; holders count
    /// for `ttl_ms` after they last served a block.
    pub fn new(max_bytes: usize, ttl_ms: u64) -> Self {
        let shards = 1usize << SHARD_BITS;
        let cap = (max_bytes / ENTRY_BYTES / shards).max(1);
        PrefixIndex {
            shards: (0..shards)
                .map(|_| {
                    Mutex::new(Shard {
                        map: Map::with_capacity_and_hasher(2 * cap, Default::default()),
                        nodes: Vec::new(),
                        free: Vec::new(),
                        head: NIL,
                        tail: NIL,
                        cap,
                    })
                })
                .collect(),
            shard_bits: SHARD_BITS,
            ttl_ticks: (ttl_ms / TICK_MS).min(u32::MAX as u64 / 2) as u32,
            epoch: Instant::now(),
            horizon: (0..MAX_BACKENDS).map(|_| AtomicU32::new(0)).collect(),
            lifetime: (0..MAX_BACKENDS).map(|_| AtomicU32::new(0)).collect(),
            stats: IndexStats::default(),
        }
    }

    /// The index's clock: ticks since it was made, never 0.
    pub fn now(&self) -> u32 {
        (self.epoch.elapsed().as_millis() as u64 / TICK_MS + 1).min(u32::MAX as u64) as u32
    }

    fn shard(&self, hash: u64) -> &Mutex<Shard> {
        &self.shards[(hash >> (64 - self.shard_bits)) as usize]
    }

    fn alive(&self, h: Holder, now: u32) -> bool {
        let Some(horizon) = self.horizon.get(h.slot as usize) else {
            return false;
        };
        let age = now.saturating_sub(h.at());
        let lifetime = self.lifetime[h.slot as usize].load(Ordering::Relaxed);
        h.at() > horizon.load(Ordering::Relaxed)
            && age <= self.ttl_ticks
            && (lifetime == 0 || age <= lifetime)
            && (h.confirmed() || age <= PENDING_TICKS)
    }

    /// How much of the prompt whose chain is `blocks` each of `slots` holds.
    ///
    /// Blocks are chained, so a backend that holds block k computed every
    /// block before it: a long prompt is looked up every [`STRIDE`]th block,
    /// and block by block only within the stride where a backend's holding
    /// ends (a 256-block prompt: 16 to 48 look-ups, not 256). Where the index
    /// lost a holder of an earlier block alone (a block shared by more than
    /// [`HOLDERS`] backends, or evicted alone), the strides see past the gap
    /// — as the engine, which keeps a prefix whole, would.
    pub fn lookup(&self, blocks: &[u64], slots: &[u32], now: u32) -> Vec<Held> {
        let mut held = vec![Held::default(); slots.len()];
        self.stats.lookups.fetch_add(1, Ordering::Relaxed);
        // Strides: `at` blocks are held by every slot still going.
        let mut at = 0;
        let mut ends = [usize::MAX; 6];
        let mut n_ends = 0;
        while at + STRIDE <= blocks.len() {
            let going = held.iter().filter(|m| m.blocks as usize == at).count();
            let advanced = self.visit(blocks, at + STRIDE - 1, at, slots, &mut held, now);
            if advanced < going && n_ends < ends.len() {
                // Some slot's holding ends within this stride.
                ends[n_ends] = at;
                n_ends += 1;
            }
            if advanced == 0 {
                break;
            }
            at += STRIDE;
        }
        // Block by block where holdings end: each stride some slot left
        // (refined as far as it goes), and the last one.
        let last = (at + STRIDE > blocks.len()).then_some(at);
        for &from in ends[..n_ends].iter().chain(&last) {
            for i in from..(from + STRIDE).min(blocks.len()) {
                if self.visit(blocks, i, i, slots, &mut held, now) == 0 {
                    break;
                }
            }
        }
        if held.iter().any(|m| m.blocks > 0) {
            self.stats.matched.fetch_add(1, Ordering::Relaxed);
        }
        held
    }

    /// Look at block `i`: each of `slots` that holds every block before
    /// `from` and holds `i` alive is taken to hold every block through `i`.
    /// Returns how many did.
    fn visit(
        &self,
        blocks: &[u64],
        i: usize,
        from: usize,
        slots: &[u32],
        held: &mut [Held],
        now: u32,
    ) -> usize {
        let hash = blocks[i];
        let shard = self.shard(hash).lock();
        let Some(&n) = shard.map.get(&hash) else {
            return 0;
        };
        let mut advanced = 0;
        for h in shard.nodes[n as usize].holders {
            let Some(c) = slots.iter().position(|&s| s == h.slot) else {
                continue;
            };
            let m = &mut held[c];
            // Whether a holder lives is asked last: it is the dearest test.
            if m.blocks as usize == from && self.alive(h, now) {
                m.blocks = i as u32 + 1;
                advanced += 1;
                if h.confirmed() && m.confirmed as usize == from {
                    m.confirmed = i as u32 + 1;
                    m.oldest = if from == 0 {
                        h.at()
                    } else {
                        m.oldest.min(h.at())
                    };
                    m.newest = m.newest.max(h.at());
                }
            }
        }
        advanced
    }

    /// `slot` is about to compute the prompt whose chain is `blocks`
    /// (`confirmed`: an answer shows it did).
    pub fn record(&self, blocks: &[u64], slot: u32, now: u32, confirmed: bool) {
        if slot as usize >= MAX_BACKENDS {
            return;
        }
        let mut evicted = 0;
        for &hash in blocks {
            let mut shard = self.shard(hash).lock();
            let (n, gone) = shard.touch(hash);
            evicted += gone as u64;
            let holders = &mut shard.nodes[n as usize].holders;
            let i = holders
                .iter()
                .position(|h| h.slot == slot)
                .or_else(|| {
                    holders
                        .iter()
                        .position(|&h| h.slot == NO_SLOT || !self.alive(h, now))
                })
                .unwrap_or_else(|| (0..HOLDERS).min_by_key(|&i| holders[i].at()).unwrap_or(0));
            // Once confirmed, a holder stays so while it lives.
            let keep =
                holders[i].slot == slot && holders[i].confirmed() && self.alive(holders[i], now);
            let flag = if confirmed || keep { CONFIRMED } else { 0 };
            holders[i] = Holder {
                slot,
                tick: (now & !CONFIRMED) | flag,
            };
        }
        if evicted > 0 {
            self.stats.evicted.fetch_add(evicted, Ordering::Relaxed);
        }
    }

    /// What `slot`'s answer showed: `cached` leading blocks of a prompt the
    /// index had found `predicted` of there. Far fewer than the confirmed
    /// ones (under half) means the backend evicted: see the module doc.
    /// Returns whether the index was corrected.
    pub fn observe(&self, slot: u32, predicted: Held, cached: u64, now: u32) -> bool {
        let (Some(horizon), Some(lifetime)) = (
            self.horizon.get(slot as usize),
            self.lifetime.get(slot as usize),
        ) else {
            return false;
        };
        let p = predicted.confirmed as u64;
        if p > 0 && cached < p.div_ceil(2) {
            // Nothing kept at all: even the most recent entry is gone.
            let gone = if cached == 0 {
                predicted.newest
            } else {
                predicted.oldest
            };
            horizon.fetch_max(gone, Ordering::Relaxed);
            let age = now.saturating_sub(gone).max(LIFETIME_FLOOR_TICKS);
            let _ = lifetime.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                (l == 0 || age < l).then_some(age)
            });
            self.stats.corrections.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        if cached > (predicted.blocks as u64) + 1 {
            // It kept more than the index dared count on.
            let _ = lifetime.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                (l != 0).then(|| l.saturating_mul(2).min(self.ttl_ticks))
            });
        }
        false
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Heap bytes the entries take now.
    pub fn heap_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock();
                s.nodes.capacity() * std::mem::size_of::<Node>()
                    + s.free.capacity() * 4
                    + buckets(s.map.capacity()) * (std::mem::size_of::<(u64, u32)>() + 1)
            })
            .sum()
    }

    /// A backend's learned cache lifetime, ms (`None`: not learned).
    pub fn lifetime_ms(&self, slot: u32) -> Option<u64> {
        let l = self.lifetime.get(slot as usize)?.load(Ordering::Relaxed);
        (l > 0).then_some(l as u64 * TICK_MS)
    }

    /// Forget what the index learned of `slot`: its backend left, and the
    /// slot may come to name another one. Every entry naming it is dead from
    /// now (its horizon), and its learned lifetime goes.
    pub fn forget_backend(&self, slot: u32) {
        if let (Some(h), Some(l)) = (
            self.horizon.get(slot as usize),
            self.lifetime.get(slot as usize),
        ) {
            h.fetch_max(self.now(), Ordering::Relaxed);
            l.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: u64, salt: u64) -> Vec<u64> {
        (0..n)
            .map(|i| crate::affinity::hrw::mix(salt << 32 | i))
            .collect()
    }

    #[test]
    fn a_backend_holds_the_leading_blocks_it_served_and_no_gaps() {
        let ix = PrefixIndex::new(1 << 20, 60_000);
        let conv = chain(10, 1);
        ix.record(&conv[..4], 7, 1, true);
        ix.record(&conv, 9, 2, true);
        let held = ix.lookup(&conv, &[7, 9, 11], 3);
        assert_eq!(
            held.iter().map(|h| h.blocks).collect::<Vec<_>>(),
            [4, 10, 0]
        );
        // Another conversation sharing the first 3 blocks (a system prompt).
        let mut fork = conv[..3].to_vec();
        fork.extend(chain(5, 2));
        let held = ix.lookup(&fork, &[7, 9], 3);
        assert_eq!(held[0].blocks, 3);
        assert_eq!(held[1].blocks, 3);
        // A block 7 missed is not counted after it, even if it holds later ones.
        let mut gap = conv.clone();
        gap[1] = 12345;
        assert_eq!(ix.lookup(&gap, &[9], 3)[0].blocks, 1);
    }

    #[test]
    fn a_long_prompt_looked_up_by_strides_finds_where_each_holding_ends() {
        let ix = PrefixIndex::new(1 << 22, 60_000);
        let conv = chain(100, 3);
        // Holdings ending inside strides, on a stride's edge, and at the end.
        for (slot, n) in [(1, 37), (2, 64), (3, 100), (4, 5), (5, 17)] {
            ix.record(&conv[..n], slot, 1, true);
        }
        let held = ix.lookup(&conv, &[1, 2, 3, 4, 5, 6], 2);
        assert_eq!(
            held.iter().map(|h| h.blocks).collect::<Vec<_>>(),
            [37, 64, 100, 5, 17, 0]
        );
        assert_eq!(held[0].confirmed, 37);
        // A prompt that leaves the conversation at block 50.
        let mut fork = conv[..50].to_vec();
        fork.extend(chain(30, 4));
        let held = ix.lookup(&fork, &[1, 2, 3], 2);
        assert_eq!(
            held.iter().map(|h| h.blocks).collect::<Vec<_>>(),
            [37, 50, 50]
        );
    }

    #[test]
    fn a_prefix_still_being_computed_draws_requests_but_a_miss_on_it_is_no_eviction() {
        let ix = PrefixIndex::new(1 << 20, 600_000);
        let c = chain(8, 1);
        // Routed to backend 2, not answered yet: the next request of the
        // same prefix sees it there...
        ix.record(&c, 2, 10, false);
        let held = ix.lookup(&c, &[2], 11)[0];
        assert_eq!((held.blocks, held.confirmed), (8, 0));
        // ...and when that one, prefilled alongside, finds nothing cached,
        // the backend is not taken to have evicted anything.
        assert!(!ix.observe(2, held, 0, 12));
        assert_eq!(ix.lookup(&c, &[2], 12)[0].blocks, 8);
        // The first answer confirms it; routing the prompt again keeps it so.
        ix.record(&c, 2, 20, true);
        ix.record(&c, 2, 30, false);
        let held = ix.lookup(&c, &[2], 31)[0];
        assert_eq!((held.blocks, held.confirmed), (8, 8));
        // A holder never confirmed stops counting after PENDING_TICKS.
        ix.record(&c, 3, 40, false);
        assert_eq!(ix.lookup(&c, &[3], 40 + PENDING_TICKS)[0].blocks, 8);
        assert_eq!(ix.lookup(&c, &[3], 41 + PENDING_TICKS)[0].blocks, 0);
    }

    #[test]
    fn a_forgotten_backend_holds_nothing_and_its_slot_starts_afresh() {
        let ix = PrefixIndex::new(1 << 20, 600_000);
        let c = chain(8, 1);
        let now = ix.now();
        ix.record(&c, 5, now, true);
        assert_eq!(ix.lookup(&c, &[5], now)[0].blocks, 8);
        // The backend left; its slot may name another one from now on.
        ix.forget_backend(5);
        assert_eq!(ix.lookup(&c, &[5], now + 1)[0].blocks, 0);
        // What the slot's next backend computes counts again.
        let later = ix.now() + 1;
        ix.record(&c[..2], 5, later, true);
        assert_eq!(ix.lookup(&c, &[5], later)[0].blocks, 2);
    }

    #[test]
    fn holders_expire_after_the_ttl() {
        let ix = PrefixIndex::new(1 << 20, 1_000); // 100 ticks
        let c = chain(3, 1);
        ix.record(&c, 1, 10, true);
        assert_eq!(ix.lookup(&c, &[1], 110)[0].blocks, 3);
        assert_eq!(ix.lookup(&c, &[1], 111)[0].blocks, 0);
    }

    #[test]
    fn an_eviction_shown_by_the_engine_drops_what_the_backend_held_as_long_ago() {
        let ix = PrefixIndex::new(1 << 20, 600_000);
        let (old, older, recent) = (chain(8, 1), chain(8, 2), chain(8, 3));
        ix.record(&older, 4, 50, true);
        ix.record(&old, 4, 100, true);
        ix.record(&recent, 4, 900, true);
        let predicted = ix.lookup(&old, &[4], 1000)[0];
        assert_eq!(predicted.blocks, 8);
        // The engine had kept 2 blocks of 8: it evicted.
        assert!(ix.observe(4, predicted, 2, 1000));
        assert_eq!(ix.stats.corrections.load(Ordering::Relaxed), 1);
        for gone in [&old, &older] {
            assert_eq!(ix.lookup(gone, &[4], 1000)[0].blocks, 0);
        }
        // What it served since still counts; the lifetime it showed (900
        // ticks) applies from now on: entries older than that are gone.
        assert_eq!(ix.lookup(&recent, &[4], 1000)[0].blocks, 8);
        assert_eq!(ix.lifetime_ms(4), Some(900 * TICK_MS));
        assert_eq!(ix.lookup(&recent, &[4], 1801)[0].blocks, 0);
        // The request that showed it computed its prompt again: held anew.
        ix.record(&old, 4, 1000, true);
        assert_eq!(ix.lookup(&old, &[4], 1001)[0].blocks, 8);
        // Keeping about what was predicted corrects nothing; keeping more
        // gives the lifetime back.
        let p = ix.lookup(&old, &[4], 1001)[0];
        assert!(!ix.observe(4, p, 7, 1001));
        assert!(!ix.observe(4, Held { blocks: 2, ..p }, 8, 1001));
        assert_eq!(ix.lifetime_ms(4), Some(1800 * TICK_MS));
        // Other backends are not touched.
        ix.record(&older, 5, 1001, true);
        assert_eq!(ix.lookup(&older, &[5], 1002)[0].blocks, 8);
    }

    #[test]
    fn a_block_keeps_its_most_recent_holders() {
        let ix = PrefixIndex::new(1 << 20, 600_000);
        let c = chain(2, 1);
        for slot in 0..(HOLDERS as u32 + 2) {
            ix.record(&c, slot, 10 + slot, true);
        }
        let slots: Vec<u32> = (0..HOLDERS as u32 + 2).collect();
        let held = ix.lookup(&c, &slots, 100);
        assert_eq!(held[0].blocks, 0, "the oldest holders made room");
        assert_eq!(held[1].blocks, 0);
        assert!(held[2..].iter().all(|h| h.blocks == 2));
    }

    #[test]
    fn memory_stays_under_its_cap_and_the_least_recent_entries_go() {
        let cap = 256 * 1024;
        let ix = PrefixIndex::new(cap, 600_000);
        let keep = chain(4, 0);
        for salt in 1..2_000u64 {
            ix.record(&chain(16, salt), (salt % 3) as u32, salt as u32, true);
            if salt % 50 == 0 {
                ix.record(&keep, 9, salt as u32, true);
            }
        }
        assert!(ix.heap_bytes() <= cap, "{} > {cap}", ix.heap_bytes());
        assert!(ix.len() >= cap / ENTRY_BYTES / 2, "{} entries", ix.len());
        assert!(ix.stats.evicted.load(Ordering::Relaxed) > 0);
        assert_eq!(ix.lookup(&keep, &[9], 2_000)[0].blocks, 4, "recently used");
        assert_eq!(ix.lookup(&chain(16, 1), &[1], 2_000)[0].blocks, 0);
    }
}
