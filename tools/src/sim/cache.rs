//! The simulated replica's tokenizer and paged prefix cache.
//!
//! Tokenizer approximation (documented, deterministic): the UTF-8 prompt is cut
//! into 4-byte pieces and each piece hashed to a token id in [0, 50000). Real
//! BPE vocabularies average about four characters a token on English text, so
//! counts land near a real tokenizer's, and — what matters here — a shared
//! text prefix yields a shared token prefix, as it does for a real one.
//!
//! Cache: vLLM's automatic prefix caching in miniature. Tokens are grouped in
//! blocks of `block_size`; block `i`'s hash chains the hash of block `i-1`, so a
//! block matches only if everything before it matches too. Only full blocks are
//! cached. A lookup walks the chain from the start and stops at the first
//! missing block. Capacity is counted in blocks; the least recently used block
//! is evicted first.

use super::kv::CacheEvent;
use std::collections::HashMap;

pub const VOCAB: u32 = 50_000;

fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Text → token ids (see the module doc).
pub fn tokenize(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(4)
        .map(|c| (fnv1a(c, 0) % VOCAB as u64) as u32)
        .collect()
}

/// Chained hashes of the full blocks of `tokens`.
pub fn block_hashes(tokens: &[u32], block_size: usize) -> Vec<u64> {
    salted_block_hashes(tokens, block_size, None)
}

/// [`block_hashes`] of a request with a `cache_salt`: as vLLM and SGLang
/// do, the salt is hashed into the first block (and so into every block
/// chained from it): a prompt finds only blocks stored with its salt.
pub fn salted_block_hashes(tokens: &[u32], block_size: usize, salt: Option<&str>) -> Vec<u64> {
    let mut prev = salt.map_or(0, |s| fnv1a(s.as_bytes(), 0x5a17));
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let mut bytes = Vec::with_capacity(8 + block.len() * 4);
            bytes.extend_from_slice(&prev.to_le_bytes());
            for t in block {
                bytes.extend_from_slice(&t.to_le_bytes());
            }
            prev = fnv1a(&bytes, 0x9e37_79b9);
            prev
        })
        .collect()
}

/// An LRU set of block hashes with O(1) touch and evict (slab + linked list).
pub struct PrefixCache {
    block_size: usize,
    /// 0 = unlimited.
    capacity: usize,
    index: HashMap<u64, usize>,
    nodes: Vec<Node>,
    free: Vec<usize>,
    head: usize,
    tail: usize,
    pub queries_tokens: u64,
    pub hit_tokens: u64,
}

const NIL: usize = usize::MAX;

struct Node {
    hash: u64,
    prev: usize,
    next: usize,
}

impl PrefixCache {
    pub fn new(block_size: usize, capacity_blocks: usize) -> Self {
        PrefixCache {
            block_size: block_size.max(1),
            capacity: capacity_blocks,
            index: HashMap::new(),
            nodes: Vec::new(),
            free: Vec::new(),
            head: NIL,
            tail: NIL,
            queries_tokens: 0,
            hit_tokens: 0,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn len_blocks(&self) -> usize {
        self.index.len()
    }

    pub fn usage(&self) -> f64 {
        if self.capacity == 0 {
            0.0
        } else {
            self.index.len() as f64 / self.capacity as f64
        }
    }

    fn unlink(&mut self, i: usize) {
        let (p, n) = (self.nodes[i].prev, self.nodes[i].next);
        if p != NIL {
            self.nodes[p].next = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.nodes[n].prev = p;
        } else {
            self.tail = p;
        }
    }

    fn push_front(&mut self, i: usize) {
        self.nodes[i].prev = NIL;
        self.nodes[i].next = self.head;
        if self.head != NIL {
            self.nodes[self.head].prev = i;
        } else {
            self.tail = i;
        }
        self.head = i;
    }

    fn touch(&mut self, i: usize) {
        if self.head != i {
            self.unlink(i);
            self.push_front(i);
        }
    }

    /// Tokens of the longest cached prefix of `tokens`, counting the lookup in
    /// the hit/query totals and refreshing the matched blocks.
    pub fn lookup(&mut self, tokens: &[u32]) -> usize {
        self.lookup_salted(tokens, None)
    }

    /// [`PrefixCache::lookup`] of a request with a `cache_salt`.
    pub fn lookup_salted(&mut self, tokens: &[u32], salt: Option<&str>) -> usize {
        let hashes = salted_block_hashes(tokens, self.block_size, salt);
        let mut matched = 0;
        for h in &hashes {
            match self.index.get(h).copied() {
                Some(i) => {
                    self.touch(i);
                    matched += 1;
                }
                None => break,
            }
        }
        let cached = matched * self.block_size;
        self.queries_tokens += tokens.len() as u64;
        self.hit_tokens += cached as u64;
        cached
    }

    /// Cache every full block of `tokens` (after prefill computed them).
    /// Returns what changed, in order, as an engine's KV events tell it:
    /// runs of blocks stored (each chained from its parent) and blocks
    /// evicted to make room.
    pub fn insert(&mut self, tokens: &[u32]) -> Vec<CacheEvent> {
        self.insert_salted(tokens, None)
    }

    /// [`PrefixCache::insert`] of a request with a `cache_salt`.
    pub fn insert_salted(&mut self, tokens: &[u32], salt: Option<&str>) -> Vec<CacheEvent> {
        let mut events = Vec::new();
        let mut run: Vec<u64> = Vec::new();
        let mut run_parent = None;
        let mut prev = None;
        let flush = |events: &mut Vec<CacheEvent>, run: &mut Vec<u64>, parent| {
            if !run.is_empty() {
                events.push(CacheEvent::Stored {
                    hashes: std::mem::take(run),
                    parent,
                });
            }
        };
        for h in salted_block_hashes(tokens, self.block_size, salt) {
            if let Some(&i) = self.index.get(&h) {
                self.touch(i);
                flush(&mut events, &mut run, run_parent);
                prev = Some(h);
                continue;
            }
            if self.capacity > 0 && self.index.len() >= self.capacity {
                let victim = self.tail;
                self.unlink(victim);
                let gone = self.nodes[victim].hash;
                self.index.remove(&gone);
                self.free.push(victim);
                flush(&mut events, &mut run, run_parent);
                match events.last_mut() {
                    Some(CacheEvent::Removed(r)) => r.push(gone),
                    _ => events.push(CacheEvent::Removed(vec![gone])),
                }
            }
            let node = Node {
                hash: h,
                prev: NIL,
                next: NIL,
            };
            let i = match self.free.pop() {
                Some(i) => {
                    self.nodes[i] = node;
                    i
                }
                None => {
                    self.nodes.push(node);
                    self.nodes.len() - 1
                }
            };
            self.index.insert(h, i);
            self.push_front(i);
            if run.is_empty() {
                run_parent = prev;
            }
            run.push(h);
            prev = Some(h);
        }
        flush(&mut events, &mut run, run_parent);
        events
    }

    /// Empty the cache (as an engine's reset does).
    pub fn clear(&mut self) {
        self.index.clear();
        self.nodes.clear();
        self.free.clear();
        self.head = NIL;
        self.tail = NIL;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: u32, salt: u32) -> Vec<u32> {
        (0..n).map(|i| (i * 7 + salt) % VOCAB).collect()
    }

    #[test]
    fn shared_text_prefix_gives_shared_token_prefix() {
        let a = tokenize("You are a helpful agent. Turn one.");
        let b = tokenize("You are a helpful agent. Turn two, longer.");
        let common = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
        assert!(common >= 6, "{common}");
        assert_eq!(tokenize("abcdefgh").len(), 2);
    }

    #[test]
    fn prefix_hits_count_whole_blocks_only() {
        let mut c = PrefixCache::new(16, 0);
        let t = toks(40, 0);
        assert_eq!(c.lookup(&t), 0);
        c.insert(&t);
        // 40 tokens = 2 full blocks cached; the partial third is not.
        assert_eq!(c.len_blocks(), 2);
        assert_eq!(c.lookup(&t), 32);
        let mut longer = t.clone();
        longer.extend(toks(30, 1));
        assert_eq!(c.lookup(&longer), 32);
        assert_eq!(c.queries_tokens, 40 + 40 + 70);
        assert_eq!(c.hit_tokens, 64);
    }

    #[test]
    fn divergence_stops_the_match() {
        let mut c = PrefixCache::new(16, 0);
        let t = toks(64, 0);
        c.insert(&t);
        let mut other = t.clone();
        other[20] = 99; // inside block 1
        assert_eq!(c.lookup(&other), 16);
    }

    #[test]
    fn inserts_report_what_they_stored_and_evicted_in_order() {
        let mut c = PrefixCache::new(16, 3);
        let a = toks(32, 0);
        let ha = block_hashes(&a, 16);
        assert_eq!(
            c.insert(&a),
            vec![CacheEvent::Stored {
                hashes: ha.clone(),
                parent: None
            }]
        );
        // Extending it stores only the new block, chained from the last.
        let mut longer = a.clone();
        longer.extend(toks(16, 3));
        let hl = block_hashes(&longer, 16);
        assert_eq!(
            c.insert(&longer),
            vec![CacheEvent::Stored {
                hashes: vec![hl[2]],
                parent: Some(hl[1])
            }]
        );
        // A new prompt of two blocks evicts the two least recent.
        let b = toks(32, 9);
        let hb = block_hashes(&b, 16);
        assert_eq!(
            c.insert(&b),
            vec![
                CacheEvent::Removed(vec![ha[0]]),
                CacheEvent::Stored {
                    hashes: vec![hb[0]],
                    parent: None
                },
                CacheEvent::Removed(vec![ha[1]]),
                CacheEvent::Stored {
                    hashes: vec![hb[1]],
                    parent: Some(hb[0])
                },
            ]
        );
    }

    #[test]
    fn eviction_is_least_recently_used() {
        let mut c = PrefixCache::new(16, 4);
        let a = toks(32, 0); // 2 blocks
        let b = toks(32, 5); // 2 blocks
        c.insert(&a);
        c.insert(&b);
        assert_eq!(c.lookup(&a), 32); // a becomes most recent
        let d = toks(32, 9);
        c.insert(&d); // evicts b's two blocks
        assert_eq!(c.lookup(&a), 32);
        assert_eq!(c.lookup(&b), 0);
        assert_eq!(c.lookup(&d), 32);
        assert_eq!(c.len_blocks(), 4);
        assert!((c.usage() - 1.0).abs() < 1e-9);
    }
}
