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

use memchr::memchr2;
use serde_json::value::RawValue;
use xxhash_rust::xxh3::{xxh3_128_with_seed, xxh3_64_with_seed};

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
        field: impl Fn(&str) -> Option<&'a RawValue>,
    ) -> Option<Prompt> {
        let mut canon = Vec::new();
        let mut anchor_end = None;
        let mut tokens_per_byte = 1.0 / TEXT_BYTES_PER_TOKEN;
        if let Some(messages) = field("messages") {
            if let Some(tools) = field("tools") {
                push(&mut canon, tools.get().as_bytes());
            }
            for m in elements(messages.get().as_bytes())? {
                push(&mut canon, m);
                if anchor_end.is_none() && string_field(m, b"role") == Some(b"user") {
                    anchor_end = Some(canon.len());
                }
            }
            // No user message (a system prompt alone): the whole of it.
            anchor_end.get_or_insert(canon.len());
        } else if let Some(input) = field("input") {
            if let Some(instructions) = field("instructions") {
                push(&mut canon, instructions.get().as_bytes());
            }
            let raw = input.get().as_bytes();
            match raw.first() {
                Some(b'[') => {
                    for item in elements(raw)? {
                        push(&mut canon, item);
                        let user = string_field(item, b"role") == Some(b"user");
                        if anchor_end.is_none() && user {
                            anchor_end = Some(canon.len());
                        }
                    }
                    anchor_end.get_or_insert(canon.len());
                }
                // A string input is the user's message.
                Some(b'"') => {
                    push(&mut canon, raw);
                    anchor_end = Some(canon.len());
                }
                _ => return None,
            }
        } else if let Some(prompt) = field("prompt") {
            let raw = prompt.get().as_bytes();
            let open = match raw.first() {
                Some(b'"') | Some(b'[') => &raw[..raw.len() - 1],
                _ => return None,
            };
            if raw.starts_with(b"[") {
                let ids = memchr::memchr_iter(b',', open).count() + 1;
                if !open.contains(&b'"') && !open[1..].contains(&b'[') && open.len() > 1 {
                    // Token ids: count them rather than guess.
                    tokens_per_byte = ids as f64 / open.len() as f64;
                }
            }
            canon.extend_from_slice(open);
        } else {
            return None;
        }
        if canon.is_empty() {
            return None;
        }
        let root = self.root(scope, model);
        let anchor = anchor_end.map(|end| xxh3_128_with_seed(&canon[..end], root));
        let full_bytes = canon.len();
        canon.truncate(self.max_read_bytes);
        let blocks = chain(&canon, self.block_bytes, root);
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

fn push(canon: &mut Vec<u8>, raw: &[u8]) {
    canon.extend_from_slice(raw);
    canon.push(SEPARATOR);
}

/// Chained hashes of `bytes`' full blocks: each block hashed with the
/// previous block's hash as its seed.
pub fn chain(bytes: &[u8], block: usize, root: u64) -> Vec<u64> {
    let mut out = Vec::with_capacity(bytes.len() / block.max(1));
    let mut h = root;
    for b in bytes.chunks_exact(block.max(1)) {
        h = xxh3_64_with_seed(b, h);
        out.push(h);
    }
    out
}

/// The raw elements of a JSON array `raw` (valid JSON, as serde has read
/// it); `None` when `raw` is not an array.
pub fn elements(raw: &[u8]) -> Option<Vec<&[u8]>> {
    let mut i = skip_ws(raw, 0);
    if raw.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(raw, i + 1);
    let mut out = Vec::new();
    while i < raw.len() && raw[i] != b']' {
        let end = skip_value(raw, i)?;
        out.push(&raw[i..end]);
        i = skip_ws(raw, end);
        match raw.get(i) {
            Some(b',') => i = skip_ws(raw, i + 1),
            Some(b']') => {}
            _ => return None,
        }
    }
    Some(out)
}

/// The raw content of the string member `key` of the JSON object `obj`
/// (top level only; escapes left as they are).
pub fn string_field<'a>(obj: &'a [u8], key: &[u8]) -> Option<&'a [u8]> {
    let mut i = skip_ws(obj, 0);
    if obj.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(obj, i);
        if obj.get(i) != Some(&b'"') {
            return None;
        }
        let key_end = skip_string(obj, i)?;
        let name = &obj[i + 1..key_end - 1];
        i = skip_ws(obj, key_end);
        if obj.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(obj, i + 1);
        let end = skip_value(obj, i)?;
        if name == key {
            return (obj[i] == b'"').then(|| &obj[i + 1..end - 1]);
        }
        i = skip_ws(obj, end);
        match obj.get(i) {
            Some(b',') => i += 1,
            _ => return None,
        }
    }
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while i < b.len() && matches!(b[i], b' ' | b'\n' | b'\r' | b'\t') {
        i += 1;
    }
    i
}

/// `b[i]` opens a string: the index just past its closing quote.
fn skip_string(b: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    loop {
        let j = i + memchr2(b'"', b'\\', b.get(i..)?)?;
        if b[j] == b'\\' {
            i = j + 2;
        } else {
            return Some(j + 1);
        }
    }
}

/// The index just past the JSON value that starts at `b[i]`.
fn skip_value(b: &[u8], i: usize) -> Option<usize> {
    match *b.get(i)? {
        b'"' => skip_string(b, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut j = i;
            while j < b.len() {
                match b[j] {
                    b'"' => {
                        j = skip_string(b, j)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(j + 1);
                        }
                    }
                    _ => {}
                }
                j += 1;
            }
            None
        }
        _ => {
            let mut j = i;
            while j < b.len() && !matches!(b[j], b',' | b']' | b'}' | b' ' | b'\n' | b'\r' | b'\t')
            {
                j += 1;
            }
            Some(j)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
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
        CHUNKER.prompt("tier", model, |name| top.get(name).map(|v| &**v))
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
            .prompt("tier", Some("m"), |n| top.get(n).map(|v| &**v))
            .unwrap();
        assert_eq!(p.canon.len(), 1000);
        assert_eq!(p.blocks.len(), 1000 / 64);
        assert_eq!(p.anchor, prompt_of(&long).unwrap().anchor);
    }

    #[test]
    fn the_scanner_splits_arrays_and_finds_fields_through_strings_and_nesting() {
        let raw = br#" [ {"content":"a \"role\": \"user\" ]}","role":"assistant"} , {"x":[1,{"role":"y"}],"role" : "user"}, 3, "s\\", null ] "#;
        let els = elements(raw).unwrap();
        assert_eq!(els.len(), 5);
        assert_eq!(string_field(els[0], b"role"), Some(&b"assistant"[..]));
        assert_eq!(string_field(els[1], b"role"), Some(&b"user"[..]));
        assert_eq!(string_field(els[2], b"role"), None);
        assert_eq!(els[3], br#""s\\""#);
        assert!(elements(b"{}").is_none());
        assert_eq!(elements(b"[]").unwrap().len(), 0);
    }
}
