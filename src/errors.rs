//! The gateway's own error responses: JSON in the OpenAI shape (SPEC §8).
//! Any layer that refuses a request (routing, admission, the proxy's
//! checks) says why with a [`GatewayError`]; the proxy writes it.

use bytes::Bytes;
use pingora_core::{Error, ErrorType, Result};
use pingora_http::ResponseHeader;
use pingora_proxy::Session;

/// How long a refused request's remaining body is read and discarded.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);

/// Why a request goes no further.
#[derive(Debug)]
pub enum Refusal {
    /// The answer that says so.
    Answer(GatewayError),
    /// Its client left while it waited (for its session's placement, for a
    /// slot): there is no one to answer.
    ClientGone(&'static str),
}

impl From<GatewayError> for Refusal {
    fn from(e: GatewayError) -> Self {
        Refusal::Answer(e)
    }
}

/// An error the gateway answers itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayError {
    pub status: u16,
    pub kind: &'static str,
    pub code: &'static str,
    pub message: String,
    /// Seconds for `Retry-After` (a 503 says 1 when this is unset).
    pub retry_after: Option<u64>,
}

impl GatewayError {
    /// 429: the request's backend has no slot for it in time, or the queue
    /// is full (`code` says which); retry after `retry_after` s.
    pub fn overloaded(code: &'static str, message: String, retry_after: u64) -> Self {
        GatewayError {
            status: 429,
            kind: "rate_limit_error",
            code,
            message,
            retry_after: Some(retry_after),
        }
    }
    /// 429: the tenant is over one of its limits.
    pub fn over_limit(limit: &str, tenant: &str, retry_after: u64) -> Self {
        GatewayError {
            status: 429,
            kind: "rate_limit_error",
            code: "rate_limit_exceeded",
            message: format!("tenant `{tenant}` is over its {limit}"),
            retry_after: Some(retry_after),
        }
    }
    /// 401: no known client key where keys are required.
    pub fn unauthorized() -> Self {
        GatewayError {
            status: 401,
            kind: "authentication_error",
            code: "invalid_api_key",
            message: "a known client key is required (Authorization: Bearer <key> or x-api-key)"
                .into(),
            retry_after: None,
        }
    }
    pub fn bad_priority(header: &str) -> Self {
        GatewayError {
            status: 400,
            kind: "invalid_request_error",
            code: "invalid_priority",
            message: format!("{header} must be interactive, normal or batch"),
            retry_after: None,
        }
    }
    pub fn bad_session_header(message: String) -> Self {
        GatewayError {
            status: 400,
            kind: "invalid_request_error",
            code: "invalid_session_header",
            message,
            retry_after: None,
        }
    }
    pub fn unknown_tier(message: String) -> Self {
        GatewayError {
            status: 404,
            kind: "invalid_request_error",
            code: "unknown_tier",
            message,
            retry_after: None,
        }
    }
    pub fn body_too_large(limit: u64) -> Self {
        GatewayError {
            status: 413,
            kind: "invalid_request_error",
            code: "request_too_large",
            message: format!("request body is larger than the gateway's limit of {limit} bytes"),
            retry_after: None,
        }
    }
    pub fn length_required() -> Self {
        GatewayError {
            status: 411,
            kind: "invalid_request_error",
            code: "length_required",
            message:
                "a body this gateway must read to route (over 64 KiB) needs a Content-Length header"
                    .into(),
            retry_after: None,
        }
    }
    pub fn bad_path(message: String) -> Self {
        GatewayError {
            status: 400,
            kind: "invalid_request_error",
            code: "invalid_path",
            message,
            retry_after: None,
        }
    }
    pub fn bad_body(message: String) -> Self {
        GatewayError {
            status: 400,
            kind: "invalid_request_error",
            code: "invalid_body",
            message,
            retry_after: None,
        }
    }
    pub fn no_healthy_backend(tier: &str) -> Self {
        GatewayError {
            status: 503,
            kind: "service_unavailable",
            code: "no_healthy_backend",
            message: format!("no healthy backend in tier `{tier}`"),
            retry_after: None,
        }
    }
    pub fn all_candidates_failed(tier: &str) -> Self {
        GatewayError {
            status: 502,
            kind: "bad_gateway",
            code: "all_backends_failed",
            message: format!("every backend of tier `{tier}` failed to accept the request"),
            retry_after: None,
        }
    }
    pub fn explicit_target_forbidden() -> Self {
        GatewayError {
            status: 403,
            kind: "permission_error",
            code: "explicit_target_forbidden",
            message:
                "x-agent-serve-backend-id is not allowed (affinity.allow_explicit_target is off)"
                    .into(),
            retry_after: None,
        }
    }
    pub fn unknown_backend(id: &str, tier: &str) -> Self {
        GatewayError {
            status: 404,
            kind: "invalid_request_error",
            code: "unknown_backend",
            message: format!("tier `{tier}` has no backend `{id}`"),
            retry_after: None,
        }
    }
    /// 404: a Responses request names a stored response whose backend is
    /// gone (down, draining, removed, or refusing connections), and with it
    /// the chain's state: no other replica has it.
    /// 404: `id` is no response this client may continue (another
    /// tenant's, or not one this fleet issued); said as an engine says it.
    pub fn response_not_found(id: &str) -> Self {
        GatewayError {
            status: 404,
            kind: "invalid_request_error",
            code: "previous_response_not_found",
            message: format!("Response with id '{id}' not found."),
            retry_after: None,
        }
    }

    pub fn previous_response_not_found(id: &str, why: &str) -> Self {
        GatewayError {
            status: 404,
            kind: "invalid_request_error",
            code: "previous_response_not_found",
            message: format!(
                "Response with id '{id}' not found: {why}; its state was stored there alone. \
                 Start the conversation again with its whole input."
            ),
            retry_after: None,
        }
    }
    pub fn backend_unavailable(id: &str) -> Self {
        GatewayError {
            status: 503,
            kind: "service_unavailable",
            code: "backend_unavailable",
            message: format!("backend `{id}` is not healthy"),
            retry_after: None,
        }
    }
    pub fn upstream_failed(detail: String) -> Self {
        GatewayError {
            status: 502,
            kind: "bad_gateway",
            code: "backend_error",
            message: detail,
            retry_after: None,
        }
    }
    pub fn busy_reading_bodies() -> Self {
        GatewayError {
            status: 503,
            kind: "service_unavailable",
            code: "gateway_busy",
            message: "the gateway is holding as many request bodies as its memory budget allows; retry shortly".into(),
            retry_after: None,
        }
    }
    pub fn headers_too_large(limit: usize) -> Self {
        GatewayError {
            status: 431,
            kind: "invalid_request_error",
            code: "headers_too_large",
            message: format!(
                "request line and headers are larger than the gateway's limit of {limit} bytes"
            ),
            retry_after: None,
        }
    }
    pub fn missing_host() -> Self {
        GatewayError {
            status: 400,
            kind: "invalid_request_error",
            code: "missing_host",
            message: "an HTTP/1.1 request needs a Host header (RFC 9112 §3.2)".into(),
            retry_after: None,
        }
    }

    pub fn request_timeout(kind: &str) -> Self {
        GatewayError {
            status: 408,
            kind: "invalid_request_error",
            code: "request_timeout",
            message: match kind {
                "body_rate" => "the request body arrived below the gateway's minimum rate",
                "body_idle" => "the request body stalled",
                _ => "the request did not arrive in time",
            }
            .into(),
            retry_after: None,
        }
    }

    pub fn upstream_timeout(detail: String) -> Self {
        GatewayError {
            status: 504,
            kind: "gateway_timeout",
            code: "backend_timeout",
            message: detail,
            retry_after: None,
        }
    }

    pub fn body(&self) -> Bytes {
        let v = serde_json::json!({
            "error": {"message": self.message, "type": self.kind, "code": self.code}
        });
        Bytes::from(v.to_string())
    }

    /// A Pingora error carrying this status, for returning from a hook.
    pub fn to_pingora(&self) -> Box<Error> {
        Error::explain(ErrorType::HTTPStatus(self.status), self.message.clone())
    }

    /// Write this error as the whole response. The connection is not reused
    /// when the request body may not have been read.
    /// `backend`: the one that failed, when it did (a 502 or 504).
    pub async fn write(
        &self,
        session: &mut Session,
        tier: Option<&str>,
        backend: Option<&str>,
        request_id: Option<&http::HeaderValue>,
    ) -> Result<()> {
        let body = self.body();
        let mut resp = ResponseHeader::build(self.status, Some(5))?;
        if let Some(id) = request_id {
            resp.insert_header(crate::headers::REQUEST_ID, id.clone())?;
        }
        resp.insert_header("content-type", "application/json")?;
        resp.insert_header("content-length", body.len().to_string())?;
        if let Some(t) = tier {
            resp.insert_header(crate::headers::TIER, t)?;
        }
        if let Some(b) = backend {
            resp.insert_header(crate::headers::BACKEND, b)?;
        }
        if let Some(s) = self.retry_after.or((self.status == 503).then_some(1)) {
            resp.insert_header("retry-after", s.to_string())?;
        }
        let unread_body = !session.is_body_done();
        // A body that could not be read (cut short, bad chunking) leaves the
        // connection's framing unknown: it cannot carry another request.
        if unread_body || self.code == "invalid_body" {
            session.set_keepalive(None);
        }
        session.write_response_header(Box::new(resp), false).await?;
        session.write_response_body(Some(body), true).await?;
        if unread_body {
            // Lingering close (as nginx does): a client still sending a body
            // we refused would otherwise meet a reset, which can destroy the
            // answer before it reads it. Read and discard for a short while.
            session.set_total_drain_timeout(Some(LINGER));
            let _ = session.drain_request_body().await;
        }
        Ok(())
    }
}
