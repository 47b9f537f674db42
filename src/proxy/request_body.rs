//! Reading a request body before routing without losing any of it.
//!
//! Routing may need the body (`model` picks the tier; a body field may carry
//! the session key), so it must be read in `request_filter`, before Pingora
//! connects upstream. Pingora then forwards only what its retry buffer kept,
//! and that buffer stops at 64 KiB: past it the body would be silently dropped.
//!
//! The way round: with a known `Content-Length`, turn retry buffering on only
//! for the last ≤ 64 KiB, so the buffer is complete (never truncated) and not
//! empty. Pingora hands that tail to `request_body_filter` as the one body
//! chunk of the attempt, and the proxy replaces it with the whole body it kept.
//! A body of unknown length that outgrows the buffer cannot be forwarded and
//! is refused with 411 instead of being truncated.

use super::conn_guard::ConnState;
use crate::errors::GatewayError;
use bytes::{Bytes, BytesMut};
use pingora_proxy::Session;
use std::sync::Arc;

/// The client's side of a request: its connection's limits and its body.
#[derive(Default)]
pub struct ClientBody {
    /// The client connection's limits (HTTP/1 on a proxy listener).
    pub conn: Option<Arc<ConnState>>,
    /// The whole body, when it was read before routing or kept for a replay.
    pub whole: Option<Bytes>,
    /// `whole` counted against the gateway's body budget.
    pub hold: Option<BodyHold>,
    /// What has been forwarded of it (all of it, when read before routing).
    pub bytes: u64,
    /// Its Content-Length, as `request_filter` read and checked it.
    pub declared: Option<u64>,
    /// Whether it asked for a stream (`None`: it was not read).
    pub asks_stream: Option<bool>,
    /// `whole` is not what the client sent (routing rewrote it): its
    /// length goes upstream as its own.
    pub rewritten: bool,
}

/// Pingora's retry buffer size (`BODY_BUF_LIMIT` in pingora-core, h1 and h2).
pub const RETRY_BUFFER_BYTES: u64 = 64 * 1024;

/// The declared body length; `Err` when the header is present but unusable.
pub fn content_length(session: &Session) -> Result<Option<u64>, GatewayError> {
    let mut values = session
        .req_header()
        .headers
        .get_all(http::header::CONTENT_LENGTH)
        .iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.any(|v| v != first) {
        return Err(GatewayError::bad_body(
            "conflicting Content-Length headers".into(),
        ));
    }
    std::str::from_utf8(first.as_bytes())
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .map(Some)
        .ok_or_else(|| GatewayError::bad_body("Content-Length is not a number".into()))
}

/// Read the whole body (at most `limit` bytes) and leave Pingora able to
/// forward it (see the module doc). The caller must put the returned bytes in
/// place of the first body chunk `request_body_filter` sees.
pub async fn pre_read(
    session: &mut Session,
    declared: Option<u64>,
    limit: u64,
) -> Result<Bytes, PreReadError> {
    if session
        .req_header()
        .headers
        .get("expect")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"))
    {
        session
            .as_downstream_mut()
            .write_continue_response()
            .await
            .map_err(PreReadError::Io)?;
    }
    // A body that arrives in one chunk (most: a few KiB) is kept as it came;
    // only one in several chunks is gathered into one buffer.
    let mut first: Option<Bytes> = None;
    let mut buf = BytesMut::new();
    let mut buffering = false;
    loop {
        let read = first.as_ref().map_or(0, |b| b.len()) + buf.len();
        let remaining = declared.map(|len| len.saturating_sub(read as u64));
        let want_buffer = match remaining {
            Some(r) => r > 0 && r <= RETRY_BUFFER_BYTES,
            // Unknown length: buffer from the start and hope it fits.
            None => true,
        };
        if want_buffer && !buffering {
            session.as_downstream_mut().enable_retry_buffering();
            buffering = true;
        }
        match session
            .read_request_body()
            .await
            .map_err(PreReadError::Io)?
        {
            Some(chunk) => {
                if read as u64 + chunk.len() as u64 > limit {
                    return Err(PreReadError::Refused(GatewayError::body_too_large(limit)));
                }
                match first.take() {
                    None if buf.is_empty() => first = Some(chunk),
                    earlier => {
                        if buf.is_empty() {
                            buf.reserve(declared.unwrap_or(0).min(limit) as usize);
                        }
                        if let Some(earlier) = earlier {
                            buf.extend_from_slice(&earlier);
                        }
                        buf.extend_from_slice(&chunk);
                    }
                }
            }
            None => break,
        }
    }
    let body = match first {
        Some(only) => only,
        None => buf.freeze(),
    };
    if let Some(len) = declared {
        if body.len() as u64 != len {
            return Err(PreReadError::Refused(GatewayError::bad_body(format!(
                "body ended after {} of {len} declared bytes",
                body.len()
            ))));
        }
    }
    // The invariant the forwarding relies on: Pingora will replay a complete,
    // non-empty retry buffer, which the proxy swaps for the whole body.
    if !body.is_empty() && session.as_downstream().get_retry_buffer().is_none() {
        return Err(PreReadError::Refused(GatewayError::length_required()));
    }
    Ok(body)
}

#[derive(Debug)]
pub enum PreReadError {
    /// The client went away or sent a broken body.
    Io(Box<pingora_core::Error>),
    /// The body is refused with this error.
    Refused(GatewayError),
}

/// Reserved for a body of unknown length (chunked) the gateway reads to route.
pub const UNKNOWN_LENGTH_RESERVE: u64 = 1024 * 1024;

pub use crate::gateway::{BodyBudget, BodyHold};

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn budget_refuses_past_its_limit_and_frees_on_drop() {
        let budget = Arc::new(BodyBudget::default());
        let a = budget.try_hold(600, 1000).expect("fits");
        assert!(budget.try_hold(500, 1000).is_none(), "600 + 500 > 1000");
        let forced = budget.hold(500);
        assert_eq!(budget.held(), 1100);
        drop(a);
        drop(forced);
        assert_eq!(budget.held(), 0);
        assert!(budget.try_hold(1000, 1000).is_some());
        assert!(budget.try_hold(u64::MAX, u64::MAX).is_some(), "no overflow");
    }
}
