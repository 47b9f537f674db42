//! Conversations of prompts without messages (completions' `prompt`, text or
//! token ids): no anchor names them, so each prompt's end is remembered, and
//! a prompt that extends an earlier prompt whole is that prompt's
//! conversation's next turn (how Mooncake's traces group requests). A
//! prompt that extends none starts a conversation of its own.
//!
//! An end is filed under the chained hash of the last full block before it,
//! with the length and hash of the bytes after that block; finding a prompt's
//! conversation looks its block boundaries up from the last, and checks the
//! tail. The next turn takes the end over (one end per live conversation), so
//! a second prompt extending the same end (a fork) starts a conversation of
//! its own, which prefix-aware placement still sends where the prefix lives.
//!
//! Ends are this gateway's own: in a fleet, only conversations with messages
//! (whose anchor every gateway derives alike) are named fleet-wide.

use super::prompt::Prompt;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use xxhash_rust::xxh3::{xxh3_128_with_seed, xxh3_64_with_seed};

#[derive(Clone, Copy, Debug)]
struct End {
    tail_len: u32,
    tail_hash: u64,
    conversation: u128,
}

struct Shard {
    ends: HashMap<u64, Vec<End>>,
    /// Boundaries in the order their ends were filed, oldest first.
    order: VecDeque<u64>,
    cap: usize,
}

pub struct Ends {
    shards: Box<[Mutex<Shard>]>,
}

const SHARDS: usize = 16;

/// Heap bytes an end costs, about: its entry in the map and the order.
pub const END_BYTES: usize = 96;

impl Ends {
    pub fn new(max_ends: usize) -> Self {
        let cap = (max_ends / SHARDS).max(1);
        Ends {
            shards: (0..SHARDS)
                .map(|_| {
                    Mutex::new(Shard {
                        ends: HashMap::new(),
                        order: VecDeque::new(),
                        cap,
                    })
                })
                .collect(),
        }
    }

    fn shard(&self, boundary: u64) -> &Mutex<Shard> {
        &self.shards[(boundary >> 60) as usize % SHARDS]
    }

    /// The conversation `p` continues, or a new one; `p`'s end is filed as
    /// that conversation's latest.
    pub fn conversation(&self, p: &Prompt, block_bytes: usize) -> u128 {
        let boundary = |k: usize| if k == 0 { p.root } else { p.blocks[k - 1] };
        let found = (0..=p.blocks.len()).rev().find_map(|k| {
            let at = boundary(k);
            let start = k * block_bytes;
            let mut shard = self.shard(at).lock();
            let list = shard.ends.get_mut(&at)?;
            let i = list.iter().position(|e| {
                let end = start + e.tail_len as usize;
                end <= p.canon.len() && xxh3_64_with_seed(&p.canon[start..end], at) == e.tail_hash
            })?;
            let e = list.swap_remove(i);
            if list.is_empty() {
                shard.ends.remove(&at);
            }
            Some(e.conversation)
        });
        let conversation = found.unwrap_or_else(|| xxh3_128_with_seed(&p.canon, p.root));
        let k = p.blocks.len();
        let at = boundary(k);
        let tail = &p.canon[k * block_bytes..];
        let end = End {
            tail_len: tail.len() as u32,
            tail_hash: xxh3_64_with_seed(tail, at),
            conversation,
        };
        let mut shard = self.shard(at).lock();
        while shard.order.len() >= shard.cap {
            let Some(old) = shard.order.pop_front() else {
                break;
            };
            if let Some(list) = shard.ends.get_mut(&old) {
                list.remove(0);
                if list.is_empty() {
                    shard.ends.remove(&old);
                }
            }
        }
        let list = shard.ends.entry(at).or_default();
        // The same prompt again (a retry) files one end, not two.
        list.retain(|e| e.conversation != conversation || e.tail_len != end.tail_len);
        list.push(end);
        shard.order.push_back(at);
        conversation
    }

    pub fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().ends.values().map(Vec::len).sum::<usize>())
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::super::prompt::Chunker;
    use super::*;
    use serde_json::value::RawValue;

    const C: Chunker = Chunker {
        block_bytes: 32,
        max_read_bytes: 1 << 20,
        seed: 3,
    };

    fn ids(v: &[u32]) -> Prompt {
        let text = serde_json::to_string(v).unwrap();
        let raw: Box<RawValue> = RawValue::from_string(text).unwrap();
        C.prompt("t", Some("m"), |f| {
            (f == "prompt").then_some(raw.get().as_bytes())
        })
        .unwrap()
    }

    fn seq(from: u32, n: u32) -> Vec<u32> {
        (from..from + n).collect()
    }

    #[test]
    fn a_prompt_that_extends_an_earlier_one_is_its_next_turn() {
        let ends = Ends::new(1000);
        // Two conversations sharing a 100-token prefix (a system prompt),
        // whose first turns are short.
        let shared = seq(1, 100);
        let a1 = [shared.clone(), vec![7001, 7002]].concat();
        let b1 = [shared.clone(), vec![8001]].concat();
        let a = ends.conversation(&ids(&a1), 32);
        let b = ends.conversation(&ids(&b1), 32);
        assert_ne!(a, b, "a shared prefix does not merge them");
        let a2 = [a1.clone(), seq(20_000, 300)].concat();
        let b2 = [b1.clone(), seq(30_000, 5)].concat();
        assert_eq!(ends.conversation(&ids(&a2), 32), a);
        assert_eq!(ends.conversation(&ids(&b2), 32), b);
        let a3 = [a2.clone(), seq(40_000, 50)].concat();
        assert_eq!(ends.conversation(&ids(&a3), 32), a);
        // A retry of the same turn is the same conversation.
        assert_eq!(ends.conversation(&ids(&a3), 32), a);
        // One end per conversation is kept, not one per turn.
        assert_eq!(ends.len(), 2);
        // A prompt extending the shared prefix alone is a new conversation.
        let c = ends.conversation(&ids(&[shared, vec![9001]].concat()), 32);
        assert!(c != a && c != b);
    }

    #[test]
    fn a_fork_of_a_turn_starts_its_own_conversation() {
        let ends = Ends::new(1000);
        let t1 = seq(1, 200);
        let a = ends.conversation(&ids(&t1), 32);
        let left = ends.conversation(&ids(&[t1.clone(), vec![1]].concat()), 32);
        let right = ends.conversation(&ids(&[t1.clone(), vec![2]].concat()), 32);
        assert_eq!(left, a);
        assert_ne!(right, a);
    }

    #[test]
    fn ends_are_bounded() {
        let ends = Ends::new(64);
        for i in 0..1000 {
            ends.conversation(&ids(&seq(i * 1000, 40)), 32);
        }
        assert!(ends.len() <= 64, "{}", ends.len());
    }
}
