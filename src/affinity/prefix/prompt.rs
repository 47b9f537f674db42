//! What a request's prompt is, as routing reads it: the canonical prompt cut
//! into fixed-size blocks with chained hashes (what an engine's prefix cache
//! can reuse), an estimate of its tokens, and the conversation it belongs to.
//!
//! The canonical prompt is the request's prompt fields as the client sent
//! them, in prompt order, each element's raw JSON followed by a separator:
//! `tools`, then every `messages` element (chat completions); `instructions`,
//! then `input` (Responses API: a string, or its items); or `prompt`
//! (completions: text or token ids, without its closing quote or bracket, so
//! that a prompt extending an earlier one has it as a byte prefix). A client
//! re-sends a conversation's earlier messages byte for byte on every turn, so
//! the blocks of turn *n* are a prefix of those of turn *n + 1*.
//!
//! **Conversation identity.** Where a prompt has messages, its conversation
//! is named by its *anchor*: everything up to and including the first user
//! message (the system prompt, the tool list, the first question). Every turn
//! of a conversation repeats it, so the name is stable across turns and every
//! gateway of a fleet derives the same one; a system prompt or tool list that
//! all conversations share does not merge them (their first user messages
//! differ), however long it is and however short the first question.
//! Conversations whose first turns are byte for byte the same are one
//! conversation to the gateway (they hold the same cache). A prompt without
//! messages (completions) has no anchor: its conversation is found through
//! the earlier prompts it extends ([`super::ends`]).

use crate::affinity::scan::{each_element, string_field};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed, Xxh3};

/// Separates the elements of the canonical prompt.
const SEPARATOR: u8 = 0x1e;

/// Bytes of a prompt per token, for text (about 4 for English).
pub const TEXT_BYTES_PER_TOKEN: f64 = 4.0;

/// The request's prompt as routing reads it.
#[derive(Clone, Debug, Default)]
pub struct Prompt {
    /// The canonical prompt, cut at the configured read length.
    pub canon: Vec<u8>,
    /// Its length before the cut.
    pub full_bytes: usize,
    /// Chained hash of each full block of `canon`: `blocks[i]` names the
    /// whole prefix up to the end of block `i`.
    pub blocks: Vec<u64>,
    /// The seed the chain starts from (the tier and model it is cached under).
    pub root: u64,
    /// Estimated prompt tokens per canonical byte.
    pub tokens_per_byte: f64,
    /// The conversation's name from its anchor; `None`: no messages.
    pub anchor: Option<u128>,
}

/// Where the blocks of prompts are cut, and what seeds their hashes.
#[derive(Clone, Debug)]
pub struct Chunker {
    pub block_bytes: usize,
    /// Bytes of the canonical prompt read at most (the rest is not hashed).
    pub max_read_bytes: usize,
    /// Derived from `affinity.hash_key`: outsiders cannot aim blocks.
    pub seed: u64,
}

impl Chunker {
    /// The prompt of a JSON request body whose top level `fields` gives
    /// (name → raw value); `None` when it carries no prompt routing can read.
    pub fn prompt<'a>(
        &self,
        scope: &str,
        model: Option<&str>,
        field: impl Fn(&str) -> Option<&'a [u8]>,
    ) -> Option<Prompt> {
        let mut tokens_per_byte = 1.0 / TEXT_BYTES_PER_TOKEN;
        // (what comes before the turns, the turns, where the anchor ends in
        // them: `None` for a prompt without messages, which has none)
        let (head, turns, anchor_end) = if let Some(messages) = field("messages") {
            // No user message (a system prompt alone): all of it.
            let end = first_user_end(messages)?.unwrap_or(messages.len());
            (field("tools"), open(messages)?, Some(end))
        } else if let Some(input) = field("input") {
            let end = match input.first() {
                Some(b'[') => first_user_end(input)?.unwrap_or(input.len()),
                // A string input is the user's message.
                Some(b'"') => input.len(),
                _ => return None,
            };
            (field("instructions"), open(input)?, Some(end))
        } else if let Some(prompt) = field("prompt") {
            let turns = open(prompt)?;
            if turns.starts_with(b"[")
                && turns.len() > 1
                && !turns.contains(&b'"')
                && !turns[1..].contains(&b'[')
            {
                // Token ids: count them rather than guess.
                let ids = memchr::memchr_iter(b',', turns).count() + 1;
                tokens_per_byte = ids as f64 / turns.len() as f64;
            }
            (None, turns, None)
        } else {
            return None;
        };
        // Nothing but an opening bracket or quote: no prompt.
        if turns.len() <= 1 && head.is_none() {
            return None;
        }
        let parts: [&[u8]; 3] = match head {
            Some(h) => [h, &[SEPARATOR], turns],
            None => [&[], &[], turns],
        };
        let root = self.root(scope, model);
        let full_bytes = parts.iter().map(|p| p.len()).sum();
        // Where the conversation's name ends: everything up to the end of
        // its first user message.
        let anchor_end =
            anchor_end.map(|end| parts[0].len() + parts[1].len() + end.min(turns.len()));
        // The chain covers what is read to route, and the name however long
        // it is: the name must not change with the read length.
        let hashed = self.max_read_bytes.max(anchor_end.unwrap_or(0));
        let mut blocks = chain(&parts, self.block_bytes, root, hashed);
        // The name's full blocks are hashed in the chain already: the name is
        // the rest hashed with the chain's hash before it.
        let anchor = anchor_end.map(|end| {
            let k = end / self.block_bytes;
            let base = if k == 0 { root } else { blocks[k - 1] };
            let mut h = Xxh3::with_seed(base);
            for p in span(&parts, k * self.block_bytes, end) {
                h.update(p);
            }
            h.digest128()
        });
        blocks.truncate(self.max_read_bytes / self.block_bytes.max(1));
        // Only a prompt without messages keeps its bytes: its conversation
        // is found by the earlier prompt it extends (see `ends`).
        let canon = match anchor {
            None => turns[..turns.len().min(self.max_read_bytes)].to_vec(),
            Some(_) => Vec::new(),
        };
        Some(Prompt {
            canon,
            full_bytes,
            blocks,
            root,
            tokens_per_byte,
            anchor,
        })
    }

    /// The hash every prompt's chain starts from: one per (tier, model).
    pub fn root(&self, scope: &str, model: Option<&str>) -> u64 {
        let h = xxh3_64_with_seed(scope.as_bytes(), self.seed);
        xxh3_64_with_seed(model.unwrap_or("").as_bytes(), h)
    }
}

impl Prompt {
    /// Estimated tokens of the canonical prompt's first `bytes` bytes.
    pub fn tokens_of(&self, bytes: usize) -> u64 {
        (bytes as f64 * self.tokens_per_byte) as u64
    }

    /// Estimated tokens of the first `blocks` blocks.
    pub fn block_tokens(&self, blocks: usize, block_bytes: usize) -> u64 {
        self.tokens_of(blocks * block_bytes)
    }
}

/// The bytes `from..to` of `parts` taken as one byte string, part by part.
fn span<'a>(parts: &'a [&'a [u8]], from: usize, to: usize) -> impl Iterator<Item = &'a [u8]> {
    let mut at = 0;
    parts.iter().filter_map(move |p| {
        let (start, end) = (at, at + p.len());
        at = end;
        let (a, b) = (from.max(start), to.min(end));
        (a < b).then(|| &p[a - start..b - start])
    })
}

/// A prompt field's raw JSON without its closing bracket or quote, so that
/// the field of a later turn, which extends it, has it as a byte prefix.
fn open(raw: &[u8]) -> Option<&[u8]> {
    match raw.first() {
        Some(b'[') | Some(b'"') => Some(&raw[..raw.len() - 1]),
        _ => None,
    }
}

/// Where the first user message of the JSON array `raw` ends (`Some(None)`:
/// it has none; `None`: not an array). Reads no further than that message.
fn first_user_end(raw: &[u8]) -> Option<Option<usize>> {
    let mut end = None;
    each_element(raw, |element, at| {
        let user = string_field(element, b"role") == Some(b"user");
        if user {
            end = Some(at);
        }
        !user
    })?;
    Some(end)
}

/// Chained hashes of the full blocks of `parts` taken as one byte string
/// (at most `max` bytes of it): each block's hash folded into the previous
/// one's (the first into `root`, which is keyed). xxh3 without a seed: a
/// seed makes it derive a new secret for every block over 240 bytes, which
/// cost more than the hashing itself. Blocks are hashed where they lie; only
/// one that straddles two parts is copied.
pub fn chain(parts: &[&[u8]], block: usize, root: u64, max: usize) -> Vec<u64> {
    let block = block.max(1);
    let total = parts.iter().map(|p| p.len()).sum::<usize>().min(max);
    let mut out = Vec::with_capacity(total / block);
    let mut h = root;
    let mut fold = |b: &[u8]| {
        h = crate::affinity::hrw::mix(h ^ xxh3_64(b)).wrapping_add(0x9e37_79b9_7f4a_7c15);
        out.push(h);
    };
    let mut carry: Vec<u8> = Vec::new();
    let mut left = total;
    for part in parts {
        let mut p = &part[..part.len().min(left)];
        left -= p.len();
        if !carry.is_empty() {
            let take = (block - carry.len()).min(p.len());
            carry.extend_from_slice(&p[..take]);
            p = &p[take..];
            if carry.len() == block {
                fold(&carry);
                carry.clear();
            }
        }
        let whole = p.len() / block * block;
        for b in p[..whole].chunks_exact(block) {
            fold(b);
        }
        carry.extend_from_slice(&p[whole..]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use serde_json::value::RawValue;
    use std::collections::HashMap;

    const CHUNKER: Chunker = Chunker {
        block_bytes: 64,
        max_read_bytes: 1 << 20,
        seed: 7,
    };

    fn prompt_of(body: &serde_json::Value) -> Option<Prompt> {
        let text = body.to_string();
        let top: HashMap<String, Box<RawValue>> = serde_json::from_str(&text).unwrap();
        let model = body["model"].as_str();
        CHUNKER.prompt("tier", model, |name| {
            top.get(name).map(|v| v.get().as_bytes())
        })
    }

    fn chat(messages: &[(&str, &str)]) -> serde_json::Value {
        let msgs: Vec<_> = messages
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        json!({"model": "m", "messages": msgs, "stream": true})
    }

    fn system() -> String {
        "You are a careful agent. ".repeat(400) // 10 KiB shared by everyone
    }

    #[test]
    fn a_conversation_keeps_its_name_and_its_blocks_grow_turn_by_turn() {
        let sys = system();
        let t1 = prompt_of(&chat(&[
            ("system", &sys),
            ("user", "fix the bug in parser.rs"),
        ]))
        .unwrap();
        let t2 = prompt_of(&chat(&[
            ("system", &sys),
            ("user", "fix the bug in parser.rs"),
            ("assistant", "Reading parser.rs now."),
            ("user", "now run the tests"),
        ]))
        .unwrap();
        assert!(t1.anchor.is_some());
        assert_eq!(t1.anchor, t2.anchor, "turns of one conversation");
        assert!(t2.blocks.len() > t1.blocks.len());
        assert_eq!(
            t1.blocks[..],
            t2.blocks[..t1.blocks.len()],
            "turn 1 is a prefix of turn 2"
        );
    }

    #[test]
    fn a_shared_system_prompt_does_not_merge_conversations_even_with_short_first_turns() {
        let sys = system();
        let a = prompt_of(&chat(&[("system", &sys), ("user", "hi")])).unwrap();
        let b = prompt_of(&chat(&[("system", &sys), ("user", "yo")])).unwrap();
        assert_ne!(a.anchor, b.anchor);
        // ...while they share the system prompt's blocks, which is what a
        // prefix cache can reuse between them.
        let shared = sys.len() / 64 - 1;
        assert_eq!(a.blocks[..shared], b.blocks[..shared]);
        // Tools and system prompt come before the first question: a change
        // in either is another conversation.
        let mut with_tools = chat(&[("system", &sys), ("user", "hi")]);
        with_tools["tools"] = json!([{"type": "function", "function": {"name": "grep"}}]);
        assert_ne!(prompt_of(&with_tools).unwrap().anchor, a.anchor);
    }

    #[test]
    fn the_tier_and_model_scope_the_chain() {
        let body = chat(&[("system", &system()), ("user", "hi")]);
        let a = prompt_of(&body).unwrap();
        let mut other = body.clone();
        other["model"] = json!("m2");
        let b = prompt_of(&other).unwrap();
        assert_ne!(a.blocks[0], b.blocks[0]);
        assert_ne!(a.anchor, b.anchor);
    }

    #[test]
    fn token_id_prompts_extend_byte_for_byte_and_count_their_ids() {
        let ids: Vec<u32> = (1000..1400).collect();
        let t1 = prompt_of(&json!({"model": "m", "prompt": &ids[..300]})).unwrap();
        let t2 = prompt_of(&json!({"model": "m", "prompt": &ids[..400]})).unwrap();
        assert_eq!(t1.anchor, None, "no messages, no anchor");
        assert_eq!(t1.blocks[..], t2.blocks[..t1.blocks.len()]);
        assert!(t2.canon.starts_with(&t1.canon));
        // 300 ids of 4 digits and a comma: 1/5 of a token per byte.
        assert!(
            (t1.tokens_per_byte - 0.2).abs() < 0.01,
            "{}",
            t1.tokens_per_byte
        );
        let text = prompt_of(&json!({"model": "m", "prompt": "once upon a time"})).unwrap();
        assert_eq!(text.tokens_per_byte, 0.25);
    }

    #[test]
    fn responses_input_and_instructions() {
        let sys = system();
        let one = prompt_of(&json!({"model": "m", "instructions": sys, "input": "hello"})).unwrap();
        let items = prompt_of(&json!({"model": "m", "instructions": sys, "input": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi!"},
            {"role": "user", "content": "more"},
        ]}))
        .unwrap();
        assert!(one.anchor.is_some() && items.anchor.is_some());
        assert_eq!(
            one.blocks[..sys.len() / 64 - 1],
            items.blocks[..sys.len() / 64 - 1]
        );
    }

    #[test]
    fn bodies_without_a_prompt_are_not_read_as_one() {
        assert!(prompt_of(&json!({"model": "m"})).is_none());
        assert!(prompt_of(&json!({"messages": "not an array"})).is_none());
        assert!(prompt_of(&json!({"messages": []})).is_none());
        assert!(prompt_of(&json!({"prompt": 42})).is_none());
        assert!(prompt_of(&json!({"input": {"x": 1}})).is_none());
    }

    #[test]
    fn the_read_length_bounds_what_is_hashed_not_the_name() {
        let sys = system();
        let long = chat(&[("system", &sys), ("user", "q")]);
        let short_reader = Chunker {
            max_read_bytes: 1000,
            ..CHUNKER
        };
        let text = long.to_string();
        let top: HashMap<String, Box<RawValue>> = serde_json::from_str(&text).unwrap();
        let p = short_reader
            .prompt("tier", Some("m"), |n| {
                top.get(n).map(|v| v.get().as_bytes())
            })
            .unwrap();
        assert!(p.full_bytes > 10_000);
        assert_eq!(p.blocks.len(), 1000 / 64);
        assert_eq!(p.blocks[..], prompt_of(&long).unwrap().blocks[..1000 / 64]);
        assert_eq!(p.anchor, prompt_of(&long).unwrap().anchor);
    }

    #[test]
    fn blocks_straddling_the_parts_of_a_prompt_hash_as_one_string() {
        let whole: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let one = chain(&[&whole], 64, 9, usize::MAX);
        assert_eq!(one.len(), 1000 / 64);
        for cut in [0, 1, 63, 64, 65, 500, 999, 1000] {
            let (a, b) = whole.split_at(cut);
            assert_eq!(chain(&[a, &[], b], 64, 9, usize::MAX), one, "cut at {cut}");
        }
        assert_eq!(chain(&[&whole], 64, 9, 640), one[..10]);
        assert_ne!(chain(&[&whole], 64, 8, usize::MAX), one, "the root keys it");
    }
}
