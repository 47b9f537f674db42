//! The request's path through Pingora's hooks (SPEC §3–§4), one module per
//! phase; the `impl ProxyHttp` below only delegates:
//!
//! - `request.rs` (`request_filter`, `request_body_filter`): validate headers
//!   and size; read the body only when routing needs it; resolve tier,
//!   session and parent keys;
//! - `peer.rs` (`upstream_peer`, `fail_to_connect`, `error_while_proxy`): pick
//!   the backend (binding, else first placement; least in flight without a
//!   session) and lease the binding; next candidate on a connect failure;
//!   replay on a dead pooled connection; passive-health outcomes;
//! - `modify.rs` (`upstream_request_filter`, `response_filter`,
//!   `response_body_filter`): headers, response metadata, usage;
//! - `finish.rs` (`fail_to_proxy`, `logging`): error answers, metrics, traces.
//!   The lease and in-flight count end when the context drops.

pub mod conn_guard;
pub mod errors;
mod finish;
mod modify;
mod peer;
mod request;
pub mod request_body;
pub mod response;
pub mod upstream_conn;
mod websocket;

use crate::affinity::hrw::KeyKind;
use crate::affinity::prefix::PromptRoute;
use crate::affinity::session::{self, BodyProbe, SessionId};
use crate::affinity::{Candidate, Lease, Reason, SessionRef, WaitEnd};
use crate::gateway::Gateway;
use crate::upstream::outlier::Outcome;
use crate::upstream::{Backend, BackendStats, Routing, Tier};
use async_trait::async_trait;
use bytes::Bytes;
use errors::GatewayError;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorSource, ErrorType, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};
use request_body::PreReadError;
use response::{JsonAppender, UsageScanner};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

pub const TIER_HEADER: &str = "x-agent-serve-tier";
pub const BACKEND_HEADER: &str = "x-agent-serve-backend";
pub const HIT_HEADER: &str = "x-agent-serve-affinity-hit";
pub const TARGET_HEADER: &str = "x-agent-serve-backend-id";

pub struct GatewayProxy {
    gw: Arc<Gateway>,
    /// Rotates ties among equally loaded backends for session-less requests.
    tiebreak: AtomicUsize,
    /// Request ids made here (`x-request-id`): a random per-process start,
    /// then counting.
    request_ids: std::sync::atomic::AtomicU64,
    request_ids_prefix: u64,
}

/// The request id header: echoed when the client sends one, else made here;
/// it goes upstream, back in the answer, and into logs and the trace.
pub const REQUEST_ID_HEADER: http::HeaderName = http::HeaderName::from_static("x-request-id");

/// A client's request id longer than this is replaced by one made here.
const MAX_REQUEST_ID: usize = 128;

impl GatewayProxy {
    /// The request's id: the client's own when it is a short printable
    /// token, else a new one (32 hex digits, unique per process run).
    fn request_id(&self, headers: &http::HeaderMap) -> http::HeaderValue {
        if let Some(v) = headers.get(&REQUEST_ID_HEADER) {
            let b = v.as_bytes();
            if !b.is_empty() && b.len() <= MAX_REQUEST_ID && b.iter().all(|c| c.is_ascii_graphic())
            {
                return v.clone();
            }
        }
        let n = self.request_ids.fetch_add(1, Ordering::Relaxed);
        let mut hex = [0u8; 32];
        let (hi, lo) = (self.request_ids_prefix, n);
        for (i, byte) in hi
            .to_be_bytes()
            .iter()
            .chain(lo.to_be_bytes().iter())
            .enumerate()
        {
            const DIGITS: &[u8; 16] = b"0123456789abcdef";
            hex[2 * i] = DIGITS[(byte >> 4) as usize];
            hex[2 * i + 1] = DIGITS[(byte & 15) as usize];
        }
        http::HeaderValue::from_bytes(&hex).expect("hex digits")
    }
}

impl GatewayProxy {
    pub fn new(gw: Arc<Gateway>) -> Self {
        GatewayProxy {
            gw,
            tiebreak: AtomicUsize::new(0),
            request_ids: std::sync::atomic::AtomicU64::new(rand::random::<u64>() & !0xffff_ffff),
            request_ids_prefix: rand::random::<u64>(),
        }
    }
}

/// Counts a request against its backend's in-flight total until dropped.
struct InFlight {
    stats: Arc<BackendStats>,
    /// No other request of this gateway was in flight at the backend when
    /// this one was sent: its TTFB is the backend's speed, not its queue.
    alone: bool,
    /// Its place in the backend's queued prefill work, where its estimated
    /// tokens count until its first byte comes back (ticket 0 once it has),
    /// and the queued tokens it was sent behind.
    queued: crate::upstream::cost::Enqueued,
    /// The backend answered it out of the order it was sent in (it overtook
    /// a request sent before it, or one sent after overtook it): its time to
    /// first byte explains neither its own prefill nor the queue's.
    out_of_order: bool,
    /// The share of its prompt it was expected to find uncached there.
    uncached_share: f64,
    /// When it was sent on (after any wait for a slot): its time to first
    /// byte, as the backend's speed explains it, starts here.
    sent: Instant,
    /// Its estimated uncached tokens.
    tokens: u64,
}

impl InFlight {
    /// `tokens` of the `prompt` tokens (estimates) are expected uncached.
    fn new(stats: &Arc<BackendStats>, tokens: u64, prompt: u64) -> Self {
        let before = stats.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight {
            stats: Arc::clone(stats),
            alone: before == 0 && stats.engine.requests_if_fresh() == 0,
            queued: stats.cost.enqueue(tokens),
            out_of_order: false,
            uncached_share: match prompt {
                0 => 1.0,
                p => (tokens as f64 / p as f64).min(1.0),
            },
            sent: Instant::now(),
            tokens,
        }
    }

    /// The first byte came back: its prefill no longer waits ahead of others.
    fn prefilled(&mut self) {
        let ticket = std::mem::take(&mut self.queued.ticket);
        if ticket != 0 {
            self.out_of_order = !self.stats.cost.dequeue(ticket);
        }
    }

    /// The prefill work it was sent behind, if any and known, in whatever
    /// order it was answered: what [`Admission::vote_prefill`] asks of it.
    ///
    /// [`Admission::vote_prefill`]: crate::admission::Admission::vote_prefill
    fn sent_behind(&self) -> Option<std::time::Duration> {
        let ns = self.queued.work_ahead_ns;
        (self.queued.behind && ns > 0).then_some(std::time::Duration::from_nanos(ns))
    }

    /// Sent with no other prefill queued, and answered in order: its time to
    /// first byte is its own prefill's.
    fn on_its_own(&self) -> bool {
        !self.queued.behind && !self.out_of_order
    }

    /// What its answer may teach about the backend's speed, as
    /// [`crate::upstream::cost::CostEstimate::observe`] takes it: whether it
    /// was served alone, and the queue it was served behind.
    fn explains(&self) -> (bool, Option<u64>) {
        match self.out_of_order {
            true => (false, None),
            false => (self.alone, self.queued.behind()),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        // Still queued: it ended without a first byte.
        self.stats
            .cost
            .abandon(std::mem::take(&mut self.queued.ticket));
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Everything later hooks need to know about one request.
pub struct RequestCtx {
    start: Instant,
    routing: Option<Arc<Routing>>,
    tier: Option<Arc<Tier>>,
    /// The session id as the client sent it (for metadata and traces).
    session: Option<SessionId>,
    parent: Option<String>,
    /// What the binding table is keyed with (the group for subagents).
    session_ref: Option<SessionRef>,
    /// The request's prompt as routing reads it, and where it went
    /// (`affinity.prefix`). Boxed: the context moves with the request's
    /// future, and most keyed turns carry none.
    prefix: Option<Box<PromptRoute>>,
    /// The whole body, when it was read before routing or kept for a replay.
    body: Option<Bytes>,
    /// `body` counted against the gateway's body budget.
    body_hold: Option<request_body::BodyHold>,
    body_bytes: u64,
    /// The request's Content-Length, as `request_filter` read and checked it.
    declared_len: Option<u64>,
    /// The request was re-sent on a fresh connection (see upstream_conn.rs).
    replayed: bool,
    /// Its passive-health outcome is recorded (see `settle_outcome`).
    outcome_settled: bool,
    backend: Option<Arc<Backend>>,
    affinity_hit: bool,
    reason: Option<Reason>,
    moved: Option<crate::affinity::policy::MoveReason>,
    lease: Option<Lease>,
    in_flight: Option<InFlight>,
    /// Backends that refused a connection for this request.
    excluded: Vec<u32>,
    error: Option<GatewayError>,
    /// `x-request-id`: the client's, or made here.
    request_id: Option<http::HeaderValue>,
    /// `x-agent-serve-backend-id`, when allowed.
    explicit_target: Option<String>,
    /// Close the binding once this request ends.
    session_final: bool,
    appender: Option<JsonAppender>,
    /// The backend's declared body length and what has arrived of it, so the
    /// metadata is merged into the last chunk rather than sent on its own.
    upstream_body_len: Option<usize>,
    upstream_body_seen: usize,
    usage: Option<UsageScanner>,
    first_byte: Option<Instant>,
    /// The answer is a server-sent-event stream: its first byte came when
    /// its prefill was done. A JSON answer's first byte comes after its
    /// whole decode.
    streamed: bool,
    /// Whether the request asked for a stream (`None`: its body was not read).
    asks_stream: Option<bool>,
    /// A body not read before it was admitted: how long its prefill should
    /// take, and whether it was seen to ask for a stream on its way.
    prefill_clock: Option<(std::time::Duration, bool)>,
    /// The client connection's limits (HTTP/1 on a proxy listener).
    conn: Option<Arc<conn_guard::ConnState>>,
    /// Who sent it and how it is admitted: see [`Admittance`].
    who: crate::admission::Admittance,
    /// A Responses request: the scope (tier and tenant) its answer's
    /// response id is kept under, for the follow-ups that name it.
    responses_scope: Option<String>,
    /// It follows a stored response (`previous_response_id`): the backend
    /// slot that holds it, and its id.
    stored_at: Option<(u32, String)>,
    /// The answer's start, read for its response id.
    response_id: Option<response::ResponseIdScanner>,
    /// Its OpenTelemetry span, when `telemetry` exports them.
    span: Option<crate::telemetry::RequestSpan>,
    /// The model its body named (kept for a sampled span).
    model: Option<Box<str>>,
    /// The backend switched protocols: the socket's frames, followed.
    websocket: Option<Box<websocket::WebSocket>>,
}

impl RequestCtx {
    /// Tokens of the prompt the prefix index said its backend held, when
    /// the prompt was looked up.
    fn prefix_tokens(&self) -> Option<u64> {
        self.prefix.as_ref()?.prefix_tokens()
    }

    fn tier_name(&self) -> Option<&str> {
        self.tier.as_deref().map(|t| &*t.name)
    }

    /// The `x_agent_serve` member merged into JSON responses, written directly
    /// (this runs once per response; a `serde_json::Value` would allocate a map).
    fn metadata_member(&self, backend: &Backend, tier: &Tier) -> Vec<u8> {
        fn string(out: &mut Vec<u8>, s: &str) {
            // serde_json escapes exactly as JSON requires; writing to a Vec cannot fail.
            let _ = serde_json::to_writer(&mut *out, s);
        }
        let mut out = Vec::with_capacity(160);
        out.extend_from_slice(b"\"x_agent_serve\":{\"backend\":");
        string(&mut out, &backend.id);
        out.extend_from_slice(b",\"affinity_hit\":");
        out.extend_from_slice(if self.affinity_hit { b"true" } else { b"false" });
        out.extend_from_slice(b",\"tier\":");
        string(&mut out, &tier.name);
        out.extend_from_slice(b",\"session\":");
        match &self.session {
            Some(s) => string(&mut out, &s.id),
            None => out.extend_from_slice(b"null"),
        }
        out.extend_from_slice(b",\"reason\":");
        match self.reason {
            Some(r) => string(&mut out, r.as_str()),
            None => out.extend_from_slice(b"null"),
        }
        if let Some(tokens) = self.prefix_tokens() {
            out.extend_from_slice(b",\"prefix_tokens\":");
            out.extend_from_slice(tokens.to_string().as_bytes());
        }
        out.push(b'}');
        out
    }
}

impl GatewayProxy {
    /// Record `e` as this request's answer and turn it into a hook error.
    fn fail(&self, ctx: &mut RequestCtx, e: GatewayError) -> Box<pingora_core::Error> {
        let pe = e.to_pingora();
        ctx.error = Some(e);
        pe
    }
}

#[async_trait]
impl ProxyHttp for GatewayProxy {
    type CTX = RequestCtx;

    /// What Pingora's own error lines say about a request ("Fail to
    /// proxy: …"): its summary and its `x-request-id`.
    fn request_summary(&self, session: &Session, ctx: &RequestCtx) -> String {
        let summary = session.as_ref().request_summary();
        match ctx.request_id.as_ref().and_then(|v| v.to_str().ok()) {
            Some(id) => format!("{summary}, request id {id}"),
            None => summary,
        }
    }

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            start: Instant::now(),
            routing: None,
            tier: None,
            session: None,
            parent: None,
            session_ref: None,
            prefix: None,
            body: None,
            body_hold: None,
            body_bytes: 0,
            declared_len: None,
            replayed: false,
            outcome_settled: false,
            backend: None,
            affinity_hit: false,
            reason: None,
            moved: None,
            lease: None,
            in_flight: None,
            excluded: Vec::new(),
            error: None,
            request_id: None,
            explicit_target: None,
            session_final: false,
            appender: None,
            upstream_body_len: None,
            upstream_body_seen: 0,
            usage: None,
            first_byte: None,
            streamed: false,
            asks_stream: None,
            prefill_clock: None,
            conn: None,
            who: Default::default(),
            responses_scope: None,
            stored_at: None,
            response_id: None,
            span: None,
            model: None,
            websocket: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        self.on_request(session, ctx).await
    }

    async fn request_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.on_request_body(session, body, end_of_stream, ctx)
            .await
    }

    async fn upstream_peer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        self.choose_peer(session, ctx).await
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        reused: bool,
        peer: &HttpPeer,
        #[cfg(unix)] fd: std::os::unix::io::RawFd,
        #[cfg(windows)] _sock: std::os::windows::io::RawSocket,
        _digest: Option<&pingora_core::protocols::Digest>,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        #[cfg(unix)]
        if reused {
            if let Some(b) = ctx
                .backend
                .as_ref()
                // A request that waited for its slot may find the backend
                // gone meanwhile (a crash frees the slot it then takes):
                // its pooled connection is looked at first too.
                .filter(|b| ctx.who.waited || upstream_conn::peek_before_reuse(&b.stats))
            {
                if upstream_conn::peer_closed(fd, peer.is_tls()) {
                    upstream_conn::closes_pooled(&b.stats);
                    return Err(upstream_conn::closed_in_pool());
                }
            }
        }
        // The first request of a new session reached its backend: requests of
        // the same session waiting on it may follow now.
        if let Some(lease) = ctx.lease.as_mut() {
            lease.confirm();
        }
        Ok(())
    }

    fn fail_to_connect(
        &self,
        session: &mut Session,
        peer: &HttpPeer,
        ctx: &mut RequestCtx,
        e: Box<Error>,
    ) -> Box<Error> {
        self.on_connect_failure(session, peer, ctx, e)
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut RequestCtx,
        client_reused: bool,
    ) -> Box<Error> {
        self.on_proxy_error(peer, session, e, ctx, client_reused)
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.modify_upstream_request(session, upstream_request, ctx)
            .await
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        self.modify_response(session, resp, ctx).await
    }

    fn response_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<std::time::Duration>> {
        self.modify_response_body(session, body, end_of_stream, ctx)
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy
    where
        RequestCtx: Send + Sync,
    {
        self.answer_failure(session, e, ctx).await
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        self.finish(session, e, ctx).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_that_overtook_a_long_prefill_teaches_no_cost() {
        let stats = Arc::new(BackendStats::new("b"));
        // A 7,000-token prefill is sent alone, a 300-token prompt behind it;
        // the engine answers the short one first (it reached the engine
        // first, or was batched ahead).
        let mut long = InFlight::new(&stats, 7_000, 7_000);
        let mut short = InFlight::new(&stats, 300, 300);
        assert_eq!(long.explains(), (true, None));
        assert_eq!(short.explains(), (false, Some(7_000)));
        short.prefilled();
        long.prefilled();
        // Its 30 ms would read as 30 ms for 7,300 tokens (4 µs a token)
        // were it taken as served behind the long one; neither is taken.
        assert_eq!(short.explains(), (false, None));
        assert_eq!(long.explains(), (false, None));
        drop((long, short));
        // Served in order, each explains what it was sent behind.
        let mut first = InFlight::new(&stats, 1_000, 1_000);
        let mut second = InFlight::new(&stats, 1_000, 1_000);
        first.prefilled();
        second.prefilled();
        assert_eq!(first.explains(), (true, None));
        assert_eq!(second.explains(), (false, Some(1_000)));
    }
}
