//! The request's path through Pingora's hooks (SPEC §3–§4):
//!
//! - `request_filter`: validate session headers, size; read the body only when
//!   routing needs it; resolve tier, session and parent keys;
//! - `upstream_peer`: pick the backend (binding, else HRW; least in-flight for
//!   requests without a session) and lease the binding;
//! - `fail_to_connect`: exclude that backend and retry the next candidate;
//! - `response_filter` / `response_body_filter`: response metadata, usage;
//! - `logging`: metrics. The lease and in-flight count end when the context drops.

pub mod conn_guard;
pub mod errors;
pub mod request_body;
pub mod response;
pub mod upstream_conn;

use crate::affinity::hrw::KeyKind;
use crate::affinity::session::{self, BodyProbe, SessionId};
use crate::affinity::{Candidate, Choice, Lease, Reason, SessionRef};
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

/// The tenant part of a binding's scope: empty when tenants are not configured.
fn tenant_scope(
    cfg: &crate::config::Config,
    headers: &http::HeaderMap,
    hasher: &crate::affinity::hrw::HrwHasher,
) -> std::result::Result<String, GatewayError> {
    use crate::config::TenantSource;
    let value = match &cfg.affinity.tenant {
        TenantSource::None => return Ok(String::new()),
        TenantSource::Header(h) => headers.get(h.as_str()),
        TenantSource::Authorization => headers.get("authorization"),
    };
    let Some(v) = value else {
        return Ok("\u{0}-".to_string());
    };
    if v.len() > 4096 {
        return Err(GatewayError::bad_session_header(
            "tenant header is longer than 4096 bytes".into(),
        ));
    }
    // Keyed, so credentials never appear in the table, logs or hashes' inputs as is.
    let id = hasher.fingerprint(
        KeyKind::Session,
        "tenant",
        &String::from_utf8_lossy(v.as_bytes()),
    );
    Ok(format!("\u{0}{id:032x}"))
}

/// Whether the client has closed its connection (FIN or RST seen). Used while
/// a request waits, when no read on the socket is in progress.
fn client_gone(session: &Session) -> bool {
    const TCP_ESTABLISHED: u8 = 1;
    session
        .as_downstream()
        .digest()
        .and_then(|d| d.socket_digest.as_ref())
        .and_then(|s| s.tcp_info())
        .is_some_and(|info| info.tcpi_state != TCP_ESTABLISHED)
}

pub struct GatewayProxy {
    gw: Arc<Gateway>,
    /// Rotates ties among equally loaded backends for session-less requests.
    tiebreak: AtomicUsize,
    /// Request ids for traces: a random per-process start, then counting.
    request_ids: std::sync::atomic::AtomicU64,
}

impl GatewayProxy {
    pub fn new(gw: Arc<Gateway>) -> Self {
        GatewayProxy {
            gw,
            tiebreak: AtomicUsize::new(0),
            request_ids: std::sync::atomic::AtomicU64::new(rand::random::<u64>() & !0xffff_ffff),
        }
    }
}

/// Counts a request against its backend's in-flight total until dropped.
struct InFlight(Arc<BackendStats>);

impl InFlight {
    fn new(stats: &Arc<BackendStats>) -> Self {
        stats.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(stats))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Everything later hooks need to know about one request.
pub struct RequestCtx {
    start: Instant,
    /// Wall-clock start, for traces.
    start_wall: std::time::SystemTime,
    routing: Option<Arc<Routing>>,
    tier: Option<Arc<Tier>>,
    /// The session id as the client sent it (for metadata and traces).
    session: Option<SessionId>,
    parent: Option<String>,
    /// What the binding table is keyed with (the group for subagents).
    session_ref: Option<SessionRef>,
    /// The whole body, when it was read before routing or kept for a replay.
    body: Option<Bytes>,
    /// `body` counted against the gateway's body budget.
    body_hold: Option<request_body::BodyHold>,
    body_bytes: u64,
    /// The request was re-sent on a fresh connection (see upstream_conn.rs).
    replayed: bool,
    backend: Option<Arc<Backend>>,
    affinity_hit: bool,
    reason: Option<Reason>,
    moved: Option<crate::affinity::policy::MoveReason>,
    lease: Option<Lease>,
    in_flight: Option<InFlight>,
    /// Backends that refused a connection for this request.
    excluded: Vec<u32>,
    error: Option<GatewayError>,
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
    /// The client connection's limits (HTTP/1 on a proxy listener).
    conn: Option<Arc<conn_guard::ConnState>>,
}

impl RequestCtx {
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
        out.push(b'}');
        out
    }
}

/// About what the request line and headers took on the wire.
fn header_bytes(req: &RequestHeader) -> usize {
    let uri = req.uri.path_and_query().map_or(1, |p| p.as_str().len())
        + req.uri.authority().map_or(0, |a| a.as_str().len());
    fields_bytes(&req.headers, req.method.as_str().len() + uri + 12)
}

fn fields_bytes(headers: &http::HeaderMap, start: usize) -> usize {
    headers
        .iter()
        .fold(start, |n, (k, v)| n + k.as_str().len() + v.len() + 4)
}

fn method_has_body(req: &RequestHeader) -> bool {
    !matches!(
        req.method,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS | http::Method::DELETE
    )
}

impl GatewayProxy {
    /// Everything `request_filter` decides; `Err` is answered to the client.
    async fn route_request(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> std::result::Result<(), GatewayError> {
        let routing = self.gw.routing();
        let cfg = &routing.config;
        let req = session.req_header();
        if req.version == http::Version::HTTP_11 && !req.headers.contains_key(http::header::HOST) {
            return Err(GatewayError::missing_host());
        }
        let limit = cfg.server.client.max_header_bytes;
        if header_bytes(req) > limit {
            return Err(GatewayError::headers_too_large(limit));
        }
        let headers = &req.headers;
        let session_id = session::from_headers(headers, &cfg.affinity.session_headers)
            .map_err(|e| GatewayError::bad_session_header(e.to_string()))?;
        let parent = session::from_headers(headers, &cfg.affinity.parent_session_headers)
            .map_err(|e| GatewayError::bad_session_header(e.to_string()))?;
        let parent_agent = session::from_headers(headers, &cfg.affinity.parent_agent_headers)
            .map_err(|e| GatewayError::bad_session_header(e.to_string()))?;
        ctx.session_final = cfg.affinity.session_final_headers.iter().any(|h| {
            headers
                .get(h.as_str())
                .is_some_and(|v| matches!(v.as_bytes(), b"true" | b"1" | b"TRUE" | b"True"))
        });
        if let Some(target) = headers.get(TARGET_HEADER) {
            if !cfg.affinity.allow_explicit_target {
                return Err(GatewayError::explicit_target_forbidden());
            }
            ctx.explicit_target = Some(String::from_utf8_lossy(target.as_bytes()).into_owned());
        }
        let scope_suffix = tenant_scope(cfg, headers, &routing.hasher)?;
        let tier_header = match headers.get(TIER_HEADER) {
            Some(v) => Some(
                v.to_str()
                    .map_err(|_| GatewayError::unknown_tier("invalid tier header".into()))?
                    .to_string(),
            ),
            None => None,
        };
        let declared = request_body::content_length(session)?;
        let limit = cfg.server.max_body_bytes;
        if declared.is_some_and(|len| len > limit) {
            return Err(GatewayError::body_too_large(limit));
        }

        let mut tier = match &tier_header {
            Some(name) => Some(Arc::clone(routing.tier_by_name(name).ok_or_else(|| {
                GatewayError::unknown_tier(format!("unknown tier `{name}`"))
            })?)),
            None => None,
        };
        let mut session_id = session_id;
        let needs_body = method_has_body(session.req_header())
            && declared != Some(0)
            && ((tier.is_none() && routing.routes_by_model())
                || (session_id.is_none() && !cfg.affinity.body_session_fields.is_empty()));
        // A body larger than Pingora's retry buffer is kept whole (within the
        // budget) so that a request meeting a dead pooled connection can be
        // re-sent; smaller ones Pingora's own buffer replays.
        let replay_hold = match declared {
            Some(len)
                if !needs_body
                    && len > request_body::RETRY_BUFFER_BYTES
                    && len <= cfg.server.replay_body_bytes =>
            {
                self.gw
                    .body_budget
                    .try_hold(len, cfg.server.replay_budget_bytes)
            }
            _ => None,
        };
        // Bodies read to route count against a global budget: a burst of
        // large ones is refused (retry later) instead of exhausting memory.
        let route_hold = if needs_body {
            let reserve = declared.unwrap_or(request_body::UNKNOWN_LENGTH_RESERVE);
            match self
                .gw
                .body_budget
                .try_hold(reserve.min(limit), cfg.server.preread_budget_bytes)
            {
                Some(h) => Some(h),
                None => return Err(GatewayError::busy_reading_bodies()),
            }
        } else {
            None
        };
        if needs_body || replay_hold.is_some() {
            let body = match request_body::pre_read(session, declared, limit).await {
                Ok(b) => b,
                Err(PreReadError::Refused(e)) => return Err(e),
                Err(PreReadError::Io(e)) => {
                    return Err(self.client_timeout(ctx, &e).unwrap_or_else(|| {
                        GatewayError::bad_body(format!("reading the body: {e}"))
                    }))
                }
            };
            if let Some(conn) = &ctx.conn {
                conn.body_done();
            }
            ctx.body_bytes = body.len() as u64;
            ctx.body_hold = replay_hold.or_else(|| {
                // What the body turned out to be, not what was reserved.
                drop(route_hold);
                Some(self.gw.body_budget.hold(ctx.body_bytes))
            });
            if let Some(probe) = needs_body.then(|| BodyProbe::parse(&body)).flatten() {
                if tier.is_none() {
                    if let Some(model) = probe.model() {
                        tier = routing.tier_by_model(&model).cloned();
                    }
                }
                if session_id.is_none() {
                    session_id = probe.session(&cfg.affinity.body_session_fields);
                }
            }
            ctx.body = Some(body);
        }
        let tier = tier.unwrap_or_else(|| Arc::clone(routing.default_tier()));

        // Bindings are scoped by tier (and tenant, when configured).
        let scope = format!("{}{scope_suffix}", tier.name);
        let h = &routing.hasher;
        ctx.session_ref = match (&parent, &parent_agent, &session_id) {
            // A subagent (Dynamo style): the group of the parent session.
            (Some(p), _, _) => {
                let mut group = SessionRef::new(h, KeyKind::Group, &scope, &p.id);
                group.parent = Some(h.fingerprint(KeyKind::Session, &scope, &p.id));
                Some(group)
            }
            // A subagent (Claude Code style): the group of a parent agent within
            // this session; the session's own binding is the parent to follow.
            (None, Some(agent), Some(s)) => {
                let id = format!("{}\u{1f}{}", s.id, agent.id);
                let mut group = SessionRef::new(h, KeyKind::Group, &scope, &id);
                group.parent = Some(h.fingerprint(KeyKind::Session, &scope, &s.id));
                Some(group)
            }
            (None, _, Some(s)) => Some(SessionRef::new(h, KeyKind::Session, &scope, &s.id)),
            (None, _, None) => None,
        };
        ctx.parent = parent.or(parent_agent).map(|p| p.id);
        ctx.session = session_id;
        ctx.tier = Some(tier);
        ctx.routing = Some(routing);
        Ok(())
    }

    /// Record `e` as this request's answer and turn it into a hook error.
    fn fail(&self, ctx: &mut RequestCtx, e: GatewayError) -> Box<pingora_core::Error> {
        let pe = e.to_pingora();
        ctx.error = Some(e);
        pe
    }

    /// `select_backend`, waiting (bounded) while another request of the same
    /// session is placing it; gives up if the client goes away meanwhile.
    async fn select_waiting(
        &self,
        session: &Session,
        sref: &SessionRef,
        tier: &Tier,
        candidates: &[Candidate],
        owner: bool,
        wait: std::time::Duration,
    ) -> Result<crate::affinity::Selection> {
        let affinity = &self.gw.affinity;
        let deadline = Instant::now() + wait;
        let mut join = owner;
        loop {
            let notified = affinity.waiter(sref.key).notified();
            tokio::pin!(notified);
            // Register before asking, so a confirmation in between is not missed.
            notified.as_mut().enable();
            match affinity.select_backend(sref, tier.index, candidates, join) {
                Some(Choice::Go(sel)) => return Ok(sel),
                Some(Choice::Wait) => {}
                // Only for empty candidates, which the caller rules out.
                None => return Err(GatewayError::no_healthy_backend(&tier.name).to_pingora()),
            }
            let now = Instant::now();
            if now >= deadline {
                // Out of patience: follow the pending placement.
                join = true;
                continue;
            }
            let poll = std::time::Duration::from_millis(25).min(deadline - now);
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(poll) => {
                    if client_gone(session) {
                        return Err(pingora_core::Error::explain(
                            ErrorType::ConnectionClosed,
                            "client left while waiting for its session's placement",
                        )
                        .into_down());
                    }
                }
            }
        }
    }

    /// The 408 for a client that was too slow (its body stalled or crawled),
    /// counted by kind; `None` when `e` is not that.
    fn client_timeout(&self, ctx: &RequestCtx, e: &Error) -> Option<GatewayError> {
        let kind = match ctx.conn.as_ref().and_then(|c| c.cut()) {
            // The wrapper counted its own cut.
            Some(cut) => return Some(GatewayError::request_timeout(cut.as_str())),
            None if e.etype() == &ErrorType::ReadTimedout => "body_idle",
            None => return None,
        };
        self.gw.metrics.timeouts.with_label_values(&[kind]).inc();
        Some(GatewayError::request_timeout(kind))
    }

    /// Feed one request's outcome to its backend's passive health; eject it
    /// when that was one failure too many (and the tier can spare it).
    fn record_outcome(&self, ctx: &RequestCtx, backend: &Backend, outcome: Outcome) {
        let (Some(tier), Some(routing)) = (&ctx.tier, &ctx.routing) else {
            return;
        };
        let cfg = &routing.config.outlier;
        let now = crate::upstream::load::clock_ms();
        let ejected = backend.stats.outlier.record(outcome, cfg, now, || {
            tier.may_eject(cfg.max_ejected_percent)
        });
        if let Some(span) = ejected {
            log::warn!(
                "backend {} ejected for {} s after {} failed requests in a row",
                backend.id,
                span.as_secs(),
                cfg.consecutive_failures
            );
            self.gw
                .metrics
                .backend_ejections
                .with_label_values(&[&tier.name, &backend.id])
                .inc();
        }
    }

    /// What a finished request says about its backend: `None` when the
    /// backend was not at fault either way (the client left, bad input).
    fn outcome(session: &Session, e: Option<&Error>, ctx: &RequestCtx) -> Option<Outcome> {
        if let Some(g) = &ctx.error {
            return matches!(g.code, "backend_error" | "backend_timeout")
                .then_some(Outcome::Failure);
        }
        if e.is_some_and(|e| e.esource() == &ErrorSource::Upstream) {
            return Some(Outcome::Failure);
        }
        let status = session.response_written()?.status.as_u16();
        Some(if status >= 500 {
            Outcome::Failure
        } else {
            Outcome::Success
        })
    }

    fn least_in_flight(&self, tier: &Tier, candidates: &[Candidate]) -> usize {
        // One snapshot: in-flight counts move while we look, and deciding on
        // two different readings can leave no candidate at the minimum.
        let loads: Vec<u64> = candidates
            .iter()
            .map(|c| {
                tier.backend_by_slot(c.slot)
                    .map_or(u64::MAX, |b| b.in_flight())
            })
            .collect();
        let min = loads.iter().copied().min().unwrap_or(0);
        let tied: Vec<usize> = (0..loads.len()).filter(|&i| loads[i] == min).collect();
        let pick = self.tiebreak.fetch_add(1, Ordering::Relaxed);
        // Never empty for the non-empty candidates the caller passes.
        tied.get(pick % tied.len().max(1)).copied().unwrap_or(0)
    }
}

#[async_trait]
impl ProxyHttp for GatewayProxy {
    type CTX = RequestCtx;

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx {
            start: Instant::now(),
            start_wall: std::time::SystemTime::now(),
            routing: None,
            tier: None,
            session: None,
            parent: None,
            session_ref: None,
            body: None,
            body_hold: None,
            body_bytes: 0,
            replayed: false,
            backend: None,
            affinity_hit: false,
            reason: None,
            moved: None,
            lease: None,
            in_flight: None,
            excluded: Vec::new(),
            error: None,
            explicit_target: None,
            session_final: false,
            appender: None,
            upstream_body_len: None,
            upstream_body_seen: 0,
            usage: None,
            first_byte: None,
            conn: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        let limits = self.gw.routing().config.server.client;
        // Pingora's per-read timers: a body that stalls, a client that stops
        // reading its response (the lease and backend connection go with it).
        session.set_read_timeout(Some(limits.body_idle_timeout));
        session.set_write_timeout(Some(limits.write_timeout));
        // Pipelined requests are answered in order instead of dropped.
        session.set_pipelining_enabled(true);
        ctx.conn = conn_guard::GuardedStream::of(session.stream()).cloned();
        if let Some(conn) = &ctx.conn {
            conn.headers_done(!session.is_body_empty());
        }
        match self.route_request(session, ctx).await {
            Ok(()) => Ok(false),
            Err(e) => {
                let tier = ctx.tier_name().map(str::to_string);
                e.write(session, tier.as_deref(), None).await?;
                ctx.error = Some(e);
                Ok(true)
            }
        }
    }

    async fn upstream_peer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        let tier = Arc::clone(ctx.tier.as_ref().expect("routed in request_filter"));
        let routing = Arc::clone(ctx.routing.as_ref().expect("routed in request_filter"));
        // A retry after a connect failure starts over: the failed attempt's
        // in-flight count ends here; its lease is handed over below.
        ctx.in_flight = None;
        let previous_lease = ctx.lease.take();
        let owner = previous_lease.as_ref().is_some_and(|l| l.owns_pending());
        let candidates: Vec<Candidate> = tier
            .backends
            .iter()
            .filter(|b| tier.healthy(b) && !ctx.excluded.contains(&b.slot))
            .map(|b| b.candidate())
            .collect();

        let backend = if let Some(target) = ctx.explicit_target.clone() {
            let Some(b) = tier.backend_by_id(&target) else {
                return Err(self.fail(ctx, GatewayError::unknown_backend(&target, &tier.name)));
            };
            if !candidates.iter().any(|c| c.slot == b.slot) {
                return Err(self.fail(ctx, GatewayError::backend_unavailable(&target)));
            }
            ctx.reason = Some(Reason::ExplicitTarget);
            Arc::clone(b)
        } else {
            if candidates.is_empty() {
                let e = if ctx.excluded.is_empty() {
                    GatewayError::no_healthy_backend(&tier.name)
                } else {
                    GatewayError::all_candidates_failed(&tier.name)
                };
                return Err(self.fail(ctx, e));
            }
            let index = match ctx.session_ref.clone() {
                Some(sref) => {
                    let wait = routing.config.affinity.single_flight_wait;
                    let sel = self
                        .select_waiting(session, &sref, &tier, &candidates, owner, wait)
                        .await?;
                    match sel.reason {
                        Reason::Broken => tier.metrics.broken.inc(),
                        Reason::Moved => {
                            let why = sel.moved.map_or("policy", |m| m.as_str());
                            self.gw
                                .metrics
                                .affinity_moves
                                .with_label_values(&[&tier.name, why])
                                .inc();
                        }
                        _ => {}
                    }
                    // A replay finds the binding its own first attempt made:
                    // the request is still what that attempt said it was.
                    if !(ctx.replayed && sel.affinity_hit) {
                        ctx.affinity_hit = sel.affinity_hit;
                        ctx.reason = Some(sel.reason);
                        ctx.moved = sel.moved;
                    }
                    ctx.lease = sel.lease;
                    sel.index
                }
                None => {
                    ctx.reason = Some(Reason::NoSession);
                    self.least_in_flight(&tier, &candidates)
                }
            };
            Arc::clone(
                tier.backend_by_slot(candidates[index].slot)
                    .expect("candidates come from this tier"),
            )
        };
        if let Some(old) = previous_lease {
            old.hand_over();
        }
        ctx.in_flight = Some(InFlight::new(&backend.stats));
        let mut peer = match &backend.tls {
            Some(sni) => HttpPeer::new(backend.addr, true, sni.clone()),
            None => HttpPeer::new(backend.addr, false, String::new()),
        };
        let server = &routing.config.server;
        peer.options.connection_timeout = Some(server.connect_timeout);
        if backend.tls.is_some() {
            // A backend that accepts TCP and stalls the handshake must not
            // hold the request (and its session's waiters) forever.
            peer.options.total_connection_timeout =
                Some(server.connect_timeout + server.tls_handshake_timeout);
        }
        peer.options.read_timeout = server.read_timeout;
        peer.options.idle_timeout = Some(server.upstream_idle_timeout);
        if ctx.replayed {
            peer.group_key = upstream_conn::fresh_group_key();
        }
        if ctx.body.is_none() {
            // A retry streams the body again from Pingora's retry buffer.
            ctx.body_bytes = 0;
        }
        ctx.backend = Some(backend);
        Ok(Box::new(peer))
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
        if reused && upstream_conn::peer_closed(fd, peer.is_tls()) {
            return Err(upstream_conn::closed_in_pool());
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
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut RequestCtx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        // Nothing reached the backend: try the next candidate. upstream_peer
        // rebinds the session (counted broken) or answers 502 when none is left.
        if let Some(b) = ctx.backend.clone() {
            log::warn!("backend {} ({}) refused connection: {e}", b.id, b.addr);
            if matches!(
                e.etype(),
                ErrorType::ConnectTimedout | ErrorType::TLSHandshakeTimedout
            ) {
                self.gw
                    .metrics
                    .timeouts
                    .with_label_values(&["upstream_connect"])
                    .inc();
            }
            ctx.excluded.push(b.slot);
            self.record_outcome(ctx, &b, Outcome::Failure);
        }
        e.set_retry(true);
        e
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut RequestCtx,
        client_reused: bool,
    ) -> Box<Error> {
        let mut e = e.more_context(format!("Peer: {peer}"));
        let body_replayable =
            ctx.body.is_some() || !session.as_downstream().retry_buffer_truncated();
        let replay = upstream_conn::should_replay(&e, client_reused, ctx.replayed, body_replayable);
        e.set_retry(replay);
        if replay {
            ctx.replayed = true;
            if let (Some(tier), Some(backend)) = (&ctx.tier, &ctx.backend) {
                upstream_conn::stop_reusing(&backend.stats);
                self.gw
                    .metrics
                    .upstream_retries
                    .with_label_values(&[&tier.name, &backend.id])
                    .inc();
            }
        }
        e
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if ctx.body.is_some() {
            // The gateway already answered the client's 100-continue.
            upstream_request.remove_header("expect");
        }
        if ctx
            .backend
            .as_ref()
            .is_some_and(|b| upstream_conn::avoid_reuse(&b.stats))
        {
            upstream_request.insert_header("connection", "close")?;
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if end_of_stream {
            if let Some(conn) = &ctx.conn {
                conn.body_done();
            }
        }
        if let Some(full) = &ctx.body {
            // See request_body.rs: this is the replayed tail; send everything.
            *body = Some(full.clone());
            return Ok(());
        }
        if let Some(chunk) = body {
            ctx.body_bytes += chunk.len() as u64;
            let limit = ctx
                .routing
                .as_ref()
                .map_or(u64::MAX, |r| r.config.server.max_body_bytes);
            if ctx.body_bytes > limit {
                return Err(self.fail(ctx, GatewayError::body_too_large(limit)));
            }
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        let (Some(backend), Some(tier)) = (ctx.backend.clone(), ctx.tier.clone()) else {
            return Ok(());
        };
        let limit = ctx
            .routing
            .as_ref()
            .map_or(usize::MAX, |r| r.config.server.client.max_header_bytes);
        if fields_bytes(&resp.headers, 0) > limit {
            let e = GatewayError::upstream_failed(format!(
                "backend {} sent response headers over the gateway's limit of {limit} bytes",
                backend.id
            ));
            return Err(self.fail(ctx, e));
        }
        resp.insert_header(BACKEND_HEADER, &*backend.id)?;
        resp.insert_header(HIT_HEADER, if ctx.affinity_hit { "true" } else { "false" })?;
        resp.insert_header(TIER_HEADER, &*tier.name)?;

        let content_type = resp
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase();
        let is_json = content_type.starts_with("application/json");
        let is_sse = content_type.starts_with("text/event-stream");
        let encoded = resp.headers.get("content-encoding").is_some();
        if (is_json || is_sse) && !encoded {
            ctx.usage = Some(UsageScanner::default());
        }
        let bodyless = session.req_header().method == http::Method::HEAD
            || resp.status.as_u16() == 204
            || resp.status.as_u16() == 304;
        if is_json && !encoded && !bodyless {
            let appender = JsonAppender::new(ctx.metadata_member(&backend, &tier));
            let declared = resp
                .headers
                .get("content-length")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<usize>().ok());
            match declared.map(|len| (len, len.checked_add(appender.extra_len()))) {
                // A length no body can have: pass the response on untouched.
                Some((_, None)) => return Ok(()),
                Some((len, Some(total))) => {
                    resp.insert_header("content-length", total.to_string())?;
                    ctx.upstream_body_len = Some(len);
                }
                None => {}
            }
            ctx.appender = Some(appender);
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<std::time::Duration>> {
        if let Some(chunk) = body.as_ref() {
            if ctx.first_byte.is_none() && !chunk.is_empty() {
                ctx.first_byte = Some(Instant::now());
            }
            if let Some(scanner) = ctx.usage.as_mut() {
                scanner.push(chunk);
            }
        }
        if let Some(appender) = ctx.appender.as_mut() {
            let mut out = match body.take() {
                Some(chunk) => {
                    ctx.upstream_body_seen += chunk.len();
                    appender.push(chunk)
                }
                None => Bytes::new(),
            };
            let complete = ctx
                .upstream_body_len
                .is_some_and(|len| ctx.upstream_body_seen >= len);
            if end_of_stream || complete {
                let tail = appender.finish();
                out = if out.is_empty() {
                    tail
                } else {
                    let mut joined = Vec::with_capacity(out.len() + tail.len());
                    joined.extend_from_slice(&out);
                    joined.extend_from_slice(&tail);
                    Bytes::from(joined)
                };
            }
            *body = (!out.is_empty()).then_some(out);
        }
        Ok(None)
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
        let downstream = e.esource() == &ErrorSource::Downstream;
        let too_slow = match ctx.error {
            None if downstream => self.client_timeout(ctx, e),
            _ => None,
        };
        if downstream && e.etype() == &ErrorType::WriteTimedout {
            self.gw
                .metrics
                .timeouts
                .with_label_values(&["client_write"])
                .inc();
        }
        let malformed = downstream
            && ctx.error.is_none()
            && matches!(e.etype().as_str(), "InvalidChunk" | "InvalidTrailerEnd");
        if malformed {
            // Bad input never leaves a binding behind: drop the one this
            // request made (a binding that existed before stays).
            if let (Some(sref), Some(Reason::FirstTurn | Reason::Expired)) =
                (&ctx.session_ref, ctx.reason)
            {
                self.gw.affinity.forget(sref.key);
            }
        }
        let gateway_error = match (&ctx.error, e.etype()) {
            (Some(g), _) => Some(g.clone()),
            (None, _) if too_slow.is_some() => too_slow,
            (None, _) if malformed => Some(GatewayError::bad_body(format!(
                "malformed request body: {}",
                e.etype().as_str()
            ))),
            (None, ErrorType::HTTPStatus(code)) => Some(GatewayError {
                status: *code,
                kind: "gateway_error",
                code: "gateway_error",
                message: e.to_string(),
            }),
            (None, ErrorType::ReadTimedout) if e.esource() == &ErrorSource::Upstream => {
                self.gw
                    .metrics
                    .timeouts
                    .with_label_values(&["upstream_read"])
                    .inc();
                Some(GatewayError::upstream_timeout(format!(
                    "backend {} sent nothing for {} ms",
                    ctx.backend.as_ref().map_or("?", |b| &*b.id),
                    ctx.routing
                        .as_ref()
                        .and_then(|r| r.config.server.read_timeout)
                        .map_or(0, |t| t.as_millis())
                )))
            }
            (None, _) => match e.esource() {
                ErrorSource::Upstream => Some(GatewayError::upstream_failed(format!(
                    "backend {} failed: {}",
                    ctx.backend.as_ref().map_or("?", |b| &*b.id),
                    e.etype().as_str()
                ))),
                ErrorSource::Downstream => None,
                _ => Some(GatewayError {
                    status: 500,
                    kind: "internal_error",
                    code: "internal_error",
                    message: "internal gateway error".into(),
                }),
            },
        };
        let code = match gateway_error {
            // A response already started cannot be replaced: just end it.
            // (A forwarded `100 Continue` is no answer: the final one can follow.)
            Some(g)
                if session
                    .response_written()
                    .is_none_or(|r| r.status.is_informational()) =>
            {
                // The connection closes after this answer (below): say so,
                // or a client reusing it races the close.
                session.set_keepalive(None);
                let tier = ctx.tier_name().map(str::to_string);
                let status = g.status;
                let backend = ctx.backend.as_ref().map(|b| Arc::clone(&b.id));
                if let Err(we) = g.write(session, tier.as_deref(), backend.as_deref()).await {
                    log::debug!("writing error response failed: {we}");
                }
                ctx.error = Some(g);
                status
            }
            _ => 0,
        };
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        if let Some(conn) = &ctx.conn {
            conn.request_done();
        }
        if let Some(backend) = ctx.backend.clone() {
            if let Some(outcome) = Self::outcome(session, e, ctx) {
                self.record_outcome(ctx, &backend, outcome);
            }
        }
        let tier_name = ctx.tier_name().unwrap_or("none").to_string();
        let status = session
            .response_written()
            .map(|r| r.status.as_u16())
            .or(ctx.error.as_ref().map(|g| g.status))
            .unwrap_or(0);
        let m = &self.gw.metrics;
        if let Some(g) = &ctx.error {
            m.gateway_errors
                .with_label_values(&[&tier_name, &g.status.to_string()])
                .inc();
        }
        if let Some(tier) = &ctx.tier {
            tier.metrics
                .duration
                .observe(ctx.start.elapsed().as_secs_f64());
            if let Some(fb) = ctx.first_byte {
                tier.metrics
                    .ttfb
                    .observe(fb.duration_since(ctx.start).as_secs_f64());
            }
            if ctx.backend.is_some() && ctx.session_ref.is_some() {
                if ctx.affinity_hit {
                    tier.metrics.hits.inc();
                } else {
                    tier.metrics.misses.inc();
                }
            }
        }
        if ctx.session_final {
            if let Some(sref) = &ctx.session_ref {
                self.gw.affinity.forget(sref.key);
            }
        }
        let backend_id = ctx.backend.as_ref().map_or("none", |b| &*b.id);
        m.requests
            .with_label_values(&[&tier_name, backend_id, &status.to_string()])
            .inc();
        let usage = ctx.usage.as_ref().and_then(UsageScanner::usage);
        // What the backend's answer teaches: its prefill cost and queueing,
        // and how much of this session it still had cached.
        if let (Some(u), Some(b), Some(fb), 200) = (usage, &ctx.backend, ctx.first_byte, status) {
            b.stats.cost.observe(
                fb.duration_since(ctx.start),
                u.prompt_tokens,
                u.cached_tokens,
            );
            if let Some(sref) = ctx.session_ref.as_ref().filter(|_| !ctx.session_final) {
                self.gw
                    .affinity
                    .record_usage(sref.key, u.prompt_tokens, u.cached_tokens);
            }
        }
        if let Some(u) = usage {
            m.prompt_tokens
                .with_label_values(&[&tier_name, backend_id])
                .inc_by(u.prompt_tokens);
            m.cached_prompt_tokens
                .with_label_values(&[&tier_name, backend_id])
                .inc_by(u.cached_tokens);
        }
        if let Some(trace) = &self.gw.trace {
            let req = session.req_header();
            trace.record(&crate::trace::TraceRecord {
                time_ms: ctx
                    .start_wall
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_millis() as u64),
                request_id: format!("{:016x}", self.request_ids.fetch_add(1, Ordering::Relaxed)),
                method: req.method.as_str(),
                path: req.uri.path(),
                tier: ctx.tier_name(),
                session: ctx.session.as_ref().map(|s| s.id.as_str()),
                parent: ctx.parent.as_deref(),
                backend: ctx.backend.as_ref().map(|b| &*b.id),
                affinity_hit: ctx.affinity_hit,
                reason: ctx.reason.map(Reason::as_str),
                moved_because: ctx.moved.map(|m| m.as_str()),
                status,
                prompt_tokens: usage.map(|u| u.prompt_tokens),
                cached_tokens: usage.map(|u| u.cached_tokens),
                ttfb_ms: ctx
                    .first_byte
                    .map(|fb| fb.duration_since(ctx.start).as_secs_f64() * 1000.0),
                total_ms: ctx.start.elapsed().as_secs_f64() * 1000.0,
            });
        }
    }
}
