//! WebSocket upgrades: `/v1/responses` in OpenAI's WebSocket mode, where one
//! socket carries many turns. Pingora passes the upgraded bytes through; the
//! upgrade request is routed like a turn of its session (its headers are all
//! routing sees). Once the backend switched protocols, the gateway reads the
//! frames going by, without holding any of them back:
//! - each message the client sends is held to `server.max_body_bytes` (the
//!   socket as a whole is not: it lives across many turns);
//! - each message the backend sends that carries `usage` adds to the
//!   socket's usage, which the request's end counts and charges as it does
//!   one answer's;
//! - a `response.created` event's id is learned, as a JSON answer's is, so a
//!   follow-up over HTTP finds the replica that stored it; or, where the
//!   gateway issues response ids (`affinity.response_ids: gateway`), the
//!   engine's ids are rewritten to the gateway's in the backend's messages,
//!   and a client message's `previous_response_id` back to the engine's
//!   ([`Rewrite`]: each whole text frame is held until it is complete,
//!   then sent rewritten; every other frame passes as it comes).

use super::response::{usage_in, ResponseIdScanner, Usage};

/// A backend message larger than this is passed on unread.
const READ_AT_MOST: usize = 1 << 20;

/// Where one direction of a socket is, frame by frame.
#[derive(Default)]
struct Frames {
    /// The frame header being read (2 to 14 bytes).
    head: [u8; 14],
    head_len: usize,
    /// Payload bytes of the current frame still to come.
    remaining: u64,
    in_payload: bool,
    /// The current frame: its mask and offset, whether it ends its message,
    /// whether it is a control frame (not part of any message).
    mask: Option<[u8; 4]>,
    offset: usize,
    fin: bool,
    control: bool,
    /// The current message: its length so far, and its bytes when read.
    message_len: u64,
    reading: bool,
    message: Vec<u8>,
}

/// How long a frame header whose first two bytes are `head` is.
fn header_len(head: &[u8]) -> usize {
    let len = match head[1] & 0x7f {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    2 + len + if head[1] & 0x80 != 0 { 4 } else { 0 }
}

impl Frames {
    /// Follow `chunk`; `read` says whether text messages are gathered and
    /// handed to `message` whole. `Err` with a message's length once it
    /// passes `limit`.
    fn push(
        &mut self,
        mut chunk: &[u8],
        read: bool,
        limit: u64,
        message: &mut impl FnMut(&[u8]),
    ) -> Result<(), u64> {
        while !chunk.is_empty() {
            if !self.in_payload {
                let need = if self.head_len < 2 {
                    2
                } else {
                    header_len(&self.head)
                };
                let take = (need - self.head_len).min(chunk.len());
                self.head[self.head_len..self.head_len + take].copy_from_slice(&chunk[..take]);
                self.head_len += take;
                chunk = &chunk[take..];
                if self.head_len < 2 || self.head_len < header_len(&self.head) {
                    continue;
                }
                self.start_frame(read, limit)?;
                if self.remaining == 0 {
                    self.end_frame(message);
                }
                continue;
            }
            let n = (self.remaining.min(chunk.len() as u64)) as usize;
            let (part, rest) = chunk.split_at(n);
            if self.reading && !self.control {
                if self.message.len() + n <= READ_AT_MOST {
                    let mask = self.mask.unwrap_or_default();
                    let at = self.offset;
                    self.message
                        .extend(part.iter().enumerate().map(|(i, b)| b ^ mask[(at + i) % 4]));
                } else {
                    self.reading = false;
                    self.message = Vec::new();
                }
            }
            self.offset += n;
            self.remaining -= n as u64;
            chunk = rest;
            if self.remaining == 0 {
                self.end_frame(message);
            }
        }
        Ok(())
    }

    fn start_frame(&mut self, read: bool, limit: u64) -> Result<(), u64> {
        let h = &self.head[..self.head_len];
        let opcode = h[0] & 0x0f;
        let (len, at) = match h[1] & 0x7f {
            126 => (u16::from_be_bytes([h[2], h[3]]) as u64, 4),
            127 => (
                u64::from_be_bytes(h[2..10].try_into().expect("8 bytes")),
                10,
            ),
            n => (n as u64, 2),
        };
        self.mask = (h[1] & 0x80 != 0).then(|| h[at..at + 4].try_into().expect("4 bytes"));
        self.fin = h[0] & 0x80 != 0;
        self.control = opcode >= 8;
        self.remaining = len;
        self.offset = 0;
        self.in_payload = true;
        self.head_len = 0;
        if !self.control {
            if opcode != 0 {
                // A new message (text or binary); 0 continues the last.
                self.message_len = 0;
                self.message.clear();
                self.reading = read && opcode == 1;
            }
            self.message_len = self.message_len.saturating_add(len);
            if self.message_len > limit {
                return Err(self.message_len);
            }
        }
        Ok(())
    }

    fn end_frame(&mut self, message: &mut impl FnMut(&[u8])) {
        self.in_payload = false;
        if !self.control && self.fin {
            if self.reading {
                message(&self.message);
            }
            self.message.clear();
            self.reading = false;
        }
    }
}

/// Whether message `m` is an event of type `name` (quoted): its `"type"`
/// member says so, not some text that happens to hold the name.
fn is_event(m: &[u8], name: &[u8]) -> bool {
    memchr::memmem::find_iter(m, name).any(|at| {
        let before = m[..at].trim_ascii_end();
        before
            .strip_suffix(b":")
            .is_some_and(|b| b.trim_ascii_end().ends_with(b"\"type\""))
    })
}

/// One direction of a socket whose messages' ids are rewritten: a text
/// frame that is a whole message (at most [`READ_AT_MOST`]) is held until
/// it is complete, then sent with `edit` applied to its payload (the frame
/// re-framed with its new length and masked with its own key); any other
/// frame passes as it comes.
#[derive(Default)]
struct Rewrite {
    head: [u8; 14],
    head_len: usize,
    in_payload: bool,
    remaining: u64,
    /// The current frame is held whole (a text message) and this is it so
    /// far: its first header byte, its mask, its payload as received.
    hold: Option<(u8, Option<[u8; 4]>)>,
    payload: Vec<u8>,
}

impl Rewrite {
    /// `chunk`, as it goes on.
    fn push(&mut self, mut chunk: &[u8], edit: &mut impl FnMut(&mut Vec<u8>)) -> Vec<u8> {
        let mut out = Vec::with_capacity(chunk.len());
        while !chunk.is_empty() {
            if !self.in_payload {
                let need = if self.head_len < 2 {
                    2
                } else {
                    header_len(&self.head)
                };
                let take = (need - self.head_len).min(chunk.len());
                self.head[self.head_len..self.head_len + take].copy_from_slice(&chunk[..take]);
                self.head_len += take;
                chunk = &chunk[take..];
                if self.head_len < 2 || self.head_len < header_len(&self.head) {
                    continue;
                }
                self.start_frame(&mut out);
                if self.remaining == 0 {
                    self.end_frame(&mut out, edit);
                }
                continue;
            }
            let n = self.remaining.min(chunk.len() as u64) as usize;
            let (part, rest) = chunk.split_at(n);
            match self.hold {
                Some(_) => self.payload.extend_from_slice(part),
                None => out.extend_from_slice(part),
            }
            self.remaining -= n as u64;
            chunk = rest;
            if self.remaining == 0 {
                self.end_frame(&mut out, edit);
            }
        }
        out
    }

    fn start_frame(&mut self, out: &mut Vec<u8>) {
        let h = &self.head[..self.head_len];
        let (len, at) = match h[1] & 0x7f {
            126 => (u16::from_be_bytes([h[2], h[3]]) as u64, 4),
            127 => (
                u64::from_be_bytes(h[2..10].try_into().expect("8 bytes")),
                10,
            ),
            n => (n as u64, 2),
        };
        let mask = (h[1] & 0x80 != 0).then(|| h[at..at + 4].try_into().expect("4 bytes"));
        // A whole text message (FIN, opcode 1) small enough to hold.
        let whole_text = h[0] & 0x8f == 0x81 && len <= READ_AT_MOST as u64;
        self.hold = whole_text.then_some((h[0], mask));
        if self.hold.is_none() {
            out.extend_from_slice(h);
        }
        self.remaining = len;
        self.in_payload = true;
        self.head_len = 0;
    }

    fn end_frame(&mut self, out: &mut Vec<u8>, edit: &mut impl FnMut(&mut Vec<u8>)) {
        self.in_payload = false;
        let Some((first, mask)) = self.hold.take() else {
            return;
        };
        let mut payload = std::mem::take(&mut self.payload);
        let key = mask.unwrap_or_default();
        let unmask = |p: &mut Vec<u8>| p.iter_mut().enumerate().for_each(|(i, b)| *b ^= key[i % 4]);
        unmask(&mut payload);
        edit(&mut payload);
        unmask(&mut payload);
        out.push(first);
        let bit = if mask.is_some() { 0x80 } else { 0 };
        match payload.len() {
            n @ 0..=125 => out.push(bit | n as u8),
            n @ 126..=0xffff => {
                out.push(bit | 126);
                out.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                out.push(bit | 127);
                out.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        if let Some(m) = mask {
            out.extend_from_slice(&m);
        }
        out.extend_from_slice(&payload);
    }
}

/// Each quoted `"<from>"` of `message` as `"<to>"`.
fn replace_ids(message: &mut Vec<u8>, pairs: &[(String, String)]) {
    for (from, to) in pairs {
        let (from, to) = (format!("\"{from}\""), format!("\"{to}\""));
        if memchr::memmem::find(message, from.as_bytes()).is_none() {
            continue;
        }
        let mut out = Vec::with_capacity(message.len() + 64);
        let mut at = 0;
        for pos in memchr::memmem::find_iter(message, from.as_bytes()) {
            if pos < at {
                continue;
            }
            out.extend_from_slice(&message[at..pos]);
            out.extend_from_slice(to.as_bytes());
            at = pos + from.len();
        }
        out.extend_from_slice(&message[at..]);
        *message = out;
    }
}

/// The string value of the member `name` in a JSON message, where it is a
/// plain one (no escapes).
fn string_member<'m>(m: &'m [u8], name: &[u8]) -> Option<&'m str> {
    memchr::memmem::find_iter(m, name).find_map(|at| {
        let rest = m[at + name.len()..].trim_ascii_start().strip_prefix(b":")?;
        let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
        let end = memchr::memchr2(b'"', b'\\', rest)?;
        (rest[end] == b'"').then(|| std::str::from_utf8(&rest[..end]).ok())?
    })
}

/// The (engine's, gateway's) id pairs a socket remembers at most: its
/// recent responses.
const PAIRS_KEPT: usize = 64;

/// An upgraded request's socket, as far as the gateway follows it.
#[derive(Default)]
pub(super) struct WebSocket {
    sent: Frames,
    received: Frames,
    /// What the backend's messages reported, added up.
    pub usage: Option<Usage>,
    /// Where the gateway issues response ids: each direction, rewritten,
    /// and the (engine's, gateway's) ids of the socket's responses.
    rewrite: Option<Box<Rewriting>>,
}

/// A socket's two directions, rewritten, and the (engine's, gateway's) ids
/// of its responses.
type Rewriting = (Rewrite, Rewrite, Vec<(String, String)>);

impl WebSocket {
    /// A socket whose response ids are the gateway's.
    pub fn rewriting() -> WebSocket {
        WebSocket {
            rewrite: Some(Default::default()),
            ..Default::default()
        }
    }

    /// Bytes from the client as they go on to the backend: where ids are
    /// rewritten, a message's `previous_response_id` the gateway issued
    /// (`engine_id` reads it) is sent as the engine's own.
    pub fn forward_to_backend(
        &mut self,
        chunk: &[u8],
        engine_id: impl Fn(&str) -> Option<String>,
    ) -> Option<Vec<u8>> {
        let (to_backend, _, pairs) = &mut **self.rewrite.as_mut()?;
        let mut edit = |m: &mut Vec<u8>| {
            let Some(ours) = string_member(m, b"\"previous_response_id\"").map(str::to_string)
            else {
                return;
            };
            if let Some(engine) = engine_id(&ours) {
                replace_ids(m, &[(ours.clone(), engine.clone())]);
                remember(pairs, engine, ours);
            }
        };
        Some(to_backend.push(chunk, &mut edit))
    }

    /// Bytes from the backend as they go on to the client: where ids are
    /// rewritten, the engine's are sent as the gateway's (`issue` makes one
    /// for each response the backend announces).
    pub fn forward_to_client(
        &mut self,
        chunk: &[u8],
        issue: impl Fn(&str) -> Option<String>,
    ) -> Option<Vec<u8>> {
        let (_, to_client, pairs) = &mut **self.rewrite.as_mut()?;
        let mut edit = |m: &mut Vec<u8>| {
            if is_event(m, b"\"response.created\"") {
                let created = ResponseIdScanner::default().push(m);
                if let Some((engine, ours)) = created.and_then(|e| Some((e.clone(), issue(&e)?))) {
                    remember(pairs, engine, ours);
                }
            }
            replace_ids(m, pairs);
        };
        Some(to_client.push(chunk, &mut edit))
    }

    /// Bytes from the client; `Ok` with the turns they begin when asked to
    /// `count` them (each whole `response.create` message of at most
    /// [`READ_AT_MOST`]; messages are read only then), `Err` with the
    /// length of a message over `limit`.
    pub fn client_bytes(&mut self, chunk: &[u8], limit: u64, count: bool) -> Result<u64, u64> {
        let mut turns = 0;
        self.sent.push(chunk, count, limit, &mut |m| {
            turns += is_event(m, b"\"response.create\"") as u64;
        })?;
        Ok(turns)
    }

    /// The tokens the backend's messages reported so far (prompt and
    /// completion, every turn of the socket).
    pub fn used_tokens(&self) -> u64 {
        self.usage
            .map_or(0, |u| u.prompt_tokens + u.completion_tokens)
    }

    /// Bytes from the backend; `created` gets each response id it announces.
    pub fn backend_bytes(&mut self, chunk: &[u8], created: &mut impl FnMut(&str)) {
        let usage = &mut self.usage;
        let mut message = |m: &[u8]| {
            if is_event(m, b"\"response.created\"") {
                if let Some(id) = ResponseIdScanner::default().push(m) {
                    created(&id);
                }
            }
            if let Some(u) = usage_in(m) {
                let sum = usage.get_or_insert_with(Usage::default);
                sum.prompt_tokens += u.prompt_tokens;
                sum.completion_tokens += u.completion_tokens;
                sum.cached_tokens = match (sum.cached_tokens, u.cached_tokens) {
                    (None, None) => None,
                    (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
                };
            }
        };
        // The backend's messages have no limit of the gateway's.
        let _ = self.received.push(chunk, true, u64::MAX, &mut message);
    }
}

fn remember(pairs: &mut Vec<(String, String)>, engine: String, ours: String) {
    if pairs.len() >= PAIRS_KEPT {
        pairs.remove(0);
    }
    pairs.push((engine, ours));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame as a client (masked) or a server (unmasked) sends it.
    fn frame(opcode: u8, fin: bool, payload: &[u8], mask: Option<[u8; 4]>) -> Vec<u8> {
        let mut f = vec![if fin { 0x80 } else { 0 } | opcode];
        let m = if mask.is_some() { 0x80 } else { 0 };
        match payload.len() {
            n if n < 126 => f.push(m | n as u8),
            n if n <= 0xffff => {
                f.push(m | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                f.push(m | 127);
                f.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        match mask {
            Some(k) => {
                f.extend_from_slice(&k);
                f.extend(payload.iter().enumerate().map(|(i, b)| b ^ k[i % 4]));
            }
            None => f.extend_from_slice(payload),
        }
        f
    }

    #[test]
    fn a_sockets_ids_are_rewritten_both_ways_frame_by_frame() {
        let mut ws = WebSocket::rewriting();
        let create =
            br#"{"type":"response.create","previous_response_id":"resp_GW0","input":"hi"}"#;
        let key = [7, 1, 200, 33];
        let mut sent = frame(1, true, create, Some(key));
        sent.extend(frame(9, true, b"ping", Some(key)));
        // A byte at a time: a text frame comes out whole, once complete.
        let mut out = Vec::new();
        for b in &sent {
            out.extend(
                ws.forward_to_backend(&[*b], |id| {
                    (id == "resp_GW0").then(|| "resp_E0".to_string())
                })
                .unwrap(),
            );
        }
        let want = br#"{"type":"response.create","previous_response_id":"resp_E0","input":"hi"}"#;
        let mut expected = frame(1, true, want, Some(key));
        expected.extend(frame(9, true, b"ping", Some(key)));
        assert_eq!(
            out, expected,
            "re-framed with its new length, masked with its own key"
        );
        // The backend's events: its new response's id, and the one it follows.
        let created = br#"{"type":"response.created","response":{"id":"resp_E1","previous_response_id":"resp_E0"}}"#;
        let delta = br#"{"type":"response.output_text.delta","item_id":"msg_1","delta":"x"}"#;
        let mut received = frame(1, true, created, None);
        received.extend(frame(1, true, delta, None));
        received.extend(frame(2, true, b"\x00binary\x00", None));
        let out = ws
            .forward_to_client(&received, |e| {
                (e == "resp_E1").then(|| "resp_GW1".to_string())
            })
            .unwrap();
        let created_ours = br#"{"type":"response.created","response":{"id":"resp_GW1","previous_response_id":"resp_GW0"}}"#;
        let mut expected = frame(1, true, created_ours, None);
        expected.extend(frame(1, true, delta, None));
        expected.extend(frame(2, true, b"\x00binary\x00", None));
        assert_eq!(out, expected);
        // A socket that does not rewrite leaves the bytes alone.
        assert!(WebSocket::default()
            .forward_to_client(&received, |_| None)
            .is_none());
    }

    fn completed(id: &str, input: u64, cached: u64, output: u64) -> Vec<u8> {
        let created =
            format!(r#"{{"type":"response.created","response":{{"id":"{id}","usage":null}}}}"#);
        let done = format!(
            r#"{{"type":"response.completed","response":{{"id":"{id}","usage":{{"input_tokens":{input},"input_tokens_details":{{"cached_tokens":{cached}}},"output_tokens":{output}}}}}}}"#
        );
        let mut bytes = frame(1, true, created.as_bytes(), None);
        bytes.extend(frame(9, true, b"ping", None));
        bytes.extend(frame(1, true, done.as_bytes(), None));
        bytes
    }

    #[test]
    fn a_sockets_turns_add_up_their_usage_and_name_their_responses_split_anywhere() {
        let mut stream = completed("resp_a", 1000, 0, 10);
        stream.extend(completed("resp_b", 1200, 1000, 20));
        // A long message (16-bit length) that says nothing of usage.
        stream.extend(frame(1, true, "x".repeat(70_000).as_bytes(), None));
        for cut in [1, 2, 3, 7, 64, 4096, stream.len()] {
            let mut ws = WebSocket::default();
            let mut ids = Vec::new();
            for piece in stream.chunks(cut) {
                ws.backend_bytes(piece, &mut |id| ids.push(id.to_string()));
            }
            assert_eq!(ids, ["resp_a", "resp_b"], "cut {cut}");
            assert_eq!(
                ws.usage,
                Some(Usage {
                    prompt_tokens: 2200,
                    cached_tokens: Some(1000),
                    completion_tokens: 30
                }),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn a_fragmented_message_is_read_whole_and_control_frames_between_do_not_break_it() {
        let text = br#"{"type":"response.completed","response":{"usage":{"input_tokens":5,"output_tokens":1}}}"#;
        let mut stream = frame(1, false, &text[..20], None);
        stream.extend(frame(9, true, b"", None));
        stream.extend(frame(0, true, &text[20..], None));
        let mut ws = WebSocket::default();
        ws.backend_bytes(&stream, &mut |_| {});
        assert_eq!(ws.usage.map(|u| u.prompt_tokens), Some(5));
    }

    #[test]
    fn each_client_message_is_held_to_the_limit_not_the_socket() {
        let mask = Some([1, 2, 3, 4]);
        let mut ws = WebSocket::default();
        // Many messages under the limit: far more than it in all.
        for _ in 0..50 {
            let m = frame(1, true, &[b'a'; 900], mask);
            assert_eq!(ws.client_bytes(&m, 1000, false), Ok(0));
        }
        // One message over it, in two frames: refused at the second.
        assert_eq!(
            ws.client_bytes(&frame(1, false, &[b'a'; 600], mask), 1000, false),
            Ok(0)
        );
        assert_eq!(
            ws.client_bytes(&frame(0, true, &[b'a'; 600], mask), 1000, false),
            Err(1200)
        );
    }

    #[test]
    fn a_client_turn_is_a_whole_response_create_message() {
        let mask = Some([9, 8, 7, 6]);
        let mut ws = WebSocket::default();
        let create = br#"{"type": "response.create", "input": "go on"}"#;
        // Split over two frames (and two reads): one turn, at its end.
        assert_eq!(
            ws.client_bytes(&frame(1, false, &create[..10], mask), 1000, true),
            Ok(0)
        );
        assert_eq!(
            ws.client_bytes(&frame(0, true, &create[10..], mask), 1000, true),
            Ok(1)
        );
        // Not asked to count (no per-minute limits): not read, no turn.
        let mut unread = WebSocket::default();
        assert_eq!(
            unread.client_bytes(&frame(1, true, create, mask), 1000, false),
            Ok(0)
        );
        // A message that only names the event in its text is no turn.
        let other =
            br#"{"type": "conversation.item.create", "text": "\"type\": \"response.create\""}"#;
        assert_eq!(
            ws.client_bytes(&frame(1, true, other, mask), 1000, true),
            Ok(0)
        );
    }

    #[test]
    fn only_a_response_created_event_names_a_response() {
        let mut ids = Vec::new();
        // An item with a member whose value is the event's name (a tool
        // call's argument, say).
        let delta = br#"{"type":"response.output_item.done","item":{"id":"msg_1","event":"response.created"}}"#;
        let created =
            br#"{"type" : "response.created","sequence_number":0,"response":{"id":"resp_y"}}"#;
        let mut ws = WebSocket::default();
        for m in [&delta[..], &created[..]] {
            ws.backend_bytes(&frame(1, true, m, None), &mut |id| ids.push(id.to_string()));
        }
        assert_eq!(ids, ["resp_y"]);
    }

    #[test]
    fn masked_text_is_unmasked_before_it_is_read() {
        let text = br#"{"type":"response.created","response":{"id":"resp_m"}}"#;
        let mut ids = Vec::new();
        WebSocket::default().backend_bytes(&frame(1, true, text, Some([9, 8, 7, 6])), &mut |id| {
            ids.push(id.to_string())
        });
        assert_eq!(ids, ["resp_m"]);
    }
}
