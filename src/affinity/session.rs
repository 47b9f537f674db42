//! Where a request's session and parent keys come from (SPEC §3.2–3.3), and
//! which values are refused (SPEC §8).

use http::{HeaderMap, HeaderName};

/// Longest session id accepted, in bytes.
pub const MAX_SESSION_ID_BYTES: usize = 256;

/// A session header the gateway refuses (→ 400).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadSessionHeader {
    pub header: String,
    pub reason: &'static str,
}

impl std::fmt::Display for BadSessionHeader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "header `{}` {}", self.header, self.reason)
    }
}

/// Where a session id was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Header(HeaderName),
    Body(String),
    /// Derived from the conversation's prompt (`affinity.prefix`).
    Prompt,
    /// The session of the stored response a Responses request follows
    /// (`previous_response_id`).
    StoredResponse,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionId {
    pub id: String,
    pub source: Source,
}

pub fn check_value(bytes: &[u8]) -> Result<&str, &'static str> {
    if bytes.len() > MAX_SESSION_ID_BYTES {
        return Err("is longer than 256 bytes");
    }
    if bytes.iter().any(|&b| b < 0x20 || b == 0x7f) {
        return Err("contains control characters");
    }
    std::str::from_utf8(bytes).map_err(|_| "is not valid UTF-8")
}

/// A request's headers, with the names they carry gathered in one pass. A
/// lookup by name hashes the name, and a request is checked for a dozen
/// configured names (six session headers, two parent headers, the final,
/// tier and target headers) of which it carries one or two: an absent name
/// is ruled out by comparing it with the request's few names instead.
pub struct RequestHeaders<'a> {
    map: &'a HeaderMap,
    /// The request's distinct names; `None` when it has more than fit, and
    /// then every lookup goes to the map.
    names: Option<([Option<&'a HeaderName>; NAMES], usize)>,
}

/// How many distinct names a request's one-pass index holds.
const NAMES: usize = 16;

impl<'a> RequestHeaders<'a> {
    pub fn new(map: &'a HeaderMap) -> Self {
        let n = map.keys_len();
        if n > NAMES {
            return RequestHeaders { map, names: None };
        }
        let mut names = [None; NAMES];
        for (slot, name) in names.iter_mut().zip(map.keys()) {
            *slot = Some(name);
        }
        RequestHeaders {
            map,
            names: Some((names, n)),
        }
    }

    fn has(&self, name: &HeaderName) -> bool {
        match &self.names {
            Some((names, n)) => names[..*n].contains(&Some(name)),
            None => true,
        }
    }

    /// The first value of `name`.
    pub fn get(&self, name: &HeaderName) -> Option<&'a http::HeaderValue> {
        if self.has(name) {
            self.map.get(name)
        } else {
            None
        }
    }

    /// Every value of `name`; `None` when the request does not carry it.
    fn values(&self, name: &HeaderName) -> Option<http::header::ValueIter<'a, http::HeaderValue>> {
        self.has(name).then(|| self.map.get_all(name).iter())
    }
}

/// The first present header of `names` (in order), validated. Every present
/// header of the list is validated, so a bad value is refused even when an
/// earlier header would have won.
pub fn from_headers(
    headers: &RequestHeaders<'_>,
    names: &[HeaderName],
) -> Result<Option<SessionId>, BadSessionHeader> {
    let mut found = None;
    for name in names {
        let Some(mut values) = headers.values(name) else {
            continue;
        };
        let Some(first) = values.next() else {
            continue;
        };
        let bad = |reason| BadSessionHeader {
            header: name.to_string(),
            reason,
        };
        let value = check_value(first.as_bytes()).map_err(bad)?;
        for other in values {
            if other.as_bytes() != first.as_bytes() {
                return Err(bad("appears more than once with different values"));
            }
        }
        let value = value.trim();
        if value.is_empty() || found.is_some() {
            continue;
        }
        found = Some(SessionId {
            id: value.to_string(),
            source: Source::Header(name.clone()),
        });
    }
    Ok(found)
}

/// The fields of a request body the gateway routes on. Only the top level is
/// walked (by [`crate::affinity::scan`], without decoding or allocating for
/// the prompt); a member is decoded only when routing asks for it.
pub struct BodyProbe<'a> {
    /// (key as written, raw value) of each top-level member.
    top: Vec<(&'a [u8], &'a [u8])>,
    /// The prompt's array of messages (`messages`, or Responses' `input`),
    /// walked on the way: which member, and where each element ends in it.
    messages: Option<(&'a [u8], Vec<usize>)>,
    /// Where the object's closing brace is.
    close: usize,
}

/// The top-level arrays whose elements are a prompt's messages.
const MESSAGE_ARRAYS: [&[u8]; 2] = [b"messages", b"input"];

impl<'a> BodyProbe<'a> {
    /// `None` when the body is not a JSON object (the backend will say why).
    pub fn parse(body: &'a [u8]) -> Option<Self> {
        use crate::affinity::scan::{array_ends, each_member_with, skip_value, skip_ws};
        let mut top = Vec::with_capacity(8);
        let mut messages = None;
        let end = each_member_with(body, |key, at| {
            // The messages are walked once, here: where each ends is what
            // the prompt's reader needs of them.
            let end = match body.get(at) {
                Some(b'[') if MESSAGE_ARRAYS.contains(&key) => {
                    let mut ends = Vec::new();
                    let end = array_ends(body, at, &mut ends)?;
                    messages = Some((key, ends));
                    end
                }
                _ => skip_value(body, at)?,
            };
            top.push((key, &body[at..end]));
            Some((true, end))
        })?;
        (skip_ws(body, end) == body.len()).then_some(BodyProbe {
            top,
            messages,
            close: end.saturating_sub(1),
        })
    }

    /// Where the object's closing brace is: a member written before it is
    /// the object's last.
    pub fn close(&self) -> usize {
        self.close
    }

    /// Each top-level member: (its key as written, its raw value).
    pub fn members(&self) -> impl Iterator<Item = (&'a [u8], &'a [u8])> + '_ {
        self.top.iter().copied()
    }

    /// Whether the object has no members.
    pub fn is_empty(&self) -> bool {
        self.top.is_empty()
    }

    /// Where each element of the top-level array `name` ends (offsets into
    /// its raw value), when the probe walked it (`messages`, `input`).
    pub fn element_ends(&self, name: &str) -> Option<&[usize]> {
        let (key, ends) = self.messages.as_ref()?;
        // The member `raw` returns: the last of that name.
        let last = self.top.iter().rev().find(|(k, _)| *k == name.as_bytes())?;
        (*key == name.as_bytes() && std::ptr::eq(last.0, *key)).then_some(ends.as_slice())
    }

    /// The raw value of a top-level member (the last, when repeated).
    pub fn raw(&self, name: &str) -> Option<&'a [u8]> {
        self.top
            .iter()
            .rev()
            .find(|(k, _)| *k == name.as_bytes())
            .map(|(_, v)| *v)
    }

    fn string_at(&self, path: &[String]) -> Option<String> {
        let (first, rest) = path.split_first()?;
        let raw = self.raw(first)?;
        if rest.is_empty() {
            return match raw {
                // The common case, a plain string: no decoder needed.
                [b'"', inner @ .., b'"'] if !inner.contains(&b'\\') => {
                    std::str::from_utf8(inner).ok().map(str::to_string)
                }
                _ => serde_json::from_slice::<String>(raw).ok(),
            };
        }
        let mut v: serde_json::Value = serde_json::from_slice(raw).ok()?;
        for p in rest {
            v = v.get_mut(p.as_str())?.take();
        }
        v.as_str().map(str::to_string)
    }

    pub fn model(&self) -> Option<String> {
        self.string_at(&["model".to_string()])
    }

    /// A Responses request's `previous_response_id`.
    pub fn previous_response_id(&self) -> Option<String> {
        self.string_at(&["previous_response_id".to_string()])
            .filter(|id| !id.is_empty() && check_value(id.as_bytes()).is_ok())
    }

    /// The Conversations API's `conversation` (an id, or an object with
    /// one): a session key wherever it is present.
    pub fn conversation(&self) -> Option<SessionId> {
        self.raw("conversation")?;
        let conversation = || "conversation".to_string();
        let mut found = self.session(&[vec![conversation()], vec![conversation(), "id".into()]])?;
        found.source = Source::Body("conversation".into());
        Some(found)
    }

    /// The most output tokens it asks for (`max_completion_tokens`,
    /// `max_tokens`, or Responses' `max_output_tokens`).
    pub fn max_output_tokens(&self) -> Option<u64> {
        ["max_completion_tokens", "max_tokens", "max_output_tokens"]
            .iter()
            .find_map(|f| std::str::from_utf8(self.raw(f)?).ok()?.trim().parse().ok())
    }

    pub fn is_stream(&self) -> bool {
        self.raw("stream") == Some(b"true")
    }

    /// The first configured field holding an acceptable id. Unacceptable
    /// values (too long, control characters) are ignored, never bound.
    pub fn session(&self, fields: &[Vec<String>]) -> Option<SessionId> {
        for path in fields {
            if let Some(v) = self.string_at(path) {
                // A field whose value is itself a JSON object naming its
                // session (Claude Code's `metadata.user_id` since v2.1.78:
                // device, account and `session_id`): the session's own id.
                let (v, source) = match embedded_session(&v) {
                    Some(id) => (id, format!("{}.session_id", path.join("."))),
                    None => (v.trim().to_string(), path.join(".")),
                };
                if !v.is_empty() && check_value(v.as_bytes()).is_ok() {
                    return Some(SessionId {
                        id: v,
                        source: Source::Body(source),
                    });
                }
            }
        }
        None
    }
}

/// The `session_id` of a value that is a JSON object holding one.
fn embedded_session(v: &str) -> Option<String> {
    let v = v.trim();
    if !v.starts_with('{') {
        return None;
    }
    let object: serde_json::Value = serde_json::from_str(v).ok()?;
    Some(object.get("session_id")?.as_str()?.trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn a_json_user_id_is_keyed_by_its_session_id() {
        let fields = [vec!["metadata".to_string(), "user_id".to_string()]];
        let body = serde_json::json!({"metadata": {"user_id": serde_json::json!({
            "device_id": "d".repeat(64), "account_uuid": "3f1c0d2e-0000-4000-8000-000000000001",
            "session_id": "4a7b9c2d-1e3f-4a5b-8c6d-7e8f9a0b1c2d"}).to_string()}});
        let text = body.to_string();
        let probe = BodyProbe::parse(text.as_bytes()).unwrap();
        let s = probe.session(&fields).expect("keyed");
        assert_eq!(s.id, "4a7b9c2d-1e3f-4a5b-8c6d-7e8f9a0b1c2d");
        assert_eq!(s.source, Source::Body("metadata.user_id.session_id".into()));
        // A plain user id is the key as it is.
        let text = r#"{"metadata":{"user_id":"user_abc_account_def_session_123"}}"#;
        let probe = BodyProbe::parse(text.as_bytes()).unwrap();
        assert_eq!(
            probe.session(&fields).unwrap().id,
            "user_abc_account_def_session_123"
        );
    }

    /// The session id `h` names, by the test's two configured headers.
    fn session_of(h: &HeaderMap) -> Result<Option<SessionId>, BadSessionHeader> {
        from_headers(&RequestHeaders::new(h), &names())
    }

    fn names() -> Vec<HeaderName> {
        vec![
            HeaderName::from_static("x-session-id"),
            HeaderName::from_static("x-dynamo-session-id"),
        ]
    }

    #[test]
    fn first_configured_header_wins() {
        let mut h = HeaderMap::new();
        h.insert("x-dynamo-session-id", HeaderValue::from_static("dyn"));
        assert_eq!(session_of(&h).unwrap().unwrap().id, "dyn");
        h.insert("x-session-id", HeaderValue::from_static("canon"));
        let s = session_of(&h).unwrap().unwrap();
        assert_eq!(s.id, "canon");
        assert_eq!(
            s.source,
            Source::Header(HeaderName::from_static("x-session-id"))
        );
    }

    #[test]
    fn a_request_with_many_headers_is_read_in_full() {
        // More distinct names than the one-pass index holds: every lookup
        // goes to the map, and the session header is still found.
        for others in [0, 5, 15, 16, 40] {
            let mut h = HeaderMap::new();
            for i in 0..others {
                h.insert(
                    HeaderName::from_bytes(format!("x-other-{i}").as_bytes()).unwrap(),
                    HeaderValue::from_static("v"),
                );
            }
            let seen = RequestHeaders::new(&h);
            assert!(from_headers(&seen, &names()).unwrap().is_none());
            assert!(seen.get(&HeaderName::from_static("x-session-id")).is_none());
            h.insert("x-dynamo-session-id", HeaderValue::from_static("s"));
            let seen = RequestHeaders::new(&h);
            assert_eq!(
                from_headers(&seen, &names()).unwrap().unwrap().id,
                "s",
                "{others} other headers"
            );
            assert_eq!(
                seen.get(&HeaderName::from_static("x-dynamo-session-id"))
                    .unwrap(),
                "s"
            );
        }
    }

    #[test]
    fn bad_values_are_refused() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-session-id",
            HeaderValue::from_str(&"a".repeat(257)).unwrap(),
        );
        assert_eq!(
            session_of(&h).unwrap_err().reason,
            "is longer than 256 bytes"
        );
        let mut h = HeaderMap::new();
        h.insert("x-session-id", HeaderValue::from_bytes(b"a\tb").unwrap());
        assert!(session_of(&h).is_err());
        let mut h = HeaderMap::new();
        h.append("x-session-id", HeaderValue::from_static("a"));
        h.append("x-session-id", HeaderValue::from_static("b"));
        assert!(session_of(&h).is_err());
        let mut h = HeaderMap::new();
        h.append("x-session-id", HeaderValue::from_static("a"));
        h.append("x-session-id", HeaderValue::from_static("a"));
        assert_eq!(session_of(&h).unwrap().unwrap().id, "a");
        // A bad lower-precedence header is refused too.
        let mut h = HeaderMap::new();
        h.insert("x-session-id", HeaderValue::from_static("ok"));
        h.insert(
            "x-dynamo-session-id",
            HeaderValue::from_bytes(b"x\ty").unwrap(),
        );
        assert!(session_of(&h).is_err());
    }

    #[test]
    fn body_probe_reads_model_and_fields() {
        let body =
            br#"{"messages":[{"role":"user","content":"hi"}],"model":"qwen3-8b","stream":true,
            "metadata":{"user_id":"u-1"},"user":""}"#;
        let p = BodyProbe::parse(body).unwrap();
        assert_eq!(p.model().as_deref(), Some("qwen3-8b"));
        assert!(p.is_stream());
        let fields: Vec<Vec<String>> = ["prompt_cache_key", "user", "metadata.user_id"]
            .iter()
            .map(|f| f.split('.').map(str::to_string).collect())
            .collect();
        let s = p.session(&fields).unwrap();
        assert_eq!(s.id, "u-1");
        assert_eq!(s.source, Source::Body("metadata.user_id".into()));
        assert!(BodyProbe::parse(b"not json").is_none());
        assert!(BodyProbe::parse(b"[1,2]").is_none());
        // What is not a JSON object at the top is no probe either.
        for bad in [
            &br#"{"model":"m",}"#[..],
            br#"{"model":"m"} trailing"#,
            br#"{"model": tru}"#,
            br#"{"model" "m"}"#,
            br#"{"messages":[{"role":"user"}"#,
            br#"{"model":"m"#,
        ] {
            assert!(
                BodyProbe::parse(bad).is_none(),
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
        let p = BodyProbe::parse(br#" { } "#).unwrap();
        assert_eq!(p.model(), None);
        // Escapes are decoded; a repeated member is its last value, as a
        // JSON parser reads it.
        let p =
            BodyProbe::parse(br#"{"model":"q\u0077en","model":"qwen3-8b","user":"a\"b"}"#).unwrap();
        assert_eq!(p.model().as_deref(), Some("qwen3-8b"));
        let user = vec![vec!["user".to_string()]];
        assert_eq!(p.session(&user).unwrap().id, "a\"b");
        assert!(!p.is_stream());
    }

    #[test]
    fn a_responses_body_names_its_conversation_and_the_response_it_follows() {
        for body in [
            &br#"{"model":"m","conversation":"conv_9","previous_response_id":"resp_1"}"#[..],
            br#"{"conversation":{"id":"conv_9"},"previous_response_id":"resp_1"}"#,
        ] {
            let p = BodyProbe::parse(body).unwrap();
            let c = p.conversation().unwrap();
            assert_eq!(c.id, "conv_9");
            assert_eq!(c.source, Source::Body("conversation".into()));
            assert_eq!(p.previous_response_id().as_deref(), Some("resp_1"));
        }
        // Nothing to follow or to key by: absent, null, empty, not text.
        for body in [
            &br#"{"input":"hi"}"#[..],
            br#"{"conversation":null,"previous_response_id":null}"#,
            br#"{"conversation":"","previous_response_id":""}"#,
            br#"{"conversation":7,"previous_response_id":{"id":"resp_1"}}"#,
        ] {
            let p = BodyProbe::parse(body).unwrap();
            assert!(
                p.conversation().is_none(),
                "{}",
                String::from_utf8_lossy(body)
            );
            assert!(p.previous_response_id().is_none());
        }
    }
}
