//! Response-side work: merging the `x_agent_serve` object into JSON bodies as
//! they stream through, and reading `usage` from JSON and SSE responses.

use bytes::{Bytes, BytesMut};
use serde::Deserialize;

/// Appends one member to a JSON object body while streaming it.
///
/// The headers leave before the body arrives, so the new `Content-Length`
/// is promised up front: exactly `extra_len()` bytes are added, whatever the
/// body turns out to be. Only the final `}` (and trailing whitespace) is ever
/// held back, so the body otherwise streams unbuffered. A body that is not a
/// JSON object gets the promised bytes as trailing spaces instead, which keeps
/// any JSON value it holds unchanged.
pub struct JsonAppender {
    /// `"x_agent_serve":{...}`
    member: Vec<u8>,
    held: BytesMut,
    /// First non-whitespace byte of the body, once seen.
    first: Option<u8>,
    /// Whether the object has any member before ours.
    has_members: bool,
    finished: bool,
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\r' | b'\n')
}

impl JsonAppender {
    pub fn new(member: Vec<u8>) -> Self {
        JsonAppender {
            member,
            held: BytesMut::new(),
            first: None,
            has_members: false,
            finished: false,
        }
    }

    /// Bytes added to the body: a separator (`,` or a space) plus the member.
    pub fn extra_len(&self) -> usize {
        1 + self.member.len()
    }

    /// Feed one chunk; returns what may be sent now (a slice of the chunk
    /// itself in the common case: nothing is held back yet).
    pub fn push(&mut self, chunk: Bytes) -> Bytes {
        if self.held.is_empty() {
            let Some(last) = chunk.iter().rposition(|&b| !is_ws(b)) else {
                self.held.extend_from_slice(&chunk);
                return Bytes::new();
            };
            let split = if chunk[last] == b'}' {
                last
            } else {
                chunk.len()
            };
            self.held.extend_from_slice(&chunk[split..]);
            let out = chunk.slice(..split);
            self.note_emitted(&out);
            return out;
        }
        let mut buf = std::mem::take(&mut self.held);
        buf.extend_from_slice(&chunk);
        let Some(last) = buf.iter().rposition(|&b| !is_ws(b)) else {
            // Only whitespace so far: hold it (it may precede the closing brace).
            self.held = buf;
            return Bytes::new();
        };
        let split = if buf[last] == b'}' { last } else { buf.len() };
        self.note_emitted(&buf[..split]);
        let tail = buf.split_off(split);
        self.held = tail;
        buf.freeze()
    }

    fn note_emitted(&mut self, out: &[u8]) {
        for &b in out {
            if is_ws(b) {
                continue;
            }
            if self.first.is_none() {
                self.first = Some(b);
            } else {
                self.has_members = true;
                return;
            }
        }
    }

    /// The end of the body: returns the held tail with the member merged in.
    /// Later calls return nothing.
    pub fn finish(&mut self) -> Bytes {
        if self.finished {
            return Bytes::new();
        }
        self.finished = true;
        let held = std::mem::take(&mut self.held);
        let mut out = BytesMut::with_capacity(held.len() + self.extra_len());
        let closes_object = self.first == Some(b'{') && held.first() == Some(&b'}');
        if closes_object {
            out.extend_from_slice(if self.has_members { b"," } else { b" " });
            out.extend_from_slice(&self.member);
            out.extend_from_slice(&held);
        } else {
            out.extend_from_slice(&held);
            out.resize(out.len() + self.extra_len(), b' ');
        }
        out.freeze()
    }
}

/// Token counts from a response's `usage` object.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// The whole prompt, cached part included.
    pub prompt_tokens: u64,
    /// Prompt tokens the engine found in its prefix cache; `None` when it
    /// does not say (vLLM without `--enable-prompt-tokens-details`, SGLang
    /// without `--enable-cache-report`): not the same as none cached.
    pub cached_tokens: Option<u64>,
    /// Tokens generated (0 when not said).
    pub completion_tokens: u64,
}

/// `usage` in the three shapes engines answer with: chat and completions
/// (`prompt_tokens`, `prompt_tokens_details.cached_tokens`), Responses
/// (`input_tokens`, `input_tokens_details.cached_tokens`) and Anthropic
/// Messages (`input_tokens` without the cache, `cache_read_input_tokens`,
/// `cache_creation_input_tokens`).
#[derive(Deserialize)]
struct UsageJson {
    prompt_tokens: Option<u64>,
    prompt_tokens_details: Option<DetailsJson>,
    completion_tokens: Option<u64>,
    input_tokens: Option<u64>,
    input_tokens_details: Option<DetailsJson>,
    output_tokens: Option<u64>,
    cache_read_input_tokens: Option<u64>,
    cache_creation_input_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct DetailsJson {
    cached_tokens: Option<u64>,
}

impl UsageJson {
    fn usage(self) -> Option<Usage> {
        let details = |d: Option<DetailsJson>| d.and_then(|d| d.cached_tokens);
        if let Some(prompt) = self.prompt_tokens {
            return Some(Usage {
                prompt_tokens: prompt,
                cached_tokens: details(self.prompt_tokens_details),
                completion_tokens: self.completion_tokens.unwrap_or(0),
            });
        }
        let input = self.input_tokens?;
        let output = self.output_tokens.unwrap_or(0);
        if self.cache_read_input_tokens.is_some() || self.cache_creation_input_tokens.is_some() {
            // Anthropic counts the cached and the newly cached apart.
            let read = self.cache_read_input_tokens.unwrap_or(0);
            let created = self.cache_creation_input_tokens.unwrap_or(0);
            return Some(Usage {
                prompt_tokens: input + read + created,
                cached_tokens: self.cache_read_input_tokens,
                completion_tokens: output,
            });
        }
        Some(Usage {
            prompt_tokens: input,
            cached_tokens: details(self.input_tokens_details),
            completion_tokens: output,
        })
    }
}

/// Keeps the last bytes of a response so `usage` (at the end of a JSON body,
/// or in the final SSE event) can be read without buffering the response.
#[derive(Default)]
pub struct UsageScanner {
    tail: Vec<u8>,
}

/// At least this much of the response's end is kept; at most twice as much.
pub const USAGE_TAIL_BYTES: usize = 16 * 1024;

impl UsageScanner {
    /// Add a chunk of the response. The kept tail is cut back to
    /// `USAGE_TAIL_BYTES` only when it would pass twice that, so a long stream
    /// of small SSE chunks moves each byte at most once (cutting on every
    /// chunk moved up to 16 KB per chunk).
    pub fn push(&mut self, chunk: &[u8]) {
        if chunk.len() >= USAGE_TAIL_BYTES {
            self.tail.clear();
            self.tail
                .extend_from_slice(&chunk[chunk.len() - USAGE_TAIL_BYTES..]);
            return;
        }
        if self.tail.len() + chunk.len() > 2 * USAGE_TAIL_BYTES {
            let keep = USAGE_TAIL_BYTES - chunk.len();
            self.tail.drain(..self.tail.len() - keep);
        }
        self.tail.extend_from_slice(chunk);
    }

    /// How much of the response is kept (for tests: bounded by twice the window).
    pub fn kept(&self) -> usize {
        self.tail.len()
    }

    /// The last non-null `usage` object seen, if any. An Anthropic stream
    /// counts its input in `message_start` and its output at the end, in
    /// `message_delta` (`output_tokens` alone): the later output count wins.
    pub fn usage(&self) -> Option<Usage> {
        usage_in(&self.tail)
    }
}

/// The last non-null `usage` object in `bytes` (see [`UsageScanner::usage`]).
pub fn usage_in(bytes: &[u8]) -> Option<Usage> {
    const NEEDLE: &[u8] = b"\"usage\"";
    let mut end = bytes.len();
    let mut output_after = None;
    while let Some(pos) = memchr::memmem::rfind(&bytes[..end], NEEDLE) {
        let rest = &bytes[pos + NEEDLE.len()..];
        let rest = trim_start(rest);
        if let Some(after_colon) = rest.strip_prefix(b":") {
            let mut it = serde_json::Deserializer::from_slice(trim_start(after_colon))
                .into_iter::<UsageJson>();
            if let Some(json) = it.next().and_then(Result::ok) {
                let output = json.output_tokens;
                if let Some(mut usage) = json.usage() {
                    if let Some(later) = output_after {
                        usage.completion_tokens = later;
                    }
                    return Some(usage);
                }
                output_after = output_after.or(output);
            }
        }
        end = pos;
    }
    None
}

/// Reads a Responses answer's id from its start: a JSON body's top-level
/// `id` (its first member in every engine's answer), or in a stream the
/// `response.created` event's `response.id` — the first `"id"` either way.
/// Only the first [`RESPONSE_ID_HEAD_BYTES`] are looked at.
#[derive(Default)]
pub struct ResponseIdScanner {
    head: Vec<u8>,
    done: bool,
}

pub const RESPONSE_ID_HEAD_BYTES: usize = 4096;

impl ResponseIdScanner {
    /// It found the id, or gave up looking.
    pub fn done(&self) -> bool {
        self.done
    }

    /// Add a chunk; returns the id once it has arrived whole (once only).
    pub fn push(&mut self, chunk: &[u8]) -> Option<String> {
        if self.done {
            return None;
        }
        let room = RESPONSE_ID_HEAD_BYTES.saturating_sub(self.head.len());
        self.head.extend_from_slice(&chunk[..chunk.len().min(room)]);
        let found = Self::find(&self.head);
        if found.is_some() || self.head.len() >= RESPONSE_ID_HEAD_BYTES {
            self.done = true;
            self.head = Vec::new();
        }
        found
    }

    fn find(head: &[u8]) -> Option<String> {
        const NEEDLE: &[u8] = b"\"id\"";
        let pos = memchr::memmem::find(head, NEEDLE)?;
        let rest = trim_start(&head[pos + NEEDLE.len()..]);
        let rest = trim_start(rest.strip_prefix(b":")?);
        let value = rest.strip_prefix(b"\"")?;
        // Ids are plain: letters, digits, `_` and `-`; anything else (an
        // escape, a quote not yet arrived) is not taken.
        let end = memchr::memchr(b'"', value)?;
        let id = &value[..end];
        (!id.is_empty()
            && id.len() <= 256
            && id
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':')))
        .then(|| String::from_utf8_lossy(id).into_owned())
    }
}

/// Rewrites ids in an answer as it passes: each `"<from>"` (quoted, whole)
/// becomes `"<to>"`. The end of a chunk that could begin one is held until
/// the next chunk shows whether it does (an event stream's chunks end where
/// its events do, so nothing of a whole event waits); and while an id to
/// rewrite is still unknown ([`IdRewriter::waiting`]), everything is held.
#[derive(Default)]
pub struct IdRewriter {
    /// Quoted ids and their replacements.
    pairs: Vec<(Vec<u8>, Vec<u8>)>,
    held: Vec<u8>,
    waiting: bool,
}

/// What an answer is held for at most while an id is awaited: the
/// response's id comes at its start ([`RESPONSE_ID_HEAD_BYTES`]).
const WAIT_AT_MOST: usize = RESPONSE_ID_HEAD_BYTES;

impl IdRewriter {
    /// `waiting`: hold the answer until [`IdRewriter::add`] or
    /// [`IdRewriter::ready`] says the ids are known.
    pub fn new(waiting: bool) -> Self {
        IdRewriter {
            waiting,
            ..Default::default()
        }
    }

    /// Rewrite `from` to `to` from here on (and in what is held).
    pub fn add(&mut self, from: &str, to: &str) {
        let quote = |s: &str| [b"\"", s.as_bytes(), b"\""].concat();
        self.pairs.push((quote(from), quote(to)));
    }

    /// The ids are known: stop holding the answer back.
    pub fn ready(&mut self) {
        self.waiting = false;
    }

    /// Whether it holds the answer back until the ids are known.
    pub fn waiting(&self) -> bool {
        self.waiting
    }

    /// The next chunk, rewritten; `end`: the answer ends with it.
    pub fn push(&mut self, chunk: &[u8], end: bool) -> Bytes {
        if self.waiting && self.held.len() + chunk.len() < WAIT_AT_MOST && !end {
            self.held.extend_from_slice(chunk);
            return Bytes::new();
        }
        self.waiting = false;
        let mut data = std::mem::take(&mut self.held);
        data.extend_from_slice(chunk);
        let mut out = Vec::with_capacity(data.len() + 64);
        let mut at = 0;
        while let Some((pos, i)) = self.next_match(&data[at..]) {
            out.extend_from_slice(&data[at..at + pos]);
            out.extend_from_slice(&self.pairs[i].1);
            at += pos + self.pairs[i].0.len();
        }
        let keep = match end {
            true => 0,
            false => self.partial(&data[at..]),
        };
        out.extend_from_slice(&data[at..data.len() - keep]);
        self.held.extend_from_slice(&data[data.len() - keep..]);
        Bytes::from(out)
    }

    /// The first whole id of `data` to rewrite: where, and which.
    fn next_match(&self, data: &[u8]) -> Option<(usize, usize)> {
        self.pairs
            .iter()
            .enumerate()
            .filter_map(|(i, (from, _))| Some((memchr::memmem::find(data, from)?, i)))
            .min()
    }

    /// How much of `data`'s end could begin an id to rewrite.
    fn partial(&self, data: &[u8]) -> usize {
        let longest = self.pairs.iter().map(|(f, _)| f.len()).max().unwrap_or(0);
        (1..longest.min(data.len() + 1))
            .rev()
            .find(|&k| {
                let tail = &data[data.len() - k..];
                self.pairs.iter().any(|(f, _)| f.starts_with(tail))
            })
            .unwrap_or(0)
    }
}

fn trim_start(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|&&c| is_ws(c)).count();
    &b[n..]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_rewritten_across_chunks_and_only_whole() {
        let answer = b"data: {\"response\":{\"id\":\"resp_e1\",\"previous_response_id\":\"resp_e0\"}}\n\ndata: {\"item_id\":\"resp_e10\",\"response\":{\"id\":\"resp_e1\"}}\n\n";
        let want = answer
            .to_vec()
            .iter()
            .map(|&b| b as char)
            .collect::<String>()
            .replace("\"resp_e1\"", "\"resp_GW1\"")
            .replace("\"resp_e0\"", "\"resp_GW0\"");
        // Whole, and cut at every place.
        for cut in 0..answer.len() {
            let mut r = IdRewriter::new(false);
            r.add("resp_e1", "resp_GW1");
            r.add("resp_e0", "resp_GW0");
            let mut out = r.push(&answer[..cut], false).to_vec();
            out.extend_from_slice(&r.push(&answer[cut..], true));
            assert_eq!(String::from_utf8(out).unwrap(), want, "cut at {cut}");
        }
    }

    #[test]
    fn an_answer_waits_for_its_id_then_flows() {
        let mut r = IdRewriter::new(true);
        assert!(r.push(b"{\"id\":\"resp_e", false).is_empty(), "held");
        r.add("resp_e1", "resp_G");
        r.ready();
        let mut out = r.push(b"1\",\"x\":1", false).to_vec();
        out.extend_from_slice(&r.push(b"}", true));
        assert_eq!(out, b"{\"id\":\"resp_G\",\"x\":1}");
        // An event that ends a chunk is not held.
        let mut r = IdRewriter::new(false);
        r.add("resp_e1", "resp_G");
        assert_eq!(&r.push(b"data: {}\n\n", false)[..], b"data: {}\n\n");
    }

    #[test]
    fn an_anthropic_stream_counts_its_input_at_the_start_and_its_output_at_the_end() {
        let mut s = UsageScanner::default();
        s.push(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"usage\":{\"input_tokens\":12,\"cache_read_input_tokens\":300,\"output_tokens\":1}}}\n\n");
        s.push(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\n");
        s.push(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":42}}\n\n");
        assert_eq!(
            s.usage(),
            Some(Usage {
                prompt_tokens: 312,
                cached_tokens: Some(300),
                completion_tokens: 42,
            })
        );
    }

    #[test]
    fn a_responses_answer_names_its_id_in_json_and_in_a_stream() {
        let json = br#"{"id": "resp_0a1b", "object":"response","output":[{"id":"msg_9"}]}"#;
        let sse = b"event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_77\",\"object\":\"response\"}}\n\n";
        for (body, want) in [(&json[..], "resp_0a1b"), (&sse[..], "resp_77")] {
            // Whole, and a byte at a time: the id is taken once it is whole.
            let mut s = ResponseIdScanner::default();
            assert_eq!(s.push(body).as_deref(), Some(want));
            assert_eq!(s.push(body), None, "once only");
            let mut s = ResponseIdScanner::default();
            let found: Vec<String> = body.iter().filter_map(|b| s.push(&[*b])).collect();
            assert_eq!(found, [want]);
        }
        // No id in the head: nothing, and the head is let go.
        let mut s = ResponseIdScanner::default();
        assert_eq!(s.push(&vec![b' '; RESPONSE_ID_HEAD_BYTES + 10]), None);
        assert_eq!(s.push(br#"{"id":"resp_late"}"#), None);
        let mut s = ResponseIdScanner::default();
        assert_eq!(s.push(br#"{"id":"resp\u0041"}"#), None, "not a plain id");
    }

    fn run(body: &[&str]) -> (String, usize) {
        let mut a = JsonAppender::new(br#""x":{"a":1}"#.to_vec());
        let mut out = Vec::new();
        for c in body {
            out.extend_from_slice(&a.push(Bytes::copy_from_slice(c.as_bytes())));
        }
        out.extend_from_slice(&a.finish());
        let original: usize = body.iter().map(|c| c.len()).sum();
        assert_eq!(out.len(), original + a.extra_len(), "promised length kept");
        (String::from_utf8(out).unwrap(), a.extra_len())
    }

    #[test]
    fn appends_member_across_chunk_boundaries() {
        let (out, _) = run(&[r#"{"id":"1","#, r#""usage":{"prompt_tokens":3}"#, "}\n"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["x"]["a"], 1);
        assert_eq!(v["usage"]["prompt_tokens"], 3);
        let (out, _) = run(&["{\"k\":[1,2]", "}", "  "]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["k"][1], 2);
        assert_eq!(v["x"]["a"], 1);
    }

    #[test]
    fn empty_object_and_non_objects() {
        let (out, _) = run(&["{", "}"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["x"]["a"], 1);
        let (out, _) = run(&["[1,", "2]"]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v, serde_json::json!([1, 2]));
        let (out, _) = run(&["not json"]);
        assert!(out.starts_with("not json"));
    }

    #[test]
    fn streams_everything_but_the_closing_brace() {
        let mut a = JsonAppender::new(b"\"x\":1".to_vec());
        assert_eq!(
            &a.push(Bytes::from_static(b"{\"a\":\"}\""))[..],
            b"{\"a\":\"}\""
        );
        assert_eq!(&a.push(Bytes::from_static(b"}"))[..], b"");
        assert_eq!(&a.finish()[..], b",\"x\":1}");
        assert!(a.finish().is_empty(), "finishing twice adds nothing");
    }

    #[test]
    fn a_long_stream_keeps_a_bounded_window_with_its_usage() {
        let mut s = UsageScanner::default();
        let event = format!(
            "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
            "x".repeat(90)
        );
        let mut sent = 0;
        for _ in 0..2_000 {
            s.push(event.as_bytes());
            sent += event.len();
            // Never less than the window (or all of it), never more than twice it.
            assert!(
                s.kept() >= sent.min(USAGE_TAIL_BYTES),
                "{} of {sent}",
                s.kept()
            );
            assert!(s.kept() <= 2 * USAGE_TAIL_BYTES, "{}", s.kept());
        }
        // The final event's usage, split across two chunks.
        s.push(b"data: {\"choices\":[],\"usage\":{\"prompt_");
        s.push(b"tokens\":4096,\"prompt_tokens_details\":{\"cached_tokens\":4000}}}\n\ndata: [DONE]\n\n");
        assert_eq!(
            s.usage(),
            Some(Usage {
                prompt_tokens: 4096,
                cached_tokens: Some(4000),
                completion_tokens: 0
            })
        );
    }

    #[test]
    fn usage_from_json_and_sse() {
        let mut s = UsageScanner::default();
        s.push(br#"{"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":64}}}"#);
        assert_eq!(
            s.usage(),
            Some(Usage {
                prompt_tokens: 100,
                cached_tokens: Some(64),
                completion_tokens: 5
            })
        );
        let mut s = UsageScanner::default();
        s.push(b"data: {\"choices\":[{\"delta\":{}}],\"usage\":null}\n\n");
        s.push(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7}}\n\ndata: [DONE]\n\n");
        assert_eq!(
            s.usage(),
            Some(Usage {
                prompt_tokens: 7,
                cached_tokens: None,
                completion_tokens: 0
            })
        );
        let mut s = UsageScanner::default();
        s.push(b"data: {\"usage\":null}\n\n");
        assert_eq!(s.usage(), None);
        let mut s = UsageScanner::default();
        s.push(&vec![b'a'; 100_000]);
        s.push(br#","usage":{"prompt_tokens":1}}"#);
        assert_eq!(s.usage().unwrap().prompt_tokens, 1);
    }

    #[test]
    fn responses_and_anthropic_usage_are_read_too() {
        let read = |body: &[u8]| {
            let mut s = UsageScanner::default();
            s.push(body);
            s.usage()
        };
        // Responses, JSON and the stream's `response.completed`.
        let responses = br#"{"id":"resp_1","output":[],"usage":{"input_tokens":900,"input_tokens_details":{"cached_tokens":768},"output_tokens":12,"total_tokens":912}}"#;
        let want = Some(Usage {
            prompt_tokens: 900,
            cached_tokens: Some(768),
            completion_tokens: 12,
        });
        assert_eq!(read(responses), want);
        let event = [
            &b"event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":"[..],
            responses,
            b"}\n\n",
        ]
        .concat();
        assert_eq!(read(&event), want);
        // Anthropic: the prompt is what was read from the cache, written to
        // it and neither.
        let anthropic = br#"{"type":"message","usage":{"input_tokens":40,"cache_creation_input_tokens":100,"cache_read_input_tokens":860,"output_tokens":9}}"#;
        assert_eq!(
            read(anthropic),
            Some(Usage {
                prompt_tokens: 1000,
                cached_tokens: Some(860),
                completion_tokens: 9
            })
        );
        // An engine's Anthropic endpoint that reports no cache.
        assert_eq!(
            read(br#"{"usage":{"input_tokens":30,"output_tokens":2}}"#),
            Some(Usage {
                prompt_tokens: 30,
                cached_tokens: None,
                completion_tokens: 2
            })
        );
    }
}
