//! What a request's prompt is, as routing reads it: the canonical prompt cut
//! into fixed-size blocks with chained hashes (what an engine's prefix cache
//! can reuse) and an estimate of its tokens.
//!
//! The canonical prompt is the request's prompt fields as the client sent
//! them, in the order a chat template renders them: the system text, then
//! the tools, then the turns. Each part is its raw JSON, the turns without
//! their closing bracket or quote, so that a later turn, which re-sends the
//! conversation so far and adds to it, has the earlier turn's canonical
//! prompt as a byte prefix:
//!
//! | API | system | tools | turns |
//! |---|---|---|---|
//! | chat completions | the leading `system` / `developer` messages | `tools` | the other `messages` |
//! | Anthropic Messages | `system` | `tools` | `messages` |
//! | Responses | `instructions` | `tools` | `input` (a string, or its items) |
//! | completions | | | `prompt` (text or token ids) |
//!
//! The chain starts from a root keyed by `affinity.hash_key` and scoped by
//! tier, tenant and model: two tenants' prompts never share a block, so
//! nothing one tenant sends can find what another holds.
//!
//! Which conversation a prompt belongs to is [`super::conversation`]'s.

use super::xxh3::hash as block_hash;
use crate::affinity::scan::{each_element, skip_value, skip_ws, string_field};
use std::borrow::Cow;
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed, Xxh3};

/// Separates the parts of the canonical prompt.
const SEPARATOR: u8 = 0x1e;

/// Bytes of text per token (about 4 for English), for estimates before an
/// engine has said how many tokens something was: a prompt, a request body,
/// an answer that reports no usage.
pub const BYTES_PER_TOKEN: u64 = 4;
pub const TEXT_BYTES_PER_TOKEN: f64 = BYTES_PER_TOKEN as f64;

/// The request's prompt as routing reads it.
#[derive(Clone, Debug, Default)]
pub struct Prompt {
    /// The canonical prompt's length (before the read length cut it).
    pub full_bytes: usize,
    /// Chained hash of each full block of what was read: `blocks[i]` names
    /// the whole prefix up to the end of block `i`.
    pub blocks: Vec<u64>,
    /// The seed the chain starts from (the tier, tenant and model it is
    /// cached under).
    pub root: u64,
    /// Estimated prompt tokens per canonical byte.
    pub tokens_per_byte: f64,
}

/// The canonical prompt's bytes, as the parts of the request body they lie
/// in (borrowed while the body is read: nothing is copied).
pub struct Canon<'a> {
    /// Borrowed from the body, or (a part that held markers that change
    /// nothing the engine computes: `cache_control`) without them.
    parts: [Cow<'a, [u8]>; 5],
    /// Bytes of it read (at most `max_read_bytes`).
    len: usize,
    /// Where each of its turns' messages ends (offsets into it, ascending,
    /// within what was read); empty for a prompt without messages. An
    /// earlier turn's prompt ends at one of them.
    pub message_ends: Vec<usize>,
}

impl Canon<'_> {
    /// Bytes of the canonical prompt read.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The hash of bytes `from..to` (within what was read), keyed by
    /// `seed`. Hashed unseeded and the seed mixed in after: a seeded xxh3
    /// derives a secret of its own for every input over 240 bytes.
    pub fn hash(&self, from: usize, to: usize, seed: u64) -> Option<u64> {
        if from > to || to > self.len {
            return None;
        }
        let parts = self.parts.each_ref().map(|p| &**p);
        let mut pieces = span(&parts, from, to);
        let h = match (pieces.next(), pieces.next()) {
            (None, _) => xxh3_64(&[]),
            (Some(one), None) => block_hash(one),
            (Some(a), Some(b)) => {
                let mut h = Xxh3::new();
                h.update(a);
                h.update(b);
                for p in pieces {
                    h.update(p);
                }
                h.digest()
            }
        };
        Some(crate::affinity::hrw::mix(h ^ seed))
    }
}

/// A request body's top-level members, as the prompt is read from them.
pub trait Fields<'a> {
    /// The raw JSON of member `name`.
    fn raw(&self, name: &str) -> Option<&'a [u8]>;

    /// Where each element of the array member `name` ends (offsets into its
    /// raw value), when whoever read the body walked it already.
    fn element_ends(&self, _name: &str) -> Option<&[usize]> {
        None
    }
}

impl<'a, F: Fn(&str) -> Option<&'a [u8]>> Fields<'a> for F {
    fn raw(&self, name: &str) -> Option<&'a [u8]> {
        self(name)
    }
}

impl<'a> Fields<'a> for &crate::affinity::session::BodyProbe<'a> {
    fn raw(&self, name: &str) -> Option<&'a [u8]> {
        crate::affinity::session::BodyProbe::raw(self, name)
    }

    fn element_ends(&self, name: &str) -> Option<&[usize]> {
        crate::affinity::session::BodyProbe::element_ends(self, name)
    }
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

/// The parts of a request's prompt: (system, tools, its turns).
type Parts<'a> = (Option<&'a [u8]>, Option<&'a [u8]>, Turns<'a>);

/// A prompt's turns: their raw JSON without the closing bracket or quote,
/// and for an array of messages, where each message after the system text
/// ends (offsets into those bytes).
struct Turns<'a> {
    raw: &'a [u8],
    ends: Vec<usize>,
}

impl Chunker {
    /// The prompt of a JSON request body whose top level `field` gives
    /// (name → raw value), scoped to `scope` (tier and tenant) and `model`;
    /// `None` when it carries no prompt routing can read. `markers`: the
    /// body is an Anthropic Messages request, whose client moves its
    /// `cache_control` markers from turn to turn: they are left out.
    pub fn prompt<'a>(
        &self,
        scope: &str,
        model: Option<&str>,
        markers: bool,
        fields: impl Fields<'a>,
    ) -> Option<(Prompt, Canon<'a>)> {
        let field = |name: &str| fields.raw(name);
        let mut tokens_per_byte = 1.0 / TEXT_BYTES_PER_TOKEN;
        let (system, tools, turns): Parts<'a> = if let Some(messages) = field("messages") {
            // Anthropic Messages put the system text beside the messages.
            let system = field("system");
            let walked = fields.element_ends("messages");
            let (leading, turns) = messages_of(messages, system.is_none(), walked)?;
            (system.or(leading), field("tools"), turns)
        } else if let Some(input) = field("input") {
            let turns = match input.first() {
                Some(b'[') => messages_of(input, false, fields.element_ends("input"))?.1,
                Some(b'"') => Turns {
                    raw: open(input)?,
                    ends: Vec::new(),
                },
                _ => return None,
            };
            (field("instructions"), field("tools"), turns)
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
            (
                None,
                None,
                Turns {
                    raw: turns,
                    ends: Vec::new(),
                },
            )
        } else {
            return None;
        };
        let Turns {
            raw: turns,
            ends: mut turn_ends,
        } = turns;
        // Nothing but an opening bracket or quote: no prompt.
        if turns.len() <= 1 && system.is_none() && tools.is_none() {
            return None;
        }
        let sep: &[u8] = &[SEPARATOR];
        // Other APIs' bodies are hashed as sent: looking for markers costs
        // a pass over the prompt.
        let strip = |raw: &'a [u8], ends: &mut [usize]| match markers {
            true => unmarked(raw, ends),
            false => Cow::Borrowed(raw),
        };
        let parts: [Cow<'a, [u8]>; 5] = [
            strip(system.unwrap_or(&[]), &mut []),
            Cow::Borrowed(if system.is_some() { sep } else { &[] }),
            strip(tools.unwrap_or(&[]), &mut []),
            Cow::Borrowed(if tools.is_some() { sep } else { &[] }),
            strip(turns, &mut turn_ends),
        ];
        // `sep` is static: the array's lifetime is the body's.
        let root = self.root(scope, model);
        let borrowed = parts.each_ref().map(|p| &**p);
        let full_bytes: usize = borrowed.iter().map(|p| p.len()).sum();
        let len = full_bytes.min(self.max_read_bytes);
        let blocks = chain(&borrowed, self.block_bytes, root, len);
        let turns_at = full_bytes - borrowed[4].len();
        let mut message_ends = turn_ends;
        for end in &mut message_ends {
            *end += turns_at;
        }
        let read = message_ends.partition_point(|&at| at <= len);
        message_ends.truncate(read);
        Some((
            Prompt {
                full_bytes,
                blocks,
                root,
                tokens_per_byte,
            },
            Canon {
                parts,
                len,
                message_ends,
            },
        ))
    }

    /// The hash every prompt's chain starts from: one per (scope, model).
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

/// The member that marks where a client asks an engine to cache (Anthropic's
/// prompt caching, and gateways that pass it on): it changes nothing the
/// engine computes, and a client moves it to its newest message each turn.
const MARKER: &[u8] = b"\"cache_control\"";

/// `raw` without its `"cache_control"` members (and their commas), and
/// `ends` (offsets into it) moved to match; borrowed as it is when it holds
/// none. A turn whose marker moved off it is then the bytes it was, so the
/// next turn's prompt still extends the one before.
fn unmarked<'a>(raw: &'a [u8], ends: &mut [usize]) -> Cow<'a, [u8]> {
    if memchr::memmem::find(raw, MARKER).is_none() {
        return Cow::Borrowed(raw);
    }
    let mut cuts: Vec<(usize, usize)> = Vec::new();
    for at in memchr::memmem::find_iter(raw, MARKER) {
        // A member's key: after `{` or `,`, before `:` (not text that holds it).
        let before = raw[..at].trim_ascii_end();
        let colon = skip_ws(raw, at + MARKER.len());
        if raw.get(colon) != Some(&b':') || !matches!(before.last(), Some(b'{' | b',')) {
            continue;
        }
        let Some(end) = skip_value(raw, skip_ws(raw, colon + 1)) else {
            continue;
        };
        let cut = match before.last() {
            // `, "cache_control": {…}`: from the comma.
            Some(b',') => (before.len() - 1, end),
            // `{"cache_control": {…},`: through the comma after it.
            _ => {
                let next = skip_ws(raw, end);
                match raw.get(next) {
                    Some(b',') => (at, next + 1),
                    _ => (at, end),
                }
            }
        };
        if cuts.last().is_none_or(|&(_, last)| cut.0 >= last) {
            cuts.push(cut);
        }
    }
    if cuts.is_empty() {
        return Cow::Borrowed(raw);
    }
    let mut out = Vec::with_capacity(raw.len());
    let mut from = 0;
    for &(a, b) in &cuts {
        out.extend_from_slice(&raw[from..a]);
        from = b;
    }
    out.extend_from_slice(&raw[from..]);
    for end in ends.iter_mut() {
        let removed: usize = cuts
            .iter()
            .filter(|&&(_, b)| b <= *end)
            .map(|&(a, b)| b - a)
            .sum();
        *end -= removed;
    }
    Cow::Owned(out)
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

/// The JSON array of messages `raw`: with `split`, its leading system (or
/// developer) messages apart (they are the system text); the rest without
/// the closing bracket, with where each of its messages ends. One pass, no
/// decoding; `None` when `raw` is not an array.
fn messages_of<'a>(
    raw: &'a [u8],
    split: bool,
    walked: Option<&[usize]>,
) -> Option<(Option<&'a [u8]>, Turns<'a>)> {
    let mut leading = split;
    let mut system_end = None;
    let mut ends = Vec::new();
    let mut each = |element: &[u8], at: usize| {
        if leading
            && matches!(
                string_field(element, b"role"),
                Some(b"system" | b"developer")
            )
        {
            system_end = Some(at);
        } else {
            leading = false;
            ends.push(at);
        }
    };
    match walked {
        // Walked already (the body's probe): only the leading elements'
        // roles are read again.
        Some(walked) => {
            let mut from = 1;
            for &at in walked {
                let start = skip_ws(raw, from);
                let start = match raw.get(start) {
                    Some(b',') => skip_ws(raw, start + 1),
                    _ => start,
                };
                each(raw.get(start..at)?, at);
                from = at;
            }
        }
        None => each_element(raw, |element, at| {
            each(element, at);
            true
        })?,
    }
    let close = raw.len() - 1;
    Some(match system_end {
        Some(e) => {
            for end in &mut ends {
                *end -= e;
            }
            (
                Some(&raw[1..e]),
                Turns {
                    raw: &raw[e..close],
                    ends,
                },
            )
        }
        None => (
            None,
            Turns {
                raw: &raw[..close],
                ends,
            },
        ),
    })
}

/// Chained hashes of the full blocks of `parts` taken as one byte string
/// (at most `max` bytes of it): each block's hash folded into the previous
/// one's (the first into `root`, which is keyed). xxh3 without a seed: a
/// seed makes it derive a new secret for every block over 240 bytes, which
/// cost more than the hashing itself. Blocks are hashed where they lie; one
/// that straddles two parts is hashed piece by piece (the same hash).
pub fn chain(parts: &[&[u8]], block: usize, root: u64, max: usize) -> Vec<u64> {
    let block = block.max(1);
    let total = parts.iter().map(|p| p.len()).sum::<usize>().min(max);
    let mut out = Vec::with_capacity(total / block);
    let mut h = root;
    let mut fold = |block_hash: u64| {
        h = crate::affinity::hrw::mix(h ^ block_hash).wrapping_add(0x9e37_79b9_7f4a_7c15);
        out.push(h);
    };
    let mut carry = Xxh3::new();
    let mut carried = 0;
    let mut left = total;
    for part in parts {
        let mut p = &part[..part.len().min(left)];
        left -= p.len();
        if carried > 0 {
            let take = (block - carried).min(p.len());
            carry.update(&p[..take]);
            carried += take;
            p = &p[take..];
            if carried == block {
                fold(carry.digest());
                carry.reset();
                carried = 0;
            }
        }
        let whole = p.len() / block * block;
        for b in p[..whole].chunks_exact(block) {
            fold(block_hash(b));
        }
        if whole < p.len() {
            carry.update(&p[whole..]);
            carried += p.len() - whole;
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;
    use serde_json::value::RawValue;
    use std::collections::HashMap;

    pub(crate) const CHUNKER: Chunker = Chunker {
        block_bytes: 64,
        max_read_bytes: 1 << 20,
        seed: 7,
    };

    /// The prompt `chunker` reads from `body`, and its canonical bytes.
    pub(crate) fn read_with(
        chunker: &Chunker,
        scope: &str,
        body: &serde_json::Value,
    ) -> Option<(Prompt, Vec<u8>)> {
        let text = body.to_string();
        let top: HashMap<String, Box<RawValue>> = serde_json::from_str(&text).ok()?;
        let model = body["model"].as_str();
        let (p, canon) = chunker.prompt(scope, model, true, |name: &str| {
            top.get(name).map(|v| v.get().as_bytes())
        })?;
        let parts = canon.parts.each_ref().map(|p| &**p);
        let bytes: Vec<u8> = span(&parts, 0, canon.len).flatten().copied().collect();
        Some((p, bytes))
    }

    fn prompt_of(body: &serde_json::Value) -> Option<Prompt> {
        read_with(&CHUNKER, "tier", body).map(|(p, _)| p)
    }

    fn canon_of(body: &serde_json::Value) -> Vec<u8> {
        read_with(&CHUNKER, "tier", body).unwrap().1
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
    fn a_conversations_blocks_grow_turn_by_turn() {
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
        assert!(t2.blocks.len() > t1.blocks.len());
        assert_eq!(
            t1.blocks[..],
            t2.blocks[..t1.blocks.len()],
            "turn 1 is a prefix of turn 2"
        );
    }

    #[test]
    fn a_shared_system_prompt_is_shared_blocks() {
        let sys = system();
        let a = prompt_of(&chat(&[("system", &sys), ("user", "hi")])).unwrap();
        let b = prompt_of(&chat(&[("system", &sys), ("user", "yo")])).unwrap();
        // They share the system prompt's blocks, which is what a prefix
        // cache can reuse between them, and part ways after it.
        let shared = sys.len() / 64 - 1;
        assert_eq!(a.blocks[..shared], b.blocks[..shared]);
        assert_ne!(a.blocks.last(), b.blocks.last());
    }

    #[test]
    fn the_system_text_comes_first_then_the_tools_then_the_turns() {
        let sys = system();
        let tools = json!([{"type": "function", "function": {"name": "grep"}}]);
        let mut body = chat(&[("system", &sys), ("user", "hi")]);
        body["tools"] = tools.clone();
        let canon = canon_of(&body);
        let sys_json = serde_json::to_vec(&json!({"role": "system", "content": sys})).unwrap();
        let tools_json = serde_json::to_vec(&tools).unwrap();
        assert!(canon.starts_with(&sys_json), "system first");
        let at = sys_json.len() + 1;
        assert_eq!(
            &canon[at..at + tools_json.len()],
            &tools_json[..],
            "then tools"
        );
        assert!(
            canon.ends_with(br#"{"content":"hi","role":"user"}"#),
            "then the turns"
        );
        // A tool list added later shares the system prompt's blocks with the
        // same conversation without tools (as a template renders it).
        let without = prompt_of(&chat(&[("system", &sys), ("user", "hi")])).unwrap();
        let with = prompt_of(&body).unwrap();
        let shared = sys_json.len() / 64;
        assert_eq!(with.blocks[..shared], without.blocks[..shared]);
    }

    #[test]
    fn anthropic_messages_read_their_system_and_tools() {
        let sys = system();
        let turn = |n: usize| {
            let mut msgs = vec![json!({"role": "user", "content": "list the files"})];
            for i in 1..n {
                msgs.push(json!({"role": "assistant", "content": format!("step {i}")}));
                msgs.push(json!({"role": "user", "content": format!("go on {i}")}));
            }
            json!({"model": "claude", "max_tokens": 64, "system": sys,
                   "tools": [{"name": "ls", "input_schema": {"type": "object"}}],
                   "messages": msgs})
        };
        let (t1, canon) = read_with(&CHUNKER, "tier", &turn(1)).unwrap();
        assert!(canon.starts_with(serde_json::to_string(&sys).unwrap().as_bytes()));
        assert!(t1.full_bytes > sys.len());
        let t2 = prompt_of(&turn(2)).unwrap();
        assert_eq!(t1.blocks[..], t2.blocks[..t1.blocks.len()]);
        // The system text as content blocks is read as well.
        let mut blocks = turn(1);
        blocks["system"] = json!([{"type": "text", "text": sys}]);
        assert!(prompt_of(&blocks).unwrap().full_bytes > sys.len());
        // A system prompt alone, with no messages yet, is a prompt too.
        let alone = json!({"model": "claude", "system": sys, "messages": []});
        assert!(prompt_of(&alone).is_some());
    }

    #[test]
    fn the_tier_tenant_and_model_scope_the_chain() {
        let body = chat(&[("system", &system()), ("user", "hi")]);
        let a = prompt_of(&body).unwrap();
        let mut other = body.clone();
        other["model"] = json!("m2");
        assert_ne!(a.blocks[0], prompt_of(&other).unwrap().blocks[0]);
        let (tenant, _) = read_with(&CHUNKER, "tier\u{0}tenant-b", &body).unwrap();
        assert_ne!(
            a.blocks[0], tenant.blocks[0],
            "another tenant, another chain"
        );
        assert_eq!(a.blocks.len(), tenant.blocks.len());
    }

    /// The prompt's length and its message ends, from `text`.
    fn ends_of(text: &str) -> (usize, usize, Vec<usize>) {
        let top: HashMap<String, Box<RawValue>> = serde_json::from_str(text).unwrap();
        let (p, canon) = CHUNKER
            .prompt("tier", Some("m"), false, |name: &str| {
                top.get(name).map(|v| v.get().as_bytes())
            })
            .unwrap();
        (p.full_bytes, canon.len(), canon.message_ends)
    }

    #[test]
    fn the_turns_message_ends_are_where_earlier_prompts_end() {
        let sys = system();
        let t1 = chat(&[("system", &sys), ("user", "hi")]);
        let t2 = chat(&[
            ("system", &sys),
            ("user", "hi"),
            ("assistant", "hello"),
            ("user", "more"),
        ]);
        let (len1, _, ends1) = ends_of(&t1.to_string());
        let (_, len2, ends2) = ends_of(&t2.to_string());
        // The system message is no turn; each message after it ends one.
        assert_eq!(ends1, [len1]);
        assert_eq!(ends2.len(), 3);
        assert_eq!(ends2[0], len1, "turn 1 ends where its message does");
        assert_eq!(*ends2.last().unwrap(), len2);
        assert_eq!(canon_of(&t2)[..len1], canon_of(&t1)[..]);
        // Pretty-printed: a message ends before the whitespace after it.
        let (len, _, ends) = ends_of(&serde_json::to_string_pretty(&t1).unwrap());
        assert_eq!(ends.len(), 1);
        assert!(ends[0] < len);
        // A prompt without messages has none.
        let (_, _, none) = ends_of(&json!({"model": "m", "prompt": "once"}).to_string());
        assert!(none.is_empty());
    }

    #[test]
    fn the_bodys_probe_and_a_plain_reader_read_the_same_prompt() {
        use crate::affinity::session::BodyProbe;
        let sys = system();
        let mut with_tools = chat(&[
            ("system", &sys),
            ("user", "hi"),
            ("assistant", "yo"),
            ("user", "go"),
        ]);
        with_tools["tools"] = json!([{"type": "function", "function": {"name": "grep"}}]);
        for body in [
            with_tools,
            chat(&[("developer", "be brief"), ("system", &sys), ("user", "a")]),
            chat(&[("user", "no system at all"), ("assistant", "fine")]),
            json!({"model": "m", "system": sys, "messages": [{"role": "user", "content": "x"}]}),
            json!({"model": "m", "instructions": "be brief", "input": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
        ] {
            let text = serde_json::to_string_pretty(&body).unwrap();
            let probe = BodyProbe::parse(text.as_bytes()).unwrap();
            let (a, ca) = CHUNKER.prompt("t", Some("m"), false, &probe).unwrap();
            let (b, cb) = CHUNKER
                .prompt("t", Some("m"), false, |f: &str| probe.raw(f))
                .unwrap();
            assert_eq!(a.blocks, b.blocks, "{body}");
            assert_eq!(a.full_bytes, b.full_bytes);
            assert_eq!(ca.message_ends, cb.message_ends, "{body}");
            assert!(!ca.message_ends.is_empty());
        }
    }

    #[test]
    fn a_moving_cache_control_marker_leaves_each_turn_as_it_was() {
        let msg = |role: &str, text: &str, marked: bool| {
            let mut block = json!({"type": "text", "text": text});
            if marked {
                block["cache_control"] = json!({"type": "ephemeral"});
            }
            json!({"role": role, "content": [block]})
        };
        let system = json!([{"type": "text", "text": "Review code. ".repeat(200),
                             "cache_control": {"type": "ephemeral"}}]);
        let turn = |n: usize| {
            let mut messages = Vec::new();
            for t in 0..=n {
                messages.push(msg(
                    "user",
                    &format!("question {t} {}", "x".repeat(300)),
                    t == n,
                ));
                if t < n {
                    messages.push(msg("assistant", &format!("answer {t}"), false));
                }
            }
            json!({"model": "m", "system": system, "messages": messages, "max_tokens": 8})
        };
        let (p1, c1) = read_with(&CHUNKER, "t", &turn(1)).unwrap();
        let (p2, c2) = read_with(&CHUNKER, "t", &turn(2)).unwrap();
        // The marker moved off turn 1's last message: turn 2 still extends it,
        // block for block, and ends one of its messages where turn 1 ended.
        assert!(c2.starts_with(&c1), "{}", String::from_utf8_lossy(&c1));
        assert_eq!(p2.blocks[..p1.blocks.len()], p1.blocks[..]);
        assert!(!String::from_utf8_lossy(&c2).contains("cache_control"));
        let text = turn(1).to_string();
        let probe = crate::affinity::session::BodyProbe::parse(text.as_bytes()).unwrap();
        let (_, canon1) = CHUNKER.prompt("t", Some("m"), true, &probe).unwrap();
        let text2 = turn(2).to_string();
        let probe2 = crate::affinity::session::BodyProbe::parse(text2.as_bytes()).unwrap();
        let (_, canon2) = CHUNKER.prompt("t", Some("m"), true, &probe2).unwrap();
        let end1 = *canon1.message_ends.last().unwrap();
        assert!(
            canon2.message_ends.contains(&end1),
            "{:?} {end1}",
            canon2.message_ends
        );
        // Text that names the member is text: kept.
        let quoted =
            json!({"model": "m", "messages": [msg("user", "set \"cache_control\": {}", false)]});
        assert!(String::from_utf8_lossy(&canon_of(&quoted)).contains("cache_control"));
        // Other APIs' bodies are read as sent.
        let (_, sent) = CHUNKER.prompt("t", Some("m"), false, &probe2).unwrap();
        let sent: Vec<u8> = sent.parts.iter().flat_map(|p| p.iter().copied()).collect();
        assert!(String::from_utf8_lossy(&sent).contains("cache_control"));
    }

    #[test]
    fn token_id_prompts_extend_byte_for_byte_and_count_their_ids() {
        let ids: Vec<u32> = (1000..1400).collect();
        let (t1, c1) =
            read_with(&CHUNKER, "t", &json!({"model": "m", "prompt": &ids[..300]})).unwrap();
        let (t2, c2) =
            read_with(&CHUNKER, "t", &json!({"model": "m", "prompt": &ids[..400]})).unwrap();
        assert_eq!(t1.blocks[..], t2.blocks[..t1.blocks.len()]);
        assert!(c2.starts_with(&c1));
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
    fn the_read_length_bounds_what_is_hashed() {
        let sys = system();
        let long = chat(&[("system", &sys), ("user", "q")]);
        let short_reader = Chunker {
            max_read_bytes: 1000,
            ..CHUNKER
        };
        let (p, canon) = read_with(&short_reader, "tier", &long).unwrap();
        assert!(p.full_bytes > 10_000);
        assert_eq!(canon.len(), 1000);
        assert_eq!(p.blocks.len(), 1000 / 64);
        assert_eq!(p.blocks[..], prompt_of(&long).unwrap().blocks[..1000 / 64]);
    }

    #[test]
    fn blocks_straddling_the_parts_of_a_prompt_hash_as_one_string() {
        let whole: Vec<u8> = (0..1000u32).map(|i| (i % 251) as u8).collect();
        let one = chain(&[&whole], 64, 9, usize::MAX);
        assert_eq!(one.len(), 1000 / 64);
        for cut in [0, 1, 63, 64, 65, 500, 999, 1000] {
            let (a, b) = whole.split_at(cut);
            assert_eq!(chain(&[a, &[], b], 64, 9, usize::MAX), one, "cut at {cut}");
            let canon = Canon {
                parts: [a, &[], b, &[], &[]].map(Cow::Borrowed),
                len: 1000,
                message_ends: Vec::new(),
            };
            let want = crate::affinity::hrw::mix(xxh3_64(&whole[60..700]) ^ 3);
            assert_eq!(canon.hash(60, 700, 3), Some(want), "cut at {cut}");
        }
        assert_eq!(chain(&[&whole], 64, 9, 640), one[..10]);
        assert_ne!(chain(&[&whole], 64, 8, usize::MAX), one, "the root keys it");
    }
}
