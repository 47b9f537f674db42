//! The headers the gateway reads and writes of its own (SPEC §4).

use http::HeaderName;

/// A request's tier; the tier that served an answer.
pub const TIER: HeaderName = HeaderName::from_static("x-agent-serve-tier");
/// The backend that served an answer.
pub const BACKEND: HeaderName = HeaderName::from_static("x-agent-serve-backend");
/// Whether an answer's backend was its session's binding.
pub const HIT: HeaderName = HeaderName::from_static("x-agent-serve-affinity-hit");
/// A backend named by id (`affinity.allow_explicit_target`).
pub const TARGET: HeaderName = HeaderName::from_static("x-agent-serve-backend-id");
/// The request id: echoed when the client sends one, else made here; it
/// goes upstream, back in the answer, and into logs and the trace.
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
