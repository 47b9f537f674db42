//! The binding table: session fingerprint → backend, sharded, bounded, with
//! leases and an idle deadline.
//!
//! Rules (SPEC §3.7 and the README's "Affinity semantics"):
//! - every in-flight request holds a lease on its binding; a leased binding
//!   never expires and is never evicted;
//! - the idle deadline restarts when the last lease ends;
//! - when a shard is full, the least recently released unleased binding is
//!   evicted; if every binding is leased, the caller serves the request unpinned.
//!
//! Each shard keeps its unleased bindings on an intrusive LRU list ordered by
//! release time, so both eviction and expiry take from the tail in O(1).

use parking_lot::Mutex;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// A 128-bit keyed fingerprint (see [`super::hrw::HrwHasher::fingerprint`]).
pub type BindingKey = u128;

/// Most tiers a table counts bindings for.
pub const MAX_TIERS: usize = 256;

/// Most backend slots a table counts bindings for (placement reads these).
pub const MAX_BACKENDS: usize = 16384;

const NIL: u32 = u32::MAX;

/// Low bits of a generation that number the owners of a pending binding's
/// first request within one incarnation.
const OWNER_BITS: u32 = 8;

/// The same incarnation, owned by the next first request.
fn next_owner(generation: u32) -> u32 {
    let mask = (1 << OWNER_BITS) - 1;
    (generation & !mask) | (generation.wrapping_add(1) & mask)
}

/// What a binding points at.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Binding {
    pub backend: u32,
    pub version: u32,
    pub tier: u16,
    pub in_flight: u32,
    /// Milliseconds on the table's clock; meaningless while leased.
    pub deadline_ms: u64,
    /// A new binding whose first request has not yet reached its backend.
    pub pending: bool,
    /// How often, and when last, the session moved: soft mode's cap and
    /// cooldown read it, so it travels with the binding between gateways.
    pub moves: Moves,
}

/// A session's moves (rebinds for cost, drain or a broken backend).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Moves {
    pub count: u8,
    /// When the last one was, seconds on the table's clock (meaningless
    /// while `count` is 0).
    pub at_s: u32,
}

#[derive(Clone, Copy)]
struct Entry {
    key: BindingKey,
    /// Which incarnation of the key this is (the high 24 bits: a lease of
    /// a removed binding must not end a lease of the key's next binding),
    /// and which first request owns its pending state (the low 8 bits: a
    /// pending binding rebound by a later request keeps its leases, and the
    /// earlier owner's end must not remove it). See [`OWNER_BITS`].
    generation: u32,
    /// When this binding last agreed with the shared store (0: never).
    synced_ms: u64,
    deadline_ms: u64,
    backend: u32,
    version: u32,
    in_flight: u32,
    prev: u32,
    next: u32,
    tier: u16,
    pending: bool,
    turns: Turns,
}

/// What the session's last turn found cached on its backend, and how often
/// (and when) the binding moved: what a cost-aware policy weighs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Turns {
    /// Prompt and cached tokens of the last turn with usage (0: none yet).
    pub prompt: u32,
    pub cached: u32,
    /// What the backend should have had cached on that turn: the prompt of
    /// the turn before, when that turn was served there too (0: the last
    /// turn was the session's first there, so it had nothing to keep).
    pub expected: u32,
    /// Rebinds of this binding so far (moves and broken).
    pub moves: u8,
    /// When it last moved, in seconds on the table's clock.
    pub moved_s: u32,
}

impl Turns {
    /// The uncached tokens the session's next turn is expected to bring to
    /// this backend, given that turn's whole prompt as estimated from its
    /// body (`prompt_estimate`, 0 if unknown). After a turn the backend had
    /// kept the session for, the last turn's new tokens (the transcript
    /// grows by about as much each turn). After its first turn there, whose
    /// uncached tokens were the whole prompt, what the new prompt adds to
    /// it when that is known: charging a whole re-prefill to a session whose
    /// prompt the backend has just computed would count phantom work.
    pub fn next_uncached(&self, prompt_estimate: u64) -> u64 {
        let last_new = self.prompt.saturating_sub(self.cached) as u64;
        match self.expected == 0 && prompt_estimate > 0 && self.prompt > 0 {
            true => prompt_estimate
                .saturating_sub(self.prompt as u64)
                .min(last_new),
            false => last_new,
        }
    }

    /// The share of what the backend should have held on the last turn that
    /// it had cached: 1 when the last turn was the session's first there
    /// (it has just computed the prompt; nothing says it dropped it), near 0
    /// when it evicted the session.
    pub fn retention(&self) -> f64 {
        if self.expected == 0 {
            1.0
        } else {
            (self.cached as f64 / self.expected as f64).min(1.0)
        }
    }
}

impl Entry {
    fn binding(&self) -> Binding {
        Binding {
            backend: self.backend,
            version: self.version,
            tier: self.tier,
            in_flight: self.in_flight,
            deadline_ms: self.deadline_ms,
            pending: self.pending,
            moves: Moves {
                count: self.turns.moves,
                at_s: self.turns.moved_s,
            },
        }
    }
}

/// The key is already a keyed hash: its low bits are used as they are.
type FastMap = super::hrw::UniformMap<BindingKey, u32>;

struct Shard {
    map: FastMap,
    entries: Vec<Entry>,
    free: Vec<u32>,
    /// Most recently released unleased binding.
    head: u32,
    /// Least recently released unleased binding: the next to expire or evict.
    tail: u32,
    cap: usize,
    generations: u32,
}

impl Shard {
    fn new(cap: usize) -> Self {
        Shard {
            map: FastMap::default(),
            entries: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            cap,
            generations: 0,
        }
    }

    /// A new incarnation (owner 0).
    fn next_generation(&mut self) -> u32 {
        self.generations = self.generations.wrapping_add(1 << OWNER_BITS);
        self.generations
    }

    /// `key`'s entry, if it is still the incarnation `generation`.
    fn find(&self, key: BindingKey, generation: u32) -> Option<u32> {
        let i = *self.map.get(&key)?;
        (self.entries[i as usize].generation == generation).then_some(i)
    }

    /// `key`'s entry, if a lease of `generation` is one of its leases: the
    /// same incarnation, whichever request owned its pending state then.
    fn find_lease(&self, key: BindingKey, generation: u32) -> Option<u32> {
        let i = *self.map.get(&key)?;
        let same = self.entries[i as usize].generation >> OWNER_BITS == generation >> OWNER_BITS;
        same.then_some(i)
    }

    fn unlink(&mut self, i: u32) {
        let (prev, next) = {
            let e = &self.entries[i as usize];
            (e.prev, e.next)
        };
        if prev != NIL {
            self.entries[prev as usize].next = next;
        } else if self.head == i {
            self.head = next;
        }
        if next != NIL {
            self.entries[next as usize].prev = prev;
        } else if self.tail == i {
            self.tail = prev;
        }
        let e = &mut self.entries[i as usize];
        e.prev = NIL;
        e.next = NIL;
    }

    fn push_head(&mut self, i: u32) {
        let old = self.head;
        {
            let e = &mut self.entries[i as usize];
            e.prev = NIL;
            e.next = old;
        }
        if old != NIL {
            self.entries[old as usize].prev = i;
        } else {
            self.tail = i;
        }
        self.head = i;
    }

    /// Make `i` the least recently released: the next to expire.
    fn push_tail(&mut self, i: u32) {
        let old = self.tail;
        {
            let e = &mut self.entries[i as usize];
            e.next = NIL;
            e.prev = old;
        }
        if old != NIL {
            self.entries[old as usize].next = i;
        } else {
            self.head = i;
        }
        self.tail = i;
    }

    fn remove(&mut self, i: u32) -> Entry {
        let e = self.entries[i as usize];
        if e.in_flight == 0 {
            self.unlink(i);
        }
        self.map.remove(&e.key);
        self.free.push(i);
        e
    }

    fn alloc(&mut self, e: Entry) -> u32 {
        if let Some(i) = self.free.pop() {
            self.entries[i as usize] = e;
            i
        } else {
            self.entries.push(e);
            (self.entries.len() - 1) as u32
        }
    }
}

/// What the caller's policy decided for one key, given its current binding.
pub enum Decision {
    /// Keep (and lease) the current binding.
    Keep,
    /// Bind to this backend (a new binding, or a rebind with a higher version).
    Bind(u32),
    /// Leave the table as it is and take no lease.
    Skip,
}

/// What [`BindingTable::acquire`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Acquired {
    /// The live binding was kept; a lease was taken.
    Kept {
        backend: u32,
        version: u32,
        generation: u32,
    },
    /// A binding was written; a lease was taken. `previous` is the binding
    /// this one replaced (a rebind), `expired` whether an expired one was found.
    Bound {
        backend: u32,
        version: u32,
        generation: u32,
        previous: Option<u32>,
        expired: bool,
    },
    /// The policy wanted to bind but every binding in the shard is leased:
    /// serve the request unpinned.
    Full {
        backend: u32,
    },
    /// A new binding's first request is still on its way to `backend`: wait
    /// for [`BindingTable::confirm`] or [`BindingTable::abandon`], then ask again.
    Pending {
        backend: u32,
    },
    Skipped,
}

/// Lookup state handed to the policy.
#[derive(Clone, Copy, Debug)]
pub struct Current {
    pub backend: u32,
    pub turns: Turns,
}

pub struct BindingTable {
    shards: Box<[Mutex<Shard>]>,
    shard_bits: u32,
    per_tier: Box<[AtomicI64]>,
    per_backend: Box<[AtomicI64]>,
    evictions: Box<[AtomicU64]>,
}

impl BindingTable {
    pub fn new(max_bindings: usize) -> Self {
        // Enough shards to keep lock contention low, few enough that the
        // per-shard bound stays close to the global one for small tables.
        let want = (max_bindings / 4096).clamp(1, 64);
        let shard_bits = usize::BITS - 1 - want.leading_zeros();
        let n = 1usize << shard_bits;
        let cap = max_bindings.div_ceil(n).max(1);
        BindingTable {
            shards: (0..n).map(|_| Mutex::new(Shard::new(cap))).collect(),
            shard_bits,
            per_tier: (0..MAX_TIERS).map(|_| AtomicI64::new(0)).collect(),
            per_backend: (0..MAX_BACKENDS).map(|_| AtomicI64::new(0)).collect(),
            evictions: (0..MAX_TIERS).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn shard(&self, key: BindingKey) -> &Mutex<Shard> {
        let idx = if self.shard_bits == 0 {
            0
        } else {
            (key >> (128 - self.shard_bits)) as usize
        };
        &self.shards[idx]
    }

    fn count(&self, tier: u16, backend: u32, delta: i64) {
        self.per_tier[tier as usize].fetch_add(delta, Ordering::Relaxed);
        if let Some(c) = self.per_backend.get(backend as usize) {
            c.fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// Bindings (sessions) that name `backend`, expired-but-unswept included.
    pub fn backend_len(&self, backend: u32) -> u64 {
        self.per_backend
            .get(backend as usize)
            .map_or(0, |c| c.load(Ordering::Relaxed).max(0) as u64)
    }

    /// Look `key` up and apply `policy` atomically (under the shard lock), so
    /// concurrent first requests of one session agree on a single binding.
    ///
    /// `policy` sees the live binding, if any (an expired one is reported as
    /// absent, with `expired = true` in the result when rebinding). A binding
    /// created here starts *pending*; other callers get [`Acquired::Pending`]
    /// until its first request confirms it, unless they pass `join_pending`
    /// (the binding's own first request, or a waiter that has waited long enough).
    pub fn acquire(
        &self,
        key: BindingKey,
        tier: u16,
        now_ms: u64,
        join_pending: bool,
        policy: impl FnOnce(Option<Current>) -> Decision,
    ) -> Acquired {
        let mut shard = self.shard(key).lock();
        let mut expired = false;
        let mut idx = shard.map.get(&key).copied();
        if let Some(i) = idx {
            let e = shard.entries[i as usize];
            if e.in_flight == 0 && e.deadline_ms <= now_ms {
                shard.remove(i);
                self.count(e.tier, e.backend, -1);
                expired = true;
                idx = None;
            }
        }
        if let Some(i) = idx {
            let e = &shard.entries[i as usize];
            if e.pending && !join_pending {
                return Acquired::Pending { backend: e.backend };
            }
        }
        let current = idx.map(|i| {
            let e = &shard.entries[i as usize];
            Current {
                backend: e.backend,
                turns: e.turns,
            }
        });
        match (policy(current), idx) {
            (Decision::Skip, _) | (Decision::Keep, None) => Acquired::Skipped,
            (Decision::Keep, Some(i)) => {
                let e = shard.entries[i as usize];
                if e.in_flight == 0 {
                    shard.unlink(i);
                }
                shard.entries[i as usize].in_flight += 1;
                Acquired::Kept {
                    backend: e.backend,
                    version: e.version,
                    generation: e.generation,
                }
            }
            (Decision::Bind(backend), Some(i)) => {
                self.rebind(&mut shard, i, backend, now_ms, expired)
            }
            (Decision::Bind(backend), None) => self.insert(&mut shard, key, tier, backend, expired),
        }
    }

    /// Bind the entry at `i` to `backend` instead.
    fn rebind(
        &self,
        shard: &mut Shard,
        i: u32,
        backend: u32,
        now_ms: u64,
        expired: bool,
    ) -> Acquired {
        // Rebinding a binding whose first request never arrived (its
        // backend went away): a new owner, so that request ending cannot
        // remove this one; the leases it had (requests that joined it)
        // still count until they end, so it cannot expire under them.
        let e = &mut shard.entries[i as usize];
        let was_idle = e.in_flight == 0;
        if e.pending {
            e.generation = next_owner(e.generation);
        }
        let previous = e.backend;
        let tier = e.tier;
        e.backend = backend;
        // The new backend has cached nothing of this session yet.
        e.turns = Turns {
            prompt: 0,
            cached: 0,
            expected: 0,
            moves: e.turns.moves.saturating_add(1),
            moved_s: (now_ms / 1000) as u32,
        };
        e.version = e.version.wrapping_add(1);
        let version = e.version;
        let generation = e.generation;
        e.in_flight += 1;
        if was_idle {
            shard.unlink(i);
        }
        self.count(tier, previous, -1);
        self.count(tier, backend, 1);
        Acquired::Bound {
            backend,
            version,
            generation,
            previous: Some(previous),
            expired,
        }
    }

    /// A new binding of `key` to `backend`, pending its first request; the
    /// least recently used idle one makes room when the shard is full.
    fn insert(
        &self,
        shard: &mut Shard,
        key: BindingKey,
        tier: u16,
        backend: u32,
        expired: bool,
    ) -> Acquired {
        if shard.map.len() >= shard.cap {
            let victim = shard.tail;
            if victim == NIL {
                return Acquired::Full { backend };
            }
            let e = shard.remove(victim);
            self.count(e.tier, e.backend, -1);
            self.evictions[e.tier as usize].fetch_add(1, Ordering::Relaxed);
        }
        let generation = shard.next_generation();
        let i = shard.alloc(Entry {
            key,
            generation,
            synced_ms: 0,
            deadline_ms: 0,
            backend,
            version: 1,
            in_flight: 1,
            prev: NIL,
            next: NIL,
            tier,
            pending: true,
            turns: Turns::default(),
        });
        shard.map.insert(key, i);
        self.count(tier, backend, 1);
        Acquired::Bound {
            backend,
            version: 1,
            generation,
            previous: None,
            expired,
        }
    }

    /// The first request of a pending binding reached its backend: the binding
    /// is real now and waiters may follow it.
    pub fn confirm(&self, key: BindingKey, generation: u32) {
        let mut shard = self.shard(key).lock();
        if let Some(i) = shard.find(key, generation) {
            shard.entries[i as usize].pending = false;
        }
    }

    /// End the lease of a pending binding's first request. If the binding was
    /// never confirmed it is removed, so the next waiter chooses afresh.
    /// Returns whether it was removed.
    pub fn abandon(&self, key: BindingKey, generation: u32, now_ms: u64, ttl_ms: u64) -> bool {
        {
            let mut shard = self.shard(key).lock();
            if let Some(i) = shard.find(key, generation) {
                if shard.entries[i as usize].pending {
                    let e = shard.remove(i);
                    self.count(e.tier, e.backend, -1);
                    return true;
                }
            }
        }
        self.release(key, generation, now_ms, ttl_ms);
        false
    }

    /// End one lease. When the last lease ends the idle deadline restarts.
    /// A lease of a binding that was removed meanwhile (and perhaps made
    /// again) ends nothing.
    pub fn release(&self, key: BindingKey, generation: u32, now_ms: u64, ttl_ms: u64) {
        let mut shard = self.shard(key).lock();
        let Some(i) = shard.find_lease(key, generation) else {
            return;
        };
        let e = &mut shard.entries[i as usize];
        if e.in_flight == 0 {
            return;
        }
        e.in_flight -= 1;
        if e.in_flight == 0 {
            e.deadline_ms = now_ms.saturating_add(ttl_ms);
            shard.push_head(i);
        }
    }

    /// Remember what the session's turn found cached on its backend.
    pub fn record_usage(&self, key: BindingKey, prompt: u64, cached: Option<u64>) {
        let mut shard = self.shard(key).lock();
        if let Some(&i) = shard.map.get(&key) {
            let t = &mut shard.entries[i as usize].turns;
            // A rebind zeroes `prompt`: a first turn there expects nothing.
            t.expected = t.prompt;
            t.prompt = prompt.min(u32::MAX as u64) as u32;
            // An engine that reports no cache is taken to have kept what it
            // should have: no report is no sign of eviction.
            let cached = cached.unwrap_or(t.expected as u64);
            t.cached = cached.min(prompt).min(u32::MAX as u64) as u32;
        }
    }

    /// The binding as it stands, without a lease. Expired bindings are absent.
    pub fn get(&self, key: BindingKey, now_ms: u64) -> Option<Binding> {
        let shard = self.shard(key).lock();
        let i = *shard.map.get(&key)?;
        let e = &shard.entries[i as usize];
        if e.in_flight == 0 && e.deadline_ms <= now_ms {
            return None;
        }
        Some(e.binding())
    }

    /// Drop a binding (admin delete, session closed by the client). Requests
    /// still holding a lease finish normally; their release finds nothing.
    pub fn remove(&self, key: BindingKey) -> Option<Binding> {
        let mut shard = self.shard(key).lock();
        let i = *shard.map.get(&key)?;
        let e = shard.remove(i);
        self.count(e.tier, e.backend, -1);
        Some(e.binding())
    }

    /// Bindings (live or expired but unswept) whose (tier, backend) match.
    pub fn count_where(&self, matches: impl Fn(u16, u32) -> bool) -> u64 {
        self.shards
            .iter()
            .map(|shard| {
                let shard = shard.lock();
                shard
                    .map
                    .values()
                    .filter(|&&i| {
                        let e = &shard.entries[i as usize];
                        matches(e.tier, e.backend)
                    })
                    .count() as u64
            })
            .sum()
    }

    /// Remove expired bindings, at most `budget` per shard, taking each shard's
    /// lock only briefly so requests never wait behind a long sweep.
    pub fn sweep(&self, now_ms: u64, budget: usize) -> usize {
        let mut swept = 0;
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            for _ in 0..budget {
                let t = shard.tail;
                if t == NIL || shard.entries[t as usize].deadline_ms > now_ms {
                    break;
                }
                let e = shard.remove(t);
                self.count(e.tier, e.backend, -1);
                swept += 1;
            }
        }
        swept
    }

    /// Live bindings (including expired ones not yet swept) of a tier.
    pub fn tier_len(&self, tier: u16) -> i64 {
        self.per_tier[tier as usize].load(Ordering::Relaxed)
    }

    pub fn tier_evictions(&self, tier: u16) -> u64 {
        self.evictions[tier as usize].load(Ordering::Relaxed)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.lock().map.len()).sum()
    }

    #[cfg(test)]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every binding as (key, binding), for persistence and admin listing.
    pub fn snapshot(&self, now_ms: u64) -> Vec<(BindingKey, Binding)> {
        let mut out = Vec::new();
        for shard in self.shards.iter() {
            let shard = shard.lock();
            for (&k, &i) in shard.map.iter() {
                let e = &shard.entries[i as usize];
                if e.in_flight == 0 && e.deadline_ms <= now_ms {
                    continue;
                }
                out.push((k, e.binding()));
            }
        }
        out
    }

    /// Insert an idle binding with a given deadline (restoring saved state).
    /// Keeps a newer version already present. It goes in as the least
    /// recently released: a saved binding's deadline is no later than those
    /// of bindings released since, and the sweep, which stops at the first
    /// live binding from that end, must meet it first. Restore the
    /// latest-expiring first.
    pub fn restore(&self, key: BindingKey, b: Binding) {
        let mut shard = self.shard(key).lock();
        if let Some(&i) = shard.map.get(&key) {
            let e = &mut shard.entries[i as usize];
            if e.version >= b.version {
                return;
            }
            let (tier, previous) = (e.tier, e.backend);
            e.backend = b.backend;
            e.version = b.version;
            self.count(tier, previous, -1);
            self.count(tier, b.backend, 1);
            return;
        }
        if shard.map.len() >= shard.cap {
            return;
        }
        let i = self.insert_idle(&mut shard, key, b, 0);
        shard.unlink(i);
        shard.push_tail(i);
    }

    /// Insert `b` as an idle binding (most recently released); its index.
    fn insert_idle(&self, shard: &mut Shard, key: BindingKey, b: Binding, synced_ms: u64) -> u32 {
        let generation = shard.next_generation();
        let i = shard.alloc(Entry {
            key,
            generation,
            synced_ms,
            deadline_ms: b.deadline_ms,
            backend: b.backend,
            version: b.version,
            in_flight: 0,
            prev: NIL,
            next: NIL,
            tier: b.tier,
            pending: false,
            turns: Turns {
                moves: b.moves.count,
                moved_s: b.moves.at_s,
                ..Turns::default()
            },
        });
        shard.map.insert(key, i);
        shard.push_head(i);
        self.count(b.tier, b.backend, 1);
        i
    }

    /// Bring every idle binding's deadline forward to `latest` at most (the
    /// TTL was shortened). Expiry order, which the sweep relies on, is kept:
    /// deadlines only shrink, and never below a later-released one's.
    pub fn clamp_deadlines(&self, latest: u64) {
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            for e in shard.entries.iter_mut() {
                if e.in_flight == 0 && e.deadline_ms > latest {
                    e.deadline_ms = latest;
                }
            }
        }
    }

    /// Take the shared store's word for `key`: its binding `b` replaces the
    /// local one when newer (or, with `force`, when as new but elsewhere — the
    /// store decided a race), keeping the local entry's leases and pending
    /// state; absent locally, it is inserted idle. Marks the key synced.
    /// Returns whether the local binding changed.
    pub fn adopt(&self, key: BindingKey, b: Binding, force: bool, now_ms: u64) -> bool {
        let mut shard = self.shard(key).lock();
        if let Some(&i) = shard.map.get(&key) {
            let e = &mut shard.entries[i as usize];
            e.synced_ms = now_ms.max(1);
            let newer = b.version > e.version
                || (force && b.version == e.version && b.backend != e.backend);
            if !newer {
                return false;
            }
            let (tier, previous) = (e.tier, e.backend);
            e.backend = b.backend;
            e.version = b.version;
            if previous != b.backend {
                // What was cached where it was is no guide to where it goes.
                e.turns = Turns::default();
                self.count(tier, previous, -1);
                self.count(tier, b.backend, 1);
            }
            // The newer binding's moves, made by whichever gateway.
            if b.moves.count > 0 {
                e.turns.moves = b.moves.count;
                e.turns.moved_s = b.moves.at_s;
            }
            return true;
        }
        if shard.map.len() >= shard.cap {
            let victim = shard.tail;
            if victim == NIL {
                return false;
            }
            let e = shard.remove(victim);
            self.count(e.tier, e.backend, -1);
            self.evictions[e.tier as usize].fetch_add(1, Ordering::Relaxed);
        }
        self.insert_idle(&mut shard, key, b, now_ms.max(1));
        true
    }

    /// When `key`'s live binding last agreed with the shared store (`None`:
    /// no live binding here).
    pub fn synced_ms(&self, key: BindingKey, now_ms: u64) -> Option<u64> {
        let shard = self.shard(key).lock();
        let i = *shard.map.get(&key)?;
        let e = &shard.entries[i as usize];
        (e.in_flight > 0 || e.deadline_ms > now_ms).then_some(e.synced_ms)
    }

    pub fn mark_synced(&self, key: BindingKey, now_ms: u64) {
        let mut shard = self.shard(key).lock();
        if let Some(&i) = shard.map.get(&key) {
            // Never 0, which means "never synced".
            shard.entries[i as usize].synced_ms = now_ms.max(1);
        }
    }

    /// Approximate heap bytes held by the table (for the memory benchmark).
    pub fn heap_bytes(&self) -> usize {
        self.shards
            .iter()
            .map(|s| {
                let s = s.lock();
                s.entries.capacity() * std::mem::size_of::<Entry>()
                    + s.free.capacity() * 4
                    + s.map.capacity() * (std::mem::size_of::<(BindingKey, u32)>() + 1)
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bind(t: &BindingTable, key: u128, backend: u32, now: u64) -> Acquired {
        t.acquire(key, 0, now, true, |_| Decision::Bind(backend))
    }

    /// The generation of `key`'s current binding.
    fn gen(t: &BindingTable, key: u128) -> u32 {
        let shard = t.shard(key).lock();
        shard.entries[shard.map[&key] as usize].generation
    }

    /// End a lease on `key`'s current binding.
    fn rel(t: &BindingTable, key: u128, now: u64, ttl: u64) {
        t.release(key, gen(t, key), now, ttl)
    }

    #[test]
    fn a_lease_of_a_removed_binding_does_not_end_a_lease_of_its_successor() {
        let t = BindingTable::new(100);
        let Acquired::Bound {
            generation: old, ..
        } = bind(&t, 1, 7, 0)
        else {
            panic!()
        };
        // Removed while leased (admin delete, session-final, reload), then
        // the next turn binds again and is in flight.
        t.remove(1);
        let Acquired::Bound {
            generation: new, ..
        } = bind(&t, 1, 8, 0)
        else {
            panic!()
        };
        assert_ne!(old, new);
        // The old request ends: the new binding keeps its lease.
        t.release(1, old, 10, 5);
        assert!(!t.abandon(1, old, 10, 5));
        assert_eq!(t.get(1, 1_000).unwrap().in_flight, 1);
        t.confirm(1, old);
        assert!(
            t.get(1, 1_000).unwrap().pending,
            "only its own request confirms it"
        );
        t.release(1, new, 10, 5);
        assert!(t.get(1, 1_000).is_none());
    }

    #[test]
    fn an_entry_stays_within_80_bytes() {
        // A million bindings: every 16 bytes more is 16 MB.
        assert!(
            std::mem::size_of::<Entry>() <= 80,
            "{}",
            std::mem::size_of::<Entry>()
        );
    }

    #[test]
    fn a_pending_binding_rebound_keeps_the_leases_of_the_requests_that_joined_it() {
        let t = BindingTable::new(100);
        let Acquired::Bound { generation: g1, .. } = bind(&t, 1, 7, 0) else {
            panic!()
        };
        // A waiter out of patience joins the pending binding.
        let Acquired::Kept {
            generation: joined, ..
        } = t.acquire(1, 0, 0, true, |_| Decision::Keep)
        else {
            panic!()
        };
        assert_eq!(joined, g1);
        // Its backend went away: the first request rebinds elsewhere and
        // hands its old lease over.
        let Acquired::Bound { generation: g2, .. } = bind(&t, 1, 8, 0) else {
            panic!()
        };
        assert_ne!(g1, g2);
        t.release(1, g1, 10, 5);
        // The retried request ends; the one that joined is still in flight:
        // the binding must not idle and expire under it.
        t.release(1, g2, 10, 5);
        assert_eq!(
            t.get(1, 1_000).map(|b| (b.backend, b.in_flight)),
            Some((8, 1))
        );
        // Its old-generation end neither removes the new binding...
        assert!(!t.abandon(1, g1, 20, 5));
        // ...and, being the last lease, starts the idle deadline.
        assert_eq!(t.get(1, 24).map(|b| b.in_flight), Some(0));
        assert!(t.get(1, 26).is_none());
    }

    fn keep_or_bind(t: &BindingTable, key: u128, backend: u32, now: u64) -> Acquired {
        t.acquire(key, 0, now, true, |cur| match cur {
            Some(_) => Decision::Keep,
            None => Decision::Bind(backend),
        })
    }

    #[test]
    fn leased_binding_never_expires_and_deadline_restarts_at_release() {
        let t = BindingTable::new(100);
        assert!(matches!(
            bind(&t, 1, 7, 0),
            Acquired::Bound { version: 1, .. }
        ));
        // Far past any deadline while the lease is held: still live.
        assert_eq!(t.get(1, 1_000_000).unwrap().in_flight, 1);
        assert_eq!(t.sweep(1_000_000, 100), 0);
        rel(&t, 1, 1_000_000, 50);
        assert!(t.get(1, 1_000_049).is_some());
        assert!(t.get(1, 1_000_050).is_none());
        // An expired binding is reported as absent and rebinding says so.
        match keep_or_bind(&t, 1, 8, 1_000_050) {
            Acquired::Bound {
                expired, previous, ..
            } => {
                assert!(expired);
                assert_eq!(previous, None);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn two_leases_expire_only_after_the_last() {
        let t = BindingTable::new(100);
        keep_or_bind(&t, 5, 1, 0);
        assert!(matches!(
            keep_or_bind(&t, 5, 2, 0),
            Acquired::Kept { backend: 1, .. }
        ));
        rel(&t, 5, 10, 5);
        assert!(t.get(5, 100).is_some(), "one lease still held");
        rel(&t, 5, 100, 5);
        assert!(t.get(5, 104).is_some());
        assert!(t.get(5, 105).is_none());
    }

    #[test]
    fn a_pending_binding_makes_others_wait_until_confirmed_or_abandoned() {
        let t = BindingTable::new(100);
        keep_or_bind(&t, 1, 4, 0);
        let other = |t: &BindingTable| t.acquire(1, 0, 0, false, |_| Decision::Keep);
        assert_eq!(other(&t), Acquired::Pending { backend: 4 });
        t.confirm(1, gen(&t, 1));
        assert!(matches!(other(&t), Acquired::Kept { backend: 4, .. }));
        // A second session whose first request gives up: removed, next one chooses.
        keep_or_bind(&t, 2, 5, 0);
        assert!(t.abandon(2, gen(&t, 2), 0, 1000));
        assert!(t.get(2, 0).is_none());
        assert!(matches!(
            t.acquire(2, 0, 0, false, |_| Decision::Bind(6)),
            Acquired::Bound { backend: 6, .. }
        ));
    }

    /// The session's turns as the policy would see them on its next request.
    fn turns_of(t: &BindingTable, key: u128) -> Turns {
        let mut seen = None;
        t.acquire(key, 0, 0, true, |cur| {
            seen = cur.map(|c| c.turns);
            Decision::Keep
        });
        seen.expect("a live binding")
    }

    #[test]
    fn what_a_backend_should_have_kept_is_the_turn_before_on_that_backend() {
        let t = BindingTable::new(100);
        bind(&t, 3, 1, 0);
        // A cold first turn: nothing cached, but nothing to keep either.
        t.record_usage(3, 1_000, Some(0));
        assert_eq!(turns_of(&t, 3).expected, 0);
        assert_eq!(turns_of(&t, 3).retention(), 1.0);
        // The next turn found the first one's prompt: all it should have kept.
        t.record_usage(3, 1_300, Some(1_000));
        assert_eq!(turns_of(&t, 3).expected, 1_000);
        assert_eq!(turns_of(&t, 3).retention(), 1.0);
        // Then it had dropped most of it.
        t.record_usage(3, 1_600, Some(260));
        assert_eq!(turns_of(&t, 3).retention(), 0.2);
        // Moved: the new backend's first turn there expects nothing.
        bind(&t, 3, 2, 0);
        t.record_usage(3, 1_900, Some(700));
        assert_eq!(turns_of(&t, 3).expected, 0);
        assert_eq!(turns_of(&t, 3).retention(), 1.0);
    }

    #[test]
    fn the_next_turn_after_a_first_one_brings_its_growth_not_a_whole_prefill() {
        let t = BindingTable::new(100);
        bind(&t, 4, 1, 0);
        t.record_usage(4, 7_000, Some(0));
        // The backend has just computed all 7,000 tokens: a 7,300-token turn
        // brings 300 there, not the first turn's 7,000 again.
        assert_eq!(turns_of(&t, 4).next_uncached(7_300), 300);
        // Without a body estimate, the last turn's own new tokens.
        assert_eq!(turns_of(&t, 4).next_uncached(0), 7_000);
        // A warm turn's new tokens are the transcript's growth: they stand
        // for the next turn's whatever its body says.
        t.record_usage(4, 7_300, Some(7_000));
        assert_eq!(turns_of(&t, 4).next_uncached(9_000), 300);
    }

    #[test]
    fn rebind_bumps_version() {
        let t = BindingTable::new(100);
        keep_or_bind(&t, 9, 1, 0);
        rel(&t, 9, 0, 1000);
        match bind(&t, 9, 2, 1) {
            Acquired::Bound {
                version, previous, ..
            } => {
                assert_eq!(version, 2);
                assert_eq!(previous, Some(1));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn full_table_evicts_least_recently_released_and_never_a_leased_one() {
        let t = BindingTable::new(3);
        for k in 0..3u128 {
            keep_or_bind(&t, k, 0, 0);
        }
        // All three leased: a fourth session is served unpinned.
        assert!(matches!(keep_or_bind(&t, 3, 0, 0), Acquired::Full { .. }));
        rel(&t, 1, 10, 1000);
        rel(&t, 0, 20, 1000);
        // Key 1 was released first: it is the one evicted.
        assert!(matches!(keep_or_bind(&t, 3, 0, 30), Acquired::Bound { .. }));
        assert!(t.get(1, 30).is_none());
        assert!(t.get(0, 30).is_some());
        assert!(t.get(2, 30).is_some(), "leased binding kept");
        assert_eq!(t.tier_evictions(0), 1);
        assert_eq!(t.tier_len(0), 3);
    }

    #[test]
    fn a_shortened_ttl_keeps_the_sweep_going() {
        let t = BindingTable::new(100);
        // Released under a long TTL, then the TTL is cut to 10 ms at time 5
        // and another binding is released under it.
        keep_or_bind(&t, 1, 0, 0);
        rel(&t, 1, 0, 1000);
        t.clamp_deadlines(5 + 10);
        keep_or_bind(&t, 2, 0, 5);
        rel(&t, 2, 5, 10);
        // Both are due at 15; the older one no longer blocks the sweep.
        assert_eq!(t.sweep(20, 100), 2);
        assert!(t.is_empty());
    }

    #[test]
    fn bindings_restored_while_serving_are_swept_when_they_expire() {
        let t = BindingTable::new(100);
        // Served since the upgrade: released at 0, due at 1,000.
        keep_or_bind(&t, 1, 0, 0);
        rel(&t, 1, 0, 1000);
        // Restored from the state file, due earlier (latest-expiring first).
        for (key, due) in [(3u128, 500u64), (2, 300)] {
            t.restore(
                key,
                Binding {
                    backend: 1,
                    version: 1,
                    tier: 0,
                    in_flight: 0,
                    deadline_ms: due,
                    pending: false,
                    moves: Moves::default(),
                },
            );
        }
        assert_eq!(t.sweep(400, 100), 1, "the one due at 300");
        assert_eq!(t.sweep(600, 100), 1, "the one due at 500");
        assert_eq!(t.backend_len(1), 0, "restored bindings no longer counted");
        assert!(t.get(1, 600).is_some());
    }

    #[test]
    fn sweep_removes_only_expired() {
        let t = BindingTable::new(10_000);
        for k in 0..100u128 {
            keep_or_bind(&t, k << 100 | k, 0, 0);
            rel(&t, k << 100 | k, k as u64, 10);
        }
        // Released at time k with ttl 10: expired at 60 are k <= 50.
        let swept = t.sweep(60, 1000);
        assert_eq!(swept, 51);
        assert_eq!(t.len(), 49);
        assert_eq!(t.tier_len(0), 49);
    }

    #[test]
    fn flood_stays_bounded_and_recent_sessions_stay() {
        let limit = 10_000;
        let t = BindingTable::new(limit);
        let recent: Vec<u128> = (0..10).map(|i| u128::MAX - i).collect();
        for (n, k) in (0..(10 * limit) as u128).enumerate() {
            let key = k.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
            keep_or_bind(&t, key, 0, n as u64);
            rel(&t, key, n as u64, 1_000_000);
            if n % 500 == 0 {
                for &r in &recent {
                    keep_or_bind(&t, r, 3, n as u64);
                    rel(&t, r, n as u64, 1_000_000);
                }
            }
            assert!(t.len() <= limit + 64);
        }
        for &r in &recent {
            assert_eq!(t.get(r, 100 * limit as u64).map(|b| b.backend), Some(3));
        }
    }
}
