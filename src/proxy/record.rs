//! What a request leaves on record ([`Record`]): its id, when it started,
//! its trace span, the model it named, and the error the gateway answered;
//! and how request ids are made ([`RequestIds`]).

use crate::errors::GatewayError;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A client's request id longer than this is replaced by one made here.
const MAX_REQUEST_ID: usize = 128;

pub struct Record {
    pub start: Instant,
    /// `x-request-id`: the client's, or made here.
    pub request_id: Option<http::HeaderValue>,
    /// Its OpenTelemetry span, when `telemetry` exports them.
    pub span: Option<crate::telemetry::RequestSpan>,
    /// The model its body named (kept for a sampled span).
    pub model: Option<Box<str>>,
    /// The error the gateway answered, if it did.
    pub error: Option<GatewayError>,
}

impl Record {
    pub fn new() -> Record {
        Record {
            start: Instant::now(),
            request_id: None,
            span: None,
            model: None,
            error: None,
        }
    }

    /// Its request id as text ("" when it has none).
    pub fn request_id(&self) -> &str {
        self.request_id
            .as_ref()
            .map_or("", |v| v.to_str().unwrap_or_default())
    }

    /// Its span is sampled: the model is worth keeping.
    pub fn sampled(&self) -> bool {
        self.span.as_ref().is_some_and(|s| s.sampled())
    }
}

/// Request ids made here: a random per-process start, then counting.
pub struct RequestIds {
    next: AtomicU64,
    prefix: u64,
}

impl RequestIds {
    pub fn new() -> RequestIds {
        RequestIds {
            next: AtomicU64::new(rand::random::<u64>() & !0xffff_ffff),
            prefix: rand::random::<u64>(),
        }
    }

    /// The request's id: the client's own when it is a short printable
    /// token, else a new one (32 hex digits, unique per process run).
    pub fn id(&self, headers: &http::HeaderMap) -> http::HeaderValue {
        if let Some(v) = headers.get(&crate::headers::REQUEST_ID) {
            let b = v.as_bytes();
            if !b.is_empty() && b.len() <= MAX_REQUEST_ID && b.iter().all(|c| c.is_ascii_graphic())
            {
                return v.clone();
            }
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let mut hex = [0u8; 32];
        for (i, byte) in self
            .prefix
            .to_be_bytes()
            .iter()
            .chain(n.to_be_bytes().iter())
            .enumerate()
        {
            const DIGITS: &[u8; 16] = b"0123456789abcdef";
            hex[2 * i] = DIGITS[(byte >> 4) as usize];
            hex[2 * i + 1] = DIGITS[(byte & 15) as usize];
        }
        http::HeaderValue::from_bytes(&hex).expect("hex digits")
    }
}
