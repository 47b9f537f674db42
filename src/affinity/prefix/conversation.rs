//! Which conversation a prompt belongs to when its client names none.
//!
//! A conversation is a path through the prefix tree, not its opening: two
//! requests are turns of one conversation only as far as their blocks agree.
//! Each routed prompt leaves an *end*: where it stopped, the backend it went
//! to, and how far it agrees with any other conversation (its *shared*
//! part). A later, longer prompt **continues** the conversation of the end
//! it agrees with deepest, when that agreement reaches past the end's
//! shared part — a system prompt, a task template or an opening that other
//! conversations also sent names no conversation of its own — and
//!
//! - for a prompt with messages (chat, Anthropic Messages, Responses
//!   items), the earlier prompt ends where one of its messages ends: a
//!   client re-sends the conversation's messages as they were;
//! - for a prompt without (completions: token ids or text), it covers every
//!   full block of the earlier prompt but the last few that hold its last
//!   [`TOLERANCE_TOKENS`] ([`tolerance_blocks`]: at least
//!   [`TOLERANCE_BLOCKS`]), or extends it byte for byte: a token-id client
//!   re-tokenises the tail of
//!   the turn before, and a replayed trace gives its partial last block new
//!   ids, so a turn need not extend the one before byte for byte.
//!
//! The first continuation takes the end over; a second prompt agreeing with
//! the same end (a fork, another conversation with the same opening, a
//! retry under another turn) is a conversation of its own, placed by load
//! and by what each backend holds. Conversations that share an opening thus
//! part where they diverge, and each part is placed on its own.
//!
//! A prompt that continues nothing is a new conversation on **probation**:
//! it makes no binding. For `probation` after it was routed it counts as a
//! session of its backend (so first placement balances new conversations
//! against it); a second turn makes it a binding there. A one-shot call
//! never does, and holds nothing but its end, in bounded memory.
//!
//! Ends are this gateway's own. A new conversation's name derives from its
//! prompt, so gateways of a fleet that see the same first turn name it
//! alike; a conversation first seen here at a later turn is new here.

use super::prompt::{Canon, Prompt};
use crate::affinity::table::MAX_BACKENDS;
use parking_lot::Mutex;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use xxhash_rust::xxh3::xxh3_128_with_seed;

/// Full blocks at the end of a prompt that its next turn may re-render,
/// at least.
pub const TOLERANCE_BLOCKS: usize = 4;

/// Tokens at the end of a prompt that its next turn may re-render: counted
/// in tokens, not bytes, since a token id's width in the canonical prompt
/// is its digits (a real tokenizer's vocabulary ids take five or six, a
/// trace's hash ids more: 512 ids of eight digits fill 4.5 KiB).
pub const TOLERANCE_TOKENS: f64 = 512.0;

/// The most blocks a tolerance covers (bounds an end's size).
pub const MAX_TOLERANCE_BLOCKS: usize = 8;

/// Full blocks of `block` bytes at the end of a prompt of `tokens_per_byte`
/// that its next turn may re-render: those [`TOLERANCE_TOKENS`] may touch
/// (one more for where they start within a block), at least
/// [`TOLERANCE_BLOCKS`], at most [`MAX_TOLERANCE_BLOCKS`].
pub fn tolerance_blocks(tokens_per_byte: f64, block: usize) -> usize {
    if !tokens_per_byte.is_finite() || tokens_per_byte <= 0.0 || block == 0 {
        return TOLERANCE_BLOCKS;
    }
    let bytes = TOLERANCE_TOKENS / tokens_per_byte;
    let blocks = (bytes / block as f64).ceil() as usize + 1;
    blocks.clamp(TOLERANCE_BLOCKS, MAX_TOLERANCE_BLOCKS)
}

/// Ends kept under one marker: more (many conversations whose last full
/// block is a shared one) drop the oldest, whose next turn is then placed
/// as a new conversation would be.
const PER_MARKER: u32 = 16;

/// Ends kept under one exact key: only the very same prompt shares one (a
/// retry, sampled rollouts of one turn), and once two have been seen none
/// of them can be continued (each shares all of itself with the other).
const PER_EXACT: u32 = 2;

/// Heap bytes an end costs, about: the end (224 bytes, most of them its
/// [`MAX_TOLERANCE_BLOCKS`] + 1 links), its markers in the map, its place
/// in the queues.
pub const END_BYTES: usize = 320;

const NIL: u32 = u32::MAX;

/// The slot of an end whose request has not been routed yet.
const UNPLACED: u32 = u32::MAX;

/// How a prompt stands to the conversations seen before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Conversation {
    /// Its name (the binding key's material, `session: prompt-…`).
    pub id: u128,
    /// The turn before it went here: it continues that conversation.
    pub continues: Option<Continued>,
    /// A new conversation that forks one seen here (it agrees with a turn
    /// of it past what others share, and that turn was continued already:
    /// a subagent repeating its parent's transcript, an edit of the last
    /// turn): where that turn went, which holds what they share.
    pub forked_at: Option<u32>,
    /// Its end, filed at once (another prompt meeting it while this one is
    /// still on its way knows of it); placed once the request is routed.
    end: Handle,
    /// Where it ends exactly (a prompt with messages: the key of its last
    /// message's end), and the exact key of the end it continued: what a
    /// fleet's store files it under, and forgets.
    pub exact: Option<u64>,
    pub continued_key: Option<u64>,
    /// A prompt with messages that continues nothing seen here: the exact
    /// keys of its earlier message ends, the latest first, at most
    /// [`FLEET_LOOKUPS`] — where another gateway of a fleet may have filed
    /// the turn it continues.
    pub earlier: [u64; FLEET_LOOKUPS],
    pub n_earlier: u8,
}

/// Earlier message ends of a prompt looked up in a fleet's store at most:
/// a turn's previous turn ended a message or a few tool calls back.
pub const FLEET_LOOKUPS: usize = 8;

/// An end, as [`Conversations::place`] finds it again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Handle {
    index: u32,
    gen: u32,
}

/// The conversation a prompt continues: where its last turn went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Continued {
    pub slot: u32,
    /// The conversation is bound (else on probation, this its second turn).
    pub bound: bool,
}

#[derive(Clone, Copy, Debug)]
struct End {
    gen: u32,
    live: bool,
    conversation: u128,
    /// (marker, next end under the same marker), `n_links` of them: the
    /// boundary after each of its last own full blocks, and where it ends
    /// exactly (the key of its last message end; for a prompt without
    /// messages, the boundary after its last full block, where its tail is
    /// checked, or the root for a prompt with no full block).
    links: [Link; MAX_TOLERANCE_BLOCKS + 1],
    n_links: u8,
    /// Full blocks at its end its next turn may re-render
    /// ([`tolerance_blocks`]).
    tolerance: u8,
    /// Full blocks of its prompt, and where the prompt ends (its last
    /// message's end, for a prompt with messages).
    n_blocks: u32,
    len: u32,
    /// A prompt without messages: the bytes after its last full block and
    /// their hash, and whether that tail is its end (the read length did not
    /// cut it). A prompt with messages ends at `len`, keyed exactly.
    tail_len: u32,
    tail_hash: u64,
    tail_exact: bool,
    messages: bool,
    /// For a prompt with messages: the chain hash its exact key's block
    /// follows (see `Inner::exact_blocks`).
    exact_block: u64,
    shared: u32,
    slot: u32,
    bound: bool,
    /// Counts as a session of `slot` (on probation, and recent).
    counted: bool,
    /// Continued already: a later prompt agreeing with it is a fork.
    taken: bool,
    filed_ms: u64,
}

/// The key under which a prompt with messages that ends at `at` (a message
/// end) is filed: the chain up to the block before, and the bytes after it.
/// Each is hashed on its own: a look-up stops at the first end it may
/// continue, two or three from the last, and hashing every end of the last
/// block in one streaming pass cost more than the few it needs.
fn exact_key(p: &Prompt, canon: &Canon, block: usize, at: usize) -> Option<u64> {
    let b = at / block.max(1);
    let base = match b {
        0 => p.root,
        b => *p.blocks.get(b - 1)?,
    };
    let tail = canon.hash(b * block, at, base)?;
    Some(crate::affinity::hrw::mix(tail ^ base.rotate_left(29)) ^ 0x6d65_7373_6167_6573)
}

/// One of an end's places: under `marker`, before `next`.
#[derive(Clone, Copy, Debug)]
struct Link {
    marker: u64,
    next: u32,
    /// The boundary it marks (blocks), [`EXACT`] for where the prompt ends,
    /// [`DEAD`] once taken off its list.
    depth: u32,
}

const EXACT: u32 = u32::MAX;
const DEAD: u32 = u32::MAX - 1;
const NO_LINK: Link = Link {
    marker: 0,
    next: NIL,
    depth: DEAD,
};

#[derive(Clone, Copy)]
struct List {
    head: u32,
    len: u32,
    /// Ends ever filed under it (while it existed).
    filed: u32,
}

struct Inner {
    markers: crate::affinity::hrw::UniformMap<u64, List>,
    /// How many ends of prompts with messages end exactly in the block after
    /// each chain hash: a message end in a block no end ends in is no
    /// earlier prompt's end, and costs a look-up here instead of hashing
    /// its bytes.
    exact_blocks: crate::affinity::hrw::UniformMap<u64, u32>,
    ends: Vec<End>,
    free: Vec<u32>,
    /// (end, generation) in filing order: capacity and age.
    order: VecDeque<(u32, u32)>,
    /// Ends that count as sessions, in filing order.
    counted: VecDeque<(u32, u32)>,
    live: usize,
    /// Live ends taken over (kept to tell forks where they went).
    taken: usize,
    cap: usize,
}

pub struct Conversations {
    inner: Mutex<Inner>,
    /// Per backend slot: conversations on probation that count as sessions.
    probation: Box<[AtomicU32]>,
    probation_ms: AtomicU64,
    ttl_ms: AtomicU64,
}

/// What a lookup met on its way: an end and how far the prompt agrees with it.
#[derive(Clone, Copy)]
struct Met {
    end: u32,
    agreement: u32,
}

/// How good an end is to continue, among those a prompt agrees with at one
/// depth: (an exact extension, a bound conversation, the oldest).
type Rank = (bool, bool, std::cmp::Reverse<u64>);

/// Ends a lookup remembers meeting, to tell them what they share.
const MET: usize = 32;

/// A prompt as [`Conversations::identify`] reads it: where its blocks
/// and messages end, and where it ends exactly.
struct Reading<'a> {
    p: &'a Prompt,
    canon: &'a Canon<'a>,
    block: usize,
    /// Its full blocks.
    n: usize,
    /// It has messages (a chat), whose ends it is matched at.
    messages: bool,
    /// Past its last full block: its length and (without messages) hash.
    tail_len: usize,
    tail_hash: u64,
    /// Its length up to its last message's end (else all of it).
    q_len: u32,
    /// Where it ends exactly: the key of its last message's end, or the
    /// boundary after its last full block (its tail checked there).
    exact: Option<u64>,
}

impl<'a> Reading<'a> {
    fn new(p: &'a Prompt, canon: &'a Canon<'a>, block: usize) -> Self {
        let n = p.blocks.len();
        let marker = |k: usize| if k == 0 { p.root } else { p.blocks[k - 1] };
        let messages = !canon.message_ends.is_empty();
        let tail_from = n * block;
        let tail_hash = match messages {
            true => 0,
            false => canon
                .hash(tail_from, canon.len(), marker(n))
                .unwrap_or_default(),
        };
        Reading {
            p,
            canon,
            block,
            n,
            messages,
            tail_len: canon.len().saturating_sub(tail_from),
            tail_hash,
            q_len: clamp32(match canon.message_ends.last() {
                Some(&at) => at,
                None => p.full_bytes,
            }),
            exact: match canon.message_ends.last() {
                Some(&at) => exact_key(p, canon, block, at),
                None => Some(marker(n)),
            },
        }
    }

    /// The chain hash at the boundary after block `k` (the root at 0).
    fn marker(&self, k: usize) -> u64 {
        if k == 0 {
            self.p.root
        } else {
            self.p.blocks[k - 1]
        }
    }

    /// An earlier prompt with messages that ends where one of this one's
    /// messages does: the deepest that it may continue.
    fn continues_messages(&self, inner: &Inner, walk: &mut Walk) -> Option<u32> {
        let (p, canon, block) = (self.p, self.canon, self.block);
        let last = canon.message_ends.len().wrapping_sub(1);
        for (j, &at) in canon.message_ends.iter().enumerate().rev() {
            if j != last
                && !inner
                    .exact_blocks
                    .contains_key(&self.marker(at / block.max(1)))
            {
                continue;
            }
            let key = match j == last {
                true => self.exact,
                false => exact_key(p, canon, block, at),
            };
            let Some(key) = key else {
                continue;
            };
            let found = walk.depth(inner, key, true, |e| {
                (e.messages && e.len as usize == at).then_some(e.len)
            });
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// A prompt without messages: the one whose own blocks it agrees with
    /// deepest, all of them but the last few, or exactly.
    fn continues_blocks(&self, inner: &Inner, walk: &mut Walk) -> Option<u32> {
        if self.messages {
            return None;
        }
        let (canon, block) = (self.canon, self.block);
        for k in (0..=self.n).rev() {
            let found = walk.depth(inner, self.marker(k), false, |e| {
                let exact = !e.messages
                    && e.tail_exact
                    && k == e.n_blocks as usize
                    && canon.hash(k * block, k * block + e.tail_len as usize, self.marker(k))
                        == Some(e.tail_hash);
                match (exact, k) {
                    (true, _) => Some(e.len),
                    (false, 0) => None,
                    (false, _) => {
                        (k + e.tolerance as usize > e.n_blocks as usize).then(|| clamp32(k * block))
                    }
                }
            });
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// The exact keys of its earlier message ends, the latest first (see
    /// [`Conversation::earlier`]).
    fn earlier_ends(&self, c: &mut Conversation) {
        if !self.messages {
            return;
        }
        let ends = &self.canon.message_ends;
        for &at in ends[..ends.len().saturating_sub(1)].iter().rev() {
            if c.n_earlier as usize == FLEET_LOOKUPS {
                break;
            }
            if let Some(key) = exact_key(self.p, self.canon, self.block, at) {
                c.earlier[c.n_earlier as usize] = key;
                c.n_earlier += 1;
            }
        }
    }

    /// A new conversation's name, from its prompt: gateways that see the
    /// same first turn name it alike. The same prompt again is another
    /// conversation (a sampled rollout, a retry): `duplicates` makes
    /// another name.
    fn name(&self, duplicates: u32) -> u128 {
        let mut material = [0u8; 28];
        material[..8].copy_from_slice(&self.marker(self.n).to_le_bytes());
        let own = match self.messages {
            true => self.exact.unwrap_or_default(),
            false => self.tail_hash,
        };
        material[8..16].copy_from_slice(&own.to_le_bytes());
        material[16..24].copy_from_slice(&(self.q_len as u64).to_le_bytes());
        material[24..].copy_from_slice(&duplicates.to_le_bytes());
        xxh3_128_with_seed(&material, self.p.root)
    }

    /// Its own end, of conversation `id`: markers at its own blocks (past
    /// the `shared` bytes; a block other conversations also have names
    /// none), and where it ends exactly.
    fn own_end(&self, id: u128, shared: u32, now_ms: u64) -> End {
        let (n, block) = (self.n, self.block);
        let own_from = shared as usize / block.max(1) + 1;
        let tolerance = tolerance_blocks(self.p.tokens_per_byte, block);
        let first = n.saturating_sub(tolerance - 1).max(own_from);
        let mut links = [NO_LINK; MAX_TOLERANCE_BLOCKS + 1];
        let mut n_links = 0;
        for k in first..=n {
            if !self.messages {
                links[n_links] = Link {
                    marker: self.marker(k),
                    next: NIL,
                    depth: k as u32,
                };
                n_links += 1;
            }
        }
        if let Some(key) = self
            .exact
            .filter(|k| !links[..n_links].iter().any(|l| l.marker == *k))
        {
            links[n_links] = Link {
                marker: key,
                next: NIL,
                depth: EXACT,
            };
            n_links += 1;
        }
        End {
            gen: 0,
            live: true,
            conversation: id,
            links,
            n_links: n_links as u8,
            tolerance: tolerance as u8,
            n_blocks: n as u32,
            len: self.q_len,
            tail_len: self.tail_len as u32,
            tail_hash: self.tail_hash,
            tail_exact: self.p.full_bytes == self.canon.len(),
            messages: self.messages,
            exact_block: self
                .canon
                .message_ends
                .last()
                .map_or(0, |&at| self.marker(at / block.max(1))),
            shared,
            slot: UNPLACED,
            bound: false,
            counted: false,
            taken: false,
            filed_ms: now_ms,
        }
    }
}

/// A prompt's look-up, depth by depth.
struct Walk {
    /// Where the prompt ends.
    q_len: u32,
    met: [Option<Met>; MET],
    n_met: usize,
    /// Ends of the very same prompt met.
    duplicates: u32,
    /// Where the deepest taken end it would have continued went.
    forked: Option<u32>,
}

impl Walk {
    /// The end under `key` the prompt continues, if any: `agreement` says
    /// how far the prompt agrees with an end there (`None`: not at all).
    /// The best of several: an exact extension over a tolerant one, a bound
    /// conversation over one on probation, then the oldest.
    fn depth(
        &mut self,
        inner: &Inner,
        key: u64,
        exact_key: bool,
        agreement: impl Fn(&End) -> Option<u32>,
    ) -> Option<u32> {
        let list = inner.markers.get(&key)?;
        let mut best: Option<(u32, Rank)> = None;
        let mut same = 0;
        let mut i = list.head;
        while i != NIL {
            let at = i;
            let e = &inner.ends[at as usize];
            i = e.next(key);
            let Some(agreement) = agreement(e) else {
                continue;
            };
            if e.taken {
                // Its conversation went on already: this prompt forks it.
                if agreement > e.shared && self.q_len > e.len && e.slot != UNPLACED {
                    self.forked.get_or_insert(e.slot);
                }
                continue;
            }
            let exact = agreement == e.len;
            if exact && self.q_len == e.len {
                same += 1;
            }
            if self.n_met < MET {
                self.met[self.n_met] = Some(Met { end: at, agreement });
                self.n_met += 1;
            }
            let continues = agreement > e.shared && self.q_len > e.len;
            if continues {
                let rank = (exact, e.bound, std::cmp::Reverse(e.filed_ms));
                if best.is_none_or(|(_, r)| rank > r) {
                    best = Some((at, rank));
                }
            }
        }
        // Under an exact key only the very same prompt is filed: all it
        // ever held are duplicates, though it keeps only the latest few.
        self.duplicates += match same {
            0 => 0,
            _ if exact_key => list.filed,
            n => n,
        };
        best.map(|(end, _)| end)
    }
}

impl Conversations {
    /// At most `max_ends` ends; a new conversation counts as a session for
    /// `probation_ms`, and an end is kept `ttl_ms` at most.
    pub fn new(max_ends: usize, probation_ms: u64, ttl_ms: u64) -> Self {
        Conversations {
            inner: Mutex::new(Inner {
                markers: Default::default(),
                exact_blocks: Default::default(),
                ends: Vec::new(),
                free: Vec::new(),
                order: VecDeque::new(),
                counted: VecDeque::new(),
                live: 0,
                taken: 0,
                cap: max_ends.max(1),
            }),
            probation: (0..MAX_BACKENDS).map(|_| AtomicU32::new(0)).collect(),
            probation_ms: AtomicU64::new(probation_ms),
            ttl_ms: AtomicU64::new(ttl_ms),
        }
    }

    /// Apply a reload's probation and TTL (from the next sweep on).
    pub fn configure(&self, probation_ms: u64, ttl_ms: u64) {
        self.probation_ms.store(probation_ms, Ordering::Relaxed);
        self.ttl_ms.store(ttl_ms, Ordering::Relaxed);
    }

    /// Conversations on probation at `slot` that count as its sessions.
    pub fn probation(&self, slot: u32) -> u64 {
        self.probation
            .get(slot as usize)
            .map_or(0, |c| c.load(Ordering::Relaxed) as u64)
    }

    /// Conversations on probation, every backend's.
    pub fn probation_total(&self) -> u64 {
        self.probation
            .iter()
            .map(|c| c.load(Ordering::Relaxed) as u64)
            .sum()
    }

    /// Live ends (conversations this gateway can continue).
    pub fn len(&self) -> usize {
        let inner = self.inner.lock();
        inner.live - inner.taken
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The conversation `p` (read as `canon`, cut in `block`-byte blocks)
    /// belongs to. An end it continues is taken over, and its own end filed,
    /// at once: a second prompt agreeing with the same end is a conversation
    /// of its own, and the same prompt again is another conversation.
    pub fn identify(&self, p: &Prompt, canon: &Canon, block: usize, now_ms: u64) -> Conversation {
        let r = Reading::new(p, canon, block);
        let mut inner = self.inner.lock();
        let mut walk = Walk {
            q_len: r.q_len,
            met: [None; MET],
            n_met: 0,
            duplicates: 0,
            forked: None,
        };
        let found = r
            .continues_messages(&inner, &mut walk)
            .or_else(|| r.continues_blocks(&inner, &mut walk));
        // What it shares with the others it met, they share with it.
        let mut shared = 0;
        for m in walk.met[..walk.n_met].iter().flatten() {
            if Some(m.end) != found {
                shared = shared.max(m.agreement);
                inner.share(m.end, m.agreement, block);
            }
        }
        let (id, continues, continued_key) = match found {
            Some(end) => {
                let e = inner.ends[end as usize];
                shared = shared.max(e.shared);
                self.take_over(&mut inner, end);
                let continued = (e.slot != UNPLACED).then_some(Continued {
                    slot: e.slot,
                    bound: e.bound,
                });
                let key = e.links[..e.n_links as usize]
                    .iter()
                    .find(|l| l.depth == EXACT)
                    .map(|l| l.marker);
                (e.conversation, continued, key.filter(|_| e.messages))
            }
            None => (r.name(walk.duplicates), None, None),
        };
        let end = self.file(&mut inner, r.own_end(id, shared, now_ms));
        drop(inner);
        let forked_at = found.is_none().then_some(walk.forked).flatten();
        let mut c = Conversation {
            id,
            continues,
            forked_at,
            end,
            exact: r.exact.filter(|_| r.messages),
            continued_key,
            earlier: [0; FLEET_LOOKUPS],
            n_earlier: 0,
        };
        if found.is_none() && forked_at.is_none() {
            r.earlier_ends(&mut c);
        }
        c
    }

    /// `c`, a new conversation here, continues conversation `id` of a
    /// fleet's other gateway, whose last turn went to `slot` (`bound`: and
    /// is bound there): its end names that conversation from now on.
    pub fn continue_fleets(&self, c: &mut Conversation, id: u128, slot: u32, bound: bool) {
        let mut inner = self.inner.lock();
        let Handle { index, gen } = c.end;
        if inner.is(index, gen) {
            inner.ends[index as usize].conversation = id;
        }
        c.id = id;
        c.continues = Some(Continued { slot, bound });
        c.forked_at = None;
    }

    /// The request of conversation `c` was routed to `slot`: bound (a
    /// binding holds the conversation now) or on probation. `held`: bytes
    /// of its prompt some backend's cache held already, which a new
    /// conversation shares with earlier traffic (a system prompt, another
    /// conversation's opening). A request routed again (its backend refused
    /// the connection) moves its end.
    pub fn place(&self, c: &Conversation, slot: u32, bound: bool, held: usize) {
        let mut inner = self.inner.lock();
        let Handle { index, gen } = c.end;
        if !inner.is(index, gen) {
            return;
        }
        let e = inner.ends[index as usize];
        if e.counted {
            self.probation[e.slot as usize].fetch_sub(1, Ordering::Relaxed);
        }
        // An end taken over while its request was on its way counts for
        // nobody: its conversation went on.
        let counted = !bound && !e.taken && (slot as usize) < MAX_BACKENDS;
        let shared = match c.continues {
            Some(_) => e.shared,
            // Never all of it: its next turn must still be able to extend it.
            None => e.shared.max(clamp32(held).min(e.len.saturating_sub(1))),
        };
        let end = &mut inner.ends[index as usize];
        end.slot = slot;
        end.bound = bound;
        end.shared = shared;
        end.counted = counted;
        if counted {
            self.probation[slot as usize].fetch_add(1, Ordering::Relaxed);
            if !e.counted {
                inner.counted.push_back((index, gen));
            }
        }
    }

    /// Take `end` in (making room by dropping the oldest), under each of its
    /// markers; returns where it is.
    fn file(&self, inner: &mut Inner, end: End) -> Handle {
        while inner.live >= inner.cap {
            let Some((i, gen)) = inner.order.pop_front() else {
                break;
            };
            if inner.is(i, gen) {
                self.remove(inner, i);
            }
        }
        let index = match inner.free.pop() {
            Some(i) => {
                let gen = inner.ends[i as usize].gen.wrapping_add(1);
                inner.ends[i as usize] = End { gen, ..end };
                i
            }
            None => {
                inner.ends.push(end);
                (inner.ends.len() - 1) as u32
            }
        };
        let gen = inner.ends[index as usize].gen;
        inner.live += 1;
        for j in 0..end.n_links as usize {
            let m = end.links[j].marker;
            let list = inner.markers.entry(m).or_insert(List {
                head: NIL,
                len: 0,
                filed: 0,
            });
            let old = list.head;
            list.head = index;
            list.len += 1;
            list.filed = list.filed.saturating_add(1);
            let cap = match end.links[j].depth {
                EXACT => PER_EXACT,
                _ => PER_MARKER,
            };
            let crowded = list.len > cap;
            inner.ends[index as usize].links[j].next = old;
            if end.links[j].depth == EXACT {
                *inner.exact_blocks.entry(end.exact_block).or_insert(0) += 1;
            }
            if crowded {
                // The oldest there is no longer found by this marker (it
                // still is by its others).
                if let Some(oldest) = inner.last_under(m) {
                    inner.unlink(m, oldest);
                }
            }
        }
        inner.order.push_back((index, gen));
        // Taken-over ends leave their places in the queue behind.
        if inner.order.len() > 2 * inner.cap + 64 {
            let Inner { order, ends, .. } = inner;
            order.retain(|&(i, g)| ends[i as usize].live && ends[i as usize].gen == g);
        }
        Handle { index, gen }
    }

    /// Un-count conversations whose probation has run out, and forget ends
    /// older than the TTL; returns how many ends went.
    pub fn sweep(&self, now_ms: u64) -> usize {
        let probation = self.probation_ms.load(Ordering::Relaxed);
        let ttl = self.ttl_ms.load(Ordering::Relaxed);
        let mut inner = self.inner.lock();
        while let Some(&(i, gen)) = inner.counted.front() {
            let e = inner.ends[i as usize];
            if e.live && e.gen == gen && e.filed_ms + probation > now_ms {
                break;
            }
            inner.counted.pop_front();
            if e.live && e.gen == gen && e.counted {
                inner.ends[i as usize].counted = false;
                self.probation[e.slot as usize].fetch_sub(1, Ordering::Relaxed);
            }
        }
        let mut gone = 0;
        while let Some(&(i, gen)) = inner.order.front() {
            let e = inner.ends[i as usize];
            if e.live && e.gen == gen && e.filed_ms + ttl > now_ms {
                break;
            }
            inner.order.pop_front();
            if e.live && e.gen == gen {
                self.remove(&mut inner, i);
                gone += 1;
            }
        }
        gone
    }

    /// Forget every end at `slot`: its backend left (its slot may come to
    /// name another).
    pub fn forget_backend(&self, slot: u32) {
        let mut inner = self.inner.lock();
        let at: Vec<u32> = (0..inner.ends.len() as u32)
            .filter(|&i| {
                let e = &inner.ends[i as usize];
                e.live && e.slot == slot
            })
            .collect();
        for i in at {
            self.remove(&mut inner, i);
        }
    }

    /// End `i` is continued: it names its conversation no more, but stays
    /// (until its TTL or capacity drops it) so that a fork of it is known.
    fn take_over(&self, inner: &mut Inner, i: u32) {
        let e = &mut inner.ends[i as usize];
        if e.taken {
            return;
        }
        if e.counted {
            self.probation[e.slot as usize].fetch_sub(1, Ordering::Relaxed);
        }
        e.counted = false;
        e.taken = true;
        inner.taken += 1;
    }

    fn remove(&self, inner: &mut Inner, i: u32) {
        let e = inner.ends[i as usize];
        if !e.live {
            return;
        }
        for l in &e.links[..e.n_links as usize] {
            if l.depth != DEAD {
                inner.unlink(l.marker, i);
            }
        }
        if e.counted {
            self.probation[e.slot as usize].fetch_sub(1, Ordering::Relaxed);
        }
        let slot = &mut inner.ends[i as usize];
        slot.live = false;
        slot.counted = false;
        inner.free.push(i);
        inner.live -= 1;
        inner.taken -= e.taken as usize;
    }
}

impl End {
    /// The next end under marker `m` after this one.
    fn next(&self, m: u64) -> u32 {
        self.links[..self.n_links as usize]
            .iter()
            .find(|l| l.marker == m && l.depth != DEAD)
            .map_or(NIL, |l| l.next)
    }
}

impl Inner {
    fn is(&self, i: u32, gen: u32) -> bool {
        let e = &self.ends[i as usize];
        e.live && e.gen == gen
    }

    /// End `i` shares `agreement` bytes with another conversation: its
    /// markers within them name no conversation of its own any more.
    fn share(&mut self, i: u32, agreement: u32, block: usize) {
        let Some(e) = self.ends.get_mut(i as usize) else {
            return;
        };
        e.shared = e.shared.max(agreement);
        let shared = e.shared as usize;
        let mut within = [0u64; MAX_TOLERANCE_BLOCKS + 1];
        let mut n = 0;
        for l in &e.links[..e.n_links as usize] {
            if l.depth != EXACT && l.depth != DEAD && l.depth as usize * block <= shared {
                within[n] = l.marker;
                n += 1;
            }
        }
        for &m in &within[..n] {
            self.unlink(m, i);
        }
    }

    /// The oldest end under marker `m` (the list's last).
    fn last_under(&self, m: u64) -> Option<u32> {
        let mut i = self.markers.get(&m)?.head;
        let mut last = None;
        while i != NIL {
            last = Some(i);
            i = self.ends[i as usize].next(m);
        }
        last
    }

    /// Take end `i` off marker `m`'s list (its link there is dead from now).
    fn unlink(&mut self, m: u64, i: u32) {
        let Some(list) = self.markers.get(&m).copied() else {
            return;
        };
        let after = self.ends[i as usize].next(m);
        let unlinked = if list.head == i {
            match after {
                NIL => self.markers.remove(&m),
                next => self.markers.insert(
                    m,
                    List {
                        head: next,
                        len: list.len - 1,
                        filed: list.filed,
                    },
                ),
            };
            true
        } else {
            let mut at = list.head;
            let mut done = false;
            while at != NIL && !done {
                let e = &mut self.ends[at as usize];
                let n = e.n_links as usize;
                let Some(l) = e.links[..n]
                    .iter_mut()
                    .find(|l| l.marker == m && l.depth != DEAD)
                else {
                    break;
                };
                if l.next == i {
                    l.next = after;
                    done = true;
                } else {
                    at = l.next;
                }
            }
            if done {
                if let Some(list) = self.markers.get_mut(&m) {
                    list.len -= 1;
                }
            }
            done
        };
        if unlinked {
            let e = &mut self.ends[i as usize];
            let n = e.n_links as usize;
            let block = e.exact_block;
            if let Some(l) = e.links[..n]
                .iter_mut()
                .find(|l| l.marker == m && l.depth != DEAD)
            {
                if l.depth == EXACT {
                    if let Some(count) = self.exact_blocks.get_mut(&block) {
                        *count -= 1;
                        if *count == 0 {
                            self.exact_blocks.remove(&block);
                        }
                    }
                }
                l.depth = DEAD;
            }
        }
    }
}

fn clamp32(n: usize) -> u32 {
    n.min(u32::MAX as usize) as u32
}

#[cfg(test)]
mod tests {
    use super::super::prompt::Chunker;
    use super::*;
    use serde_json::value::RawValue;
    use serde_json::{json, Value};
    use std::collections::HashMap;

    const B: usize = 64;
    const C: Chunker = Chunker {
        block_bytes: B,
        max_read_bytes: 1 << 20,
        seed: 3,
    };

    /// What the gateway does with one keyless request: read its prompt,
    /// find its conversation, route it to `slot` (bound or on probation).
    fn turn(cs: &Conversations, body: &Value, slot: u32, bound: bool, held: usize) -> Conversation {
        turn_in(&C, cs, body, slot, bound, held)
    }

    fn turn_in(
        chunker: &Chunker,
        cs: &Conversations,
        body: &Value,
        slot: u32,
        bound: bool,
        held: usize,
    ) -> Conversation {
        let text = body.to_string();
        let top: HashMap<String, Box<RawValue>> = serde_json::from_str(&text).unwrap();
        let (p, canon) = chunker
            .prompt("t", Some("m"), false, |f: &str| {
                top.get(f).map(|v| v.get().as_bytes())
            })
            .unwrap();
        let c = cs.identify(&p, &canon, chunker.block_bytes, 1_000);
        cs.place(&c, slot, bound, held);
        c
    }

    fn conversations() -> Conversations {
        Conversations::new(10_000, 60_000, 1_800_000)
    }

    fn chat(messages: &[(&str, String)]) -> Value {
        let msgs: Vec<Value> = messages
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        json!({"model": "m", "messages": msgs})
    }

    fn ids(v: &[u32]) -> Value {
        json!({"model": "m", "prompt": v})
    }

    fn seq(from: u32, n: u32) -> Vec<u32> {
        (from..from + n).collect()
    }

    fn system() -> String {
        "Follow the house style; cite the files you read. ".repeat(40)
    }

    #[test]
    fn a_turn_that_extends_the_one_before_continues_it() {
        let cs = conversations();
        let sys = system();
        let t1 = vec![
            ("system", sys.clone()),
            ("user", "fix parser.rs".to_string()),
        ];
        let a = turn(&cs, &chat(&t1), 2, false, 0);
        assert_eq!(a.continues, None, "a first turn is new");
        let mut t2 = t1.clone();
        t2.push(("assistant", "reading it".into()));
        t2.push(("user", "now the tests".into()));
        let b = turn(&cs, &chat(&t2), 2, true, 0);
        assert_eq!(b.id, a.id);
        assert_eq!(
            b.continues,
            Some(Continued {
                slot: 2,
                bound: false
            }),
            "its second turn finds it on probation where it went"
        );
        let mut t3 = t2.clone();
        t3.push(("assistant", "ok".into()));
        t3.push(("user", "ship it".into()));
        let c = turn(&cs, &chat(&t3), 2, true, 0);
        assert_eq!(c.id, a.id);
        assert_eq!(c.continues.map(|x| x.bound), Some(true));
        // One end per conversation: each turn took the one before over.
        assert_eq!(cs.len(), 1);
    }

    #[test]
    fn conversations_sharing_a_system_prompt_and_short_first_turns_stay_apart() {
        let cs = conversations();
        let sys = system();
        let hi = turn(
            &cs,
            &chat(&[("system", sys.clone()), ("user", "hi".into())]),
            0,
            false,
            0,
        );
        // The index held the system prompt already when the second came.
        let held = sys.len() / B * B;
        let yo = turn(
            &cs,
            &chat(&[("system", sys.clone()), ("user", "yo".into())]),
            1,
            false,
            held,
        );
        assert_ne!(hi.id, yo.id);
        assert_eq!(yo.continues, None);
        // A longer first turn after the same system prompt is no next turn
        // of either.
        let long = chat(&[
            ("system", sys.clone()),
            ("user", "a long question ".repeat(30)),
        ]);
        assert_eq!(turn(&cs, &long, 2, false, held).continues, None);
        // Each one's second turn finds its own.
        for (c, first, slot) in [(&hi, "hi", 0), (&yo, "yo", 1)] {
            let next = chat(&[
                ("system", sys.clone()),
                ("user", first.into()),
                ("assistant", "hello".into()),
                ("user", "and then?".into()),
            ]);
            let n = turn(&cs, &next, slot, true, 0);
            assert_eq!(n.id, c.id);
            assert_eq!(n.continues.map(|x| x.slot), Some(slot));
        }
    }

    #[test]
    fn identical_first_turns_are_conversations_of_their_own_that_part_where_they_diverge() {
        let cs = conversations();
        let sys = system();
        let opening = vec![
            ("system", sys.clone()),
            ("user", "solve task 7".to_string()),
        ];
        // Eight rollouts of one task: the same first turn, spread by placement.
        let firsts: Vec<Conversation> = (0..8)
            .map(|i| turn(&cs, &chat(&opening), i % 3, false, 0))
            .collect();
        let names: std::collections::HashSet<u128> = firsts.iter().map(|c| c.id).collect();
        assert_eq!(names.len(), 8, "each its own name");
        assert!(firsts.iter().all(|c| c.continues.is_none()));
        // They diverge at their second turn: none continues the shared
        // opening (it holds nothing of any one of them) ...
        let second = |i: usize| {
            let mut m = opening.clone();
            m.push(("assistant", "thinking".into()));
            m.push(("user", format!("rollout {i}: try another way")));
            chat(&m)
        };
        let seconds: Vec<Conversation> =
            (0..8).map(|i| turn(&cs, &second(i), 0, false, 0)).collect();
        assert!(seconds.iter().all(|c| c.continues.is_none()), "{seconds:?}");
        // Nor is any a fork of one of them: the opening is everyone's.
        assert!(seconds.iter().all(|c| c.forked_at.is_none()), "{seconds:?}");
        let names: std::collections::HashSet<u128> = seconds.iter().map(|c| c.id).collect();
        assert_eq!(names.len(), 8);
        // ... and from then on each continues its own.
        for (i, s) in seconds.iter().enumerate() {
            let mut m = opening.clone();
            m.push(("assistant", "thinking".into()));
            m.push(("user", format!("rollout {i}: try another way")));
            m.push(("assistant", "done".into()));
            m.push(("user", "check it".into()));
            let third = turn(&cs, &chat(&m), 0, true, 0);
            assert_eq!(third.id, s.id, "rollout {i}");
        }
    }

    #[test]
    fn a_turn_that_re_renders_the_tail_of_the_one_before_continues_it() {
        // The gateway's own block size, and a trace's blocks of 512 token
        // ids (ids of 5 digits: 3 KB of canonical prompt a trace block).
        let chunker = Chunker {
            block_bytes: 1024,
            ..C
        };
        let cs = conversations();
        let block = |id: u32| seq(10_000 + id * 512, 512);
        // Turn 1: two full trace blocks and a partial third; turn 2 keeps
        // the full ones, gives the partial block new ids (re-tokenised, as a
        // real trace's `hash_ids` do) and adds more.
        let t1 = [block(1), block(2), block(3)[..300].to_vec()].concat();
        let t2 = [block(1), block(2), block(7), block(8)[..100].to_vec()].concat();
        let a = turn_in(&chunker, &cs, &ids(&t1), 1, false, 0);
        let b = turn_in(&chunker, &cs, &ids(&t2), 1, true, 0);
        assert_eq!(b.id, a.id);
        assert_eq!(b.continues.map(|c| c.slot), Some(1));
        // The same shape byte for byte continues too.
        let t3 = [t2.clone(), block(9)].concat();
        assert_eq!(turn_in(&chunker, &cs, &ids(&t3), 1, true, 0).id, a.id);
        // Another conversation after the same first two blocks, whose own
        // part is as long as turn 1's: no next turn of it.
        let other = [block(1), block(2), block(20)[..300].to_vec()].concat();
        let o = turn_in(&chunker, &cs, &ids(&other), 2, false, 0);
        assert_ne!(o.id, a.id);
    }

    #[test]
    fn a_re_tokenised_tail_is_tolerated_in_tokens_whatever_the_ids_width() {
        // Token ids of eight digits (9 canonical bytes each): a turn that
        // re-tokenises the last 512 tokens of the one before rewrites 4.5
        // KiB, five or six of the gateway's 1 KiB blocks.
        let chunker = Chunker {
            block_bytes: 1024,
            ..C
        };
        let cs = conversations();
        let head = seq(10_000_000, 1_500);
        let t1 = [head.clone(), seq(20_000_000, 512)].concat();
        let t2 = [head.clone(), seq(30_000_000, 512), seq(40_000_000, 200)].concat();
        let a = turn_in(&chunker, &cs, &ids(&t1), 1, false, 0);
        let b = turn_in(&chunker, &cs, &ids(&t2), 1, true, 0);
        assert_eq!(b.id, a.id);
        assert_eq!(b.continues.map(|c| c.slot), Some(1));
        // Rewritten further back (1,100 tokens): another conversation.
        let far = [seq(10_000_000, 900), seq(50_000_000, 1_400)].concat();
        let c = turn_in(&chunker, &cs, &ids(&far), 2, false, 0);
        assert_ne!(c.id, a.id);
        assert_eq!(c.continues, None);
        // Text keeps its four blocks; wide ids get more, never past the cap.
        assert_eq!(tolerance_blocks(0.25, 1024), TOLERANCE_BLOCKS);
        assert_eq!(tolerance_blocks(1.0 / 9.0, 1024), 6);
        assert_eq!(tolerance_blocks(1.0 / 30.0, 1024), MAX_TOLERANCE_BLOCKS);
    }

    #[test]
    fn a_sibling_that_replaces_the_last_turn_by_one_of_its_size_is_a_fork() {
        let cs = conversations();
        let shared = seq(1, 2048);
        let a = turn(
            &cs,
            &ids(&[shared.clone(), seq(10_000, 300)].concat()),
            0,
            false,
            0,
        );
        // Another turn after the same prefix, of the same size: a fork.
        let b = turn(
            &cs,
            &ids(&[shared.clone(), seq(20_000, 300)].concat()),
            1,
            false,
            0,
        );
        assert_eq!(b.continues, None);
        assert_ne!(a.id, b.id);
        // The first one's next turn still finds it.
        let next = [shared, seq(10_000, 300), seq(30_000, 500)].concat();
        assert_eq!(turn(&cs, &ids(&next), 0, true, 0).id, a.id);
    }

    #[test]
    fn the_first_continuation_takes_the_end_and_a_second_one_is_a_new_conversation() {
        let cs = conversations();
        let t1 = seq(1, 700);
        let a = turn(&cs, &ids(&t1), 0, false, 0);
        let left = turn(
            &cs,
            &ids(&[t1.clone(), seq(5_000, 200)].concat()),
            0,
            true,
            0,
        );
        let right = turn(
            &cs,
            &ids(&[t1.clone(), seq(6_000, 200)].concat()),
            1,
            false,
            0,
        );
        assert_eq!(left.id, a.id);
        assert_ne!(right.id, a.id);
        assert_eq!(right.continues, None);
    }

    #[test]
    fn a_fork_of_a_conversation_knows_where_the_turn_it_forks_went() {
        let cs = conversations();
        let first = vec![
            ("system", system()),
            (
                "user",
                "Document: the parser's grammar, all of it".repeat(8),
            ),
        ];
        let a = turn(&cs, &chat(&first), 2, false, 0);
        // The parent's next turn continues it; two subagents repeat its
        // transcript with tasks of their own: forks, each a conversation
        // of its own that knows where the transcript went.
        let with = |extra: &[(&str, String)]| {
            let mut m = first.clone();
            m.push(("assistant", "read it".into()));
            m.extend(extra.iter().cloned());
            chat(&m)
        };
        let parent = turn(
            &cs,
            &with(&[("user", "now fix the bug".into())]),
            2,
            true,
            0,
        );
        assert_eq!(parent.id, a.id);
        assert_eq!(parent.forked_at, None);
        for task in ["write the tests", "review the fix"] {
            let child = turn(&cs, &with(&[("user", task.to_string())]), 0, false, 0);
            assert_ne!(child.id, a.id);
            assert_eq!(child.continues, None);
            assert_eq!(child.forked_at, Some(2), "{task}");
        }
        // Only the parent's conversation is live to continue: the taken
        // end tells forks where it went, and is no conversation.
        assert_eq!(cs.len(), 3);
        assert_eq!(cs.probation(2), 0, "the parent is bound");
    }

    #[test]
    fn new_conversations_count_as_sessions_until_bound_or_their_probation_ends() {
        let cs = Conversations::new(10_000, 60_000, 1_800_000);
        for i in 0..5u32 {
            turn(&cs, &ids(&seq(i * 10_000, 600)), i % 2, false, 0);
        }
        assert_eq!((cs.probation(0), cs.probation(1)), (3, 2));
        // A second turn binds its conversation: no longer on probation.
        turn(
            &cs,
            &ids(&[seq(0, 600), seq(900_000, 300)].concat()),
            0,
            true,
            0,
        );
        assert_eq!(cs.probation(0), 2);
        // Probation runs out (filed at 1 s, a minute's probation).
        cs.sweep(60_999);
        assert_eq!(cs.probation(0), 2);
        cs.sweep(61_000);
        assert_eq!((cs.probation(0), cs.probation(1)), (0, 0));
        // Their ends stay, for a late second turn...
        assert_eq!(cs.len(), 5);
        let late = turn(
            &cs,
            &ids(&[seq(10_000, 600), seq(800_000, 300)].concat()),
            1,
            true,
            0,
        );
        assert_eq!(late.continues.map(|c| c.slot), Some(1));
        // ...until the TTL.
        cs.sweep(1_801_000);
        assert!(cs.is_empty());
    }

    #[test]
    fn a_request_routed_again_moves_its_end_and_its_count() {
        let cs = conversations();
        let c = turn(&cs, &ids(&seq(1, 600)), 0, false, 0);
        assert_eq!(cs.probation(0), 1);
        // Its backend refused the connection: it went to another.
        cs.place(&c, 2, false, 0);
        assert_eq!((cs.probation(0), cs.probation(2)), (0, 1));
        cs.forget_backend(2);
        assert_eq!(cs.probation(2), 0);
        assert!(cs.is_empty());
    }

    #[test]
    fn ends_are_bounded_and_one_shots_leave_no_more() {
        let cs = Conversations::new(64, 60_000, 1_800_000);
        for i in 0..1_000u32 {
            turn(&cs, &ids(&seq(i * 1_000, 40)), i % 4, false, 0);
        }
        assert!(cs.len() <= 64, "{}", cs.len());
        let counted: u64 = (0..4).map(|s| cs.probation(s)).sum();
        assert_eq!(counted as usize, cs.len(), "only live ends count");
        // Many conversations whose last full block is shared keep a bounded
        // list under it.
        let cs = conversations();
        for i in 0..100u32 {
            turn(
                &cs,
                &ids(&[seq(1, 300), vec![100_000 + i]].concat()),
                0,
                false,
                0,
            );
        }
        let inner = cs.inner.lock();
        assert!(inner.markers.values().all(|l| l.len <= PER_MARKER));
        // Every end is still found where it ends exactly.
        assert_eq!(inner.live, 100);
        drop(inner);
        // Ends of prompts with messages count in the block they end in, and
        // stop counting when they go.
        let cs = Conversations::new(4, 60_000, 1_800_000);
        for i in 0..10 {
            turn(
                &cs,
                &chat(&[("user", format!("question {i}"))]),
                0,
                false,
                0,
            );
        }
        let inner = cs.inner.lock();
        assert_eq!(inner.live, 4);
        assert_eq!(inner.exact_blocks.values().sum::<u32>(), 4);
    }
}
