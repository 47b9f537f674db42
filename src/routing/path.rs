//! A request's path as an engine will read it, settled once before
//! anything is judged by it (its tier, whether its prompt is salted, which
//! stored response it names, its limits) and forwarded as settled: what
//! the gateway judged is what the engine is asked.
//!
//! vLLM's and SGLang's servers decode percent-escapes before routing
//! (`/v1/chat/completion%73` is their chat endpoint); judged raw, such a
//! spelling went upstream without its tenant's cache salt. So escapes of
//! unreserved characters are decoded (RFC 3986 §6.2.2.2), empty and `.`
//! segments dropped (duplicate and trailing slashes), `..` resolved. What
//! engines and the proxies before them read in different ways is refused
//! with 400: any other escape (`%2F`, `%25`, `%00`, non-ASCII), `;`
//! parameters (stripped by some servers, kept by others), a segment ending
//! in a dot (trimmed by some), a `..` above the root, and an API endpoint
//! spelled in other letter case ([`Judged::miscased`]: engines' routers are
//! case-sensitive, so one router may take what another refuses).

use crate::errors::GatewayError;

/// The settled spelling of `path_and_query` (an origin-form target), or
/// `None` when it is settled already. The query is kept as sent.
pub fn canonical(path_and_query: &str) -> Result<Option<String>, GatewayError> {
    let (path, query) = match path_and_query.split_once('?') {
        Some((p, q)) => (p, Some(q)),
        None => (path_and_query, None),
    };
    if settled_already(path) {
        // Every request's path: one scan, nothing allocated.
        return Ok(None);
    }
    let Some(rest) = path.strip_prefix('/') else {
        return Err(refused("does not start with `/`"));
    };
    let mut segments: Vec<String> = Vec::new();
    for raw in rest.split('/') {
        let segment = decoded(raw)?;
        match segment.as_str() {
            "" | "." => {}
            ".." => {
                if segments.pop().is_none() {
                    return Err(refused("climbs above the root with `..`"));
                }
            }
            s if s.ends_with('.') => return Err(refused("has a segment ending in `.`")),
            s if s.contains(';') => return Err(refused("has `;` parameters")),
            _ => segments.push(segment),
        }
    }
    let mut out = String::with_capacity(path_and_query.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    if out.is_empty() {
        out.push('/');
    }
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    Ok((out != path_and_query).then_some(out))
}

/// Whether `path` is settled as it is: it starts with `/`, and has no
/// escape, `;`, empty segment (doubled or trailing slash), segment ending in
/// `.` (which covers `.` and `..`), nor character outside a path segment's.
fn settled_already(path: &str) -> bool {
    let b = path.as_bytes();
    if b.first() != Some(&b'/') {
        return false;
    }
    if b.len() == 1 {
        return true;
    }
    let mut last = b'/';
    for &c in &b[1..] {
        let ok = match c {
            b'/' => last != b'/' && last != b'.',
            b'%' | b';' => false,
            c => segment_char(c),
        };
        if !ok {
            return false;
        }
        last = c;
    }
    last != b'/' && last != b'.'
}

/// `raw` with escapes of unreserved characters decoded; refused where it
/// holds another escape or a character no path segment holds.
fn decoded(raw: &str) -> Result<String, GatewayError> {
    let bytes = raw.as_bytes();
    let mut out = String::with_capacity(raw.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if b == b'%' {
            let hex = |c: u8| (c as char).to_digit(16);
            let value = match (bytes.get(i + 1), bytes.get(i + 2)) {
                (Some(&h), Some(&l)) => hex(h).zip(hex(l)).map(|(h, l)| (h * 16 + l) as u8),
                _ => None,
            };
            match value {
                Some(v) if unreserved(v) => out.push(v as char),
                Some(_) => {
                    return Err(refused(
                        "escapes a character engines read differently (only letters, digits \
                         and `-._~` may be escaped)",
                    ))
                }
                None => return Err(refused("has a `%` that starts no escape")),
            }
            i += 3;
        } else if segment_char(b) {
            out.push(b as char);
            i += 1;
        } else {
            return Err(refused("has a character no path segment holds"));
        }
    }
    Ok(out)
}

/// A character a path segment holds as it is (RFC 3986 `pchar`, less `%`).
fn segment_char(b: u8) -> bool {
    unreserved(b) || b"!$&'()*+,;=:@".contains(&b)
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn refused(why: &str) -> GatewayError {
    GatewayError::bad_path(format!("the request path {why}"))
}

/// The endpoints whose prompt an engine's prefix cache serves: chat and
/// text completions, Responses, Anthropic Messages.
const PROMPT_ENDPOINTS: &[&str] = &[
    "/chat/completions",
    "/completions",
    "/responses",
    "/messages",
];

/// The segment before a stored response's id (`…/responses/{id}`).
pub(super) const RESPONSE_SEGMENT: &str = "/responses/";

/// A settled path as the gateway judges it: by its endpoint, in any case.
pub struct Judged<'a> {
    path: &'a str,
    /// Copied only when it has capitals.
    lower: std::borrow::Cow<'a, str>,
}

impl<'a> Judged<'a> {
    pub fn new(path: &'a str) -> Judged<'a> {
        let lower = match path.bytes().any(|b| b.is_ascii_uppercase()) {
            true => path.to_ascii_lowercase().into(),
            false => path.into(),
        };
        Judged { path, lower }
    }

    /// Whether the path is the endpoint `suffix` names, under any prefix
    /// (`/v1/...`, or a proxy's `/openai/v1/...`).
    pub fn ends_with(&self, suffix: &str) -> bool {
        self.lower.ends_with(suffix)
    }

    /// Whether it names an endpoint the gateway judges (prompts, stored
    /// responses) in other letter case than the engines' own.
    pub fn miscased(&self) -> bool {
        let (path, lower) = (self.path, self.lower.as_ref());
        path != lower
            && (PROMPT_ENDPOINTS
                .iter()
                .any(|e| lower.ends_with(e) && !path.ends_with(e))
                || lower.contains(RESPONSE_SEGMENT) && !path.contains(RESPONSE_SEGMENT))
    }

    /// Whether it is an endpoint whose prompt an engine's prefix cache
    /// serves, under any prefix (`/v1/...`, or a proxy's `/openai/v1/...`;
    /// other letter case is refused before this is asked). Embeddings,
    /// rerank, scoring and tokenizing calls hold no KV cache to return to.
    pub fn prompt_endpoint(&self) -> bool {
        PROMPT_ENDPOINTS.iter().any(|e| self.ends_with(e))
    }

    /// Where `segment` first starts, in any case.
    pub fn find(&self, segment: &str) -> Option<usize> {
        self.lower.find(segment)
    }

    /// The path as sent (ids in it keep their case).
    pub fn as_str(&self) -> &'a str {
        self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settled(p: &str) -> Result<String, u16> {
        canonical(p)
            .map(|c| c.unwrap_or_else(|| p.to_string()))
            .map_err(|e| e.status)
    }

    #[test]
    fn spellings_of_an_endpoint_settle_on_it_or_are_refused() {
        let chat = "/v1/chat/completions";
        for same in [
            "/v1/chat/completions",
            "/v1/chat/completion%73",
            "/v1/%63hat/completions",
            "/v1/chat/completions/",
            "//v1//chat/completions",
            "/v1/./chat/completions",
            "/v1/x/../chat/completions",
            "/v1/chat/%2e/completions",
            "/v1/%2e%2e/v1/chat/completions",
            "/%76%31/%63%68%61%74/%63%6F%6D%70%6C%65%74%69%6F%6E%73",
        ] {
            assert_eq!(settled(same).as_deref(), Ok(chat), "{same}");
        }
        for refused in [
            "/v1/chat%2Fcompletions",
            "/v1/chat%2fcompletions",
            "/v1/chat/completions;x=1",
            "/v1/chat;/completions",
            "/v1/chat/completions.",
            "/v1/chat/completions%2E",
            "/v1/chat/completions%00",
            "/v1/chat/completion%2573",
            "/v1/chat/completions%",
            "/v1/chat/completions%zz",
            "/v1/chat/compl%C3%A9tions",
            "/../v1/chat/completions",
            "v1/chat/completions",
        ] {
            assert_eq!(settled(refused), Err(400), "{refused}");
        }
        assert_eq!(canonical("/v1/chat/completions?a=%2F&b=1").unwrap(), None);
        assert_eq!(
            settled("/v1/responses/resp_AbC-_1/?x=1").as_deref(),
            Ok("/v1/responses/resp_AbC-_1?x=1")
        );
        assert_eq!(settled("/").as_deref(), Ok("/"));
        assert_eq!(settled("//").as_deref(), Ok("/"));
    }

    #[test]
    fn an_endpoint_is_judged_in_any_case_and_ids_keep_theirs() {
        let j = Judged::new("/V1/Chat/Completions");
        assert!(j.ends_with("/chat/completions"));
        assert!(j.miscased());
        assert!(Judged::new("/v1/RESPONSES/resp_x").miscased());
        assert!(!Judged::new("/V1/chat/completions").miscased());
        assert!(!Judged::new("/v1/responses/resp_AbC").miscased());
        assert!(!Judged::new("/v1/Models").miscased());
        let j = Judged::new("/v1/Responses/resp_AbC");
        let at = j.find("/responses/").unwrap() + "/responses/".len();
        assert_eq!(&j.as_str()[at..], "resp_AbC");
    }
}
