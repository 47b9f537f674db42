//! One engine's KV-cache holdings as its events tell them: which blocks it
//! holds, how they chain, and how far each session's latest prompt reaches.
//!
//! An engine reuses a prompt's cached blocks from its start up to the first
//! one it no longer holds. A session's turns extend each other, so what the
//! engine still holds of a session is its latest block chain's leading run of
//! held blocks: [`Holdings::held_tokens`] walks the chain from its tip to its
//! root and counts the blocks before the first one missing.
//!
//! Bounded: links (block → parent, depth) are kept for at most `max_links`
//! blocks, held or not (a removed block's link still tells what came before
//! it); sessions' tips for at most `max_sessions`. Past either, the oldest go;
//! a chain whose links went is counted only as far as it is known (never
//! more than the engine holds).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};

/// Keys here are hashes already (an engine's block hashes, sessions'
/// digests): one multiply spreads them, where SipHash would cost a walk
/// down a long chain several times over.
#[derive(Default)]
struct Spread(u64);

impl Hasher for Spread {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ b as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (n ^ (n >> 29)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type Map<V> = HashMap<u64, V, BuildHasherDefault<Spread>>;

/// What is known of one block.
#[derive(Clone, Copy, Debug)]
struct Link {
    /// 0: the block starts a sequence.
    parent: u64,
    /// Blocks from the start of its sequence to it, itself included.
    depth: u32,
    held: bool,
}

#[derive(Clone, Copy, Debug)]
struct Tip {
    block: u64,
    depth: u32,
    /// The last walk's answer, and the changes it saw: while no block has
    /// gone or come back since, the chain holds what it held then.
    walked: Option<(u64, u32)>,
}

pub struct Holdings {
    links: Map<Link>,
    /// Insertion order of `links`, for bounding it.
    order: VecDeque<u64>,
    sessions: Map<Tip>,
    session_order: VecDeque<u64>,
    held: usize,
    /// Blocks that went (removed, cleared, their links dropped) or came
    /// back so far: a walk's answer stands while this stands.
    changes: u64,
    block_size: u32,
    max_links: usize,
    max_sessions: usize,
}

impl Holdings {
    pub fn new(max_links: usize, max_sessions: usize) -> Holdings {
        Holdings {
            links: Map::default(),
            order: VecDeque::new(),
            sessions: Map::default(),
            session_order: VecDeque::new(),
            held: 0,
            changes: 0,
            block_size: 0,
            max_links: max_links.max(1),
            max_sessions: max_sessions.max(1),
        }
    }

    /// Blocks `hashes` are held, chained from `parent`; `session` (its hash)
    /// stored them, and its latest prompt reaches the last of them.
    pub fn stored(
        &mut self,
        hashes: &[u64],
        parent: Option<u64>,
        block_size: u32,
        session: Option<u64>,
    ) {
        self.block_size = block_size;
        let mut parent = parent.unwrap_or(0);
        let mut depth = match parent {
            0 => 0,
            p => self.links.get(&p).map_or(0, |l| l.depth),
        };
        for &h in hashes {
            depth += 1;
            let fresh = match self.links.get_mut(&h) {
                Some(l) => {
                    if !l.held {
                        self.held += 1;
                        self.changes += 1;
                    }
                    *l = Link {
                        parent,
                        depth,
                        held: true,
                    };
                    false
                }
                None => {
                    self.links.insert(
                        h,
                        Link {
                            parent,
                            depth,
                            held: true,
                        },
                    );
                    self.held += 1;
                    true
                }
            };
            if fresh {
                self.order.push_back(h);
            }
            parent = h;
        }
        if let (Some(s), Some(&block)) = (session, hashes.last()) {
            let tip = Tip {
                block,
                depth,
                walked: None,
            };
            if self.sessions.insert(s, tip).is_none() {
                self.session_order.push_back(s);
            }
        }
        self.bound();
    }

    /// Blocks no longer held.
    pub fn removed(&mut self, hashes: &[u64]) {
        for h in hashes {
            if let Some(l) = self.links.get_mut(h) {
                if l.held {
                    l.held = false;
                    self.held -= 1;
                    self.changes += 1;
                }
            }
        }
    }

    /// Nothing held any more (the engine cleared its cache or restarted).
    /// The sessions it held stay known, as holding nothing: they were
    /// evicted, and may move.
    pub fn clear(&mut self) {
        self.links.clear();
        self.order.clear();
        self.held = 0;
        self.changes += 1;
    }

    /// Blocks held now.
    pub fn held_blocks(&self) -> usize {
        self.held
    }

    /// Tokens a block holds (the engine's own; 0 before its first event).
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Whether the engine stored anything for `session` that is still known.
    pub fn knows(&self, session: u64) -> bool {
        self.sessions.contains_key(&session)
    }

    /// Tokens of `session`'s latest prompt the engine still holds from its
    /// start (`None`: no block of it was ever reported).
    pub fn held_tokens(&mut self, session: u64) -> Option<u64> {
        let tip = *self.sessions.get(&session)?;
        if let Some((changes, lead)) = tip.walked {
            if changes == self.changes {
                return Some(lead as u64 * self.block_size as u64);
            }
        }
        // Walk tip → root: the leading run ends before the missing block
        // nearest the root.
        let mut lead = tip.depth;
        let mut at = tip.block;
        let mut depth = tip.depth;
        while at != 0 && depth > 0 {
            match self.links.get(&at) {
                Some(l) => {
                    if !l.held {
                        lead = depth - 1;
                    }
                    at = l.parent;
                }
                None => {
                    // Its link went: nothing before it is known.
                    lead = 0;
                    break;
                }
            }
            depth -= 1;
        }
        if let Some(t) = self.sessions.get_mut(&session) {
            t.walked = Some((self.changes, lead));
        }
        Some(lead as u64 * self.block_size as u64)
    }

    fn bound(&mut self) {
        while self.links.len() > self.max_links {
            let Some(h) = self.order.pop_front() else {
                break;
            };
            if let Some(l) = self.links.remove(&h) {
                self.changes += 1;
                if l.held {
                    self.held -= 1;
                }
            }
        }
        while self.sessions.len() > self.max_sessions {
            let Some(s) = self.session_order.pop_front() else {
                break;
            };
            self.sessions.remove(&s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sessions_holding_is_its_chains_leading_run_of_held_blocks() {
        let mut h = Holdings::new(1000, 10);
        // A shared opening (another session), then session 7's turns.
        h.stored(&[1, 2], None, 16, Some(99));
        h.stored(&[3, 4], Some(2), 16, Some(7));
        assert_eq!(h.held_tokens(7), Some(4 * 16));
        // The next turn extends it.
        h.stored(&[5], Some(4), 16, Some(7));
        assert_eq!(h.held_tokens(7), Some(5 * 16));
        // A block in the middle goes: only what comes before it is reused.
        h.removed(&[3]);
        assert_eq!(h.held_tokens(7), Some(2 * 16));
        assert_eq!(h.held_tokens(99), Some(2 * 16));
        // The opening goes: nothing of it is reused.
        h.removed(&[1]);
        assert_eq!(h.held_tokens(7), Some(0));
        assert!(h.knows(7));
        assert_eq!(h.held_tokens(8), None);
        // Stored again (a later turn recomputed them): held again.
        h.stored(&[1, 2, 3, 4, 5, 6], None, 16, Some(7));
        assert_eq!(h.held_tokens(7), Some(6 * 16));
        assert_eq!(h.held_blocks(), 6);
        h.clear();
        assert_eq!(h.held_tokens(7), Some(0), "known, and evicted");
        assert_eq!(h.held_blocks(), 0);
    }

    #[test]
    fn a_remembered_walk_stands_only_while_nothing_went_or_came_back() {
        let mut h = Holdings::new(1000, 10);
        h.stored(&[1, 2, 3], None, 16, Some(7));
        assert_eq!(h.held_tokens(7), Some(48));
        // Others' new blocks change nothing of its chain.
        h.stored(&[10, 11], None, 16, Some(8));
        assert_eq!(h.held_tokens(7), Some(48));
        h.removed(&[2]);
        assert_eq!(h.held_tokens(7), Some(16));
        // Another session computes block 2 again: held again.
        h.stored(&[1, 2], None, 16, Some(8));
        assert_eq!(h.held_tokens(7), Some(48));
    }

    #[test]
    fn bounded_and_never_more_than_held() {
        let mut h = Holdings::new(4, 2);
        h.stored(&[1, 2, 3], None, 16, Some(1));
        h.stored(&[4, 5], Some(3), 16, Some(1));
        // Links of 1 went: the chain is known only as far as its links.
        assert!(h.links.len() <= 4);
        assert_eq!(h.held_tokens(1), Some(0));
        for s in 2..10 {
            h.stored(&[100 + s], None, 16, Some(s));
        }
        assert!(h.sessions.len() <= 2);
        assert!(h.held_blocks() <= 4);
        assert_eq!(h.held_tokens(9), Some(16));
    }
}
