//! Peer selection as Pingora asks for it: the route's placement
//! ([`crate::routing::Route::place`]), with admission's wait for a slot
//! run here, where the client is watched ([`ClientSeats`]); how the gateway
//! connects to the backend it chose; connect failures and lost answers
//! (where they go again: [`crate::routing::Route::resend`]); what a
//! request's outcome tells passive health.

use super::answer::LostAnswer;
use super::ctx::RequestCtx;
use super::upstream_conn;
use crate::admission::fleet::Asker;
use crate::admission::{Admittance, Ask, Class, PrefillRoom, Slot, Watch};
use crate::config::{Config, OnHung};
use crate::errors::{GatewayError, Refusal};
use crate::gateway::Gateway;
use crate::routing::{Resend, Route, Seats};
use crate::upstream::outlier::Outcome;
use crate::upstream::{Backend, InFlight, Tier};
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, ErrorSource, ErrorType, Result};
use pingora_proxy::Session;
use std::sync::Arc;
use std::time::Duration;

/// What a token of prefill is taken to cost before a backend's answers
/// taught it, µs.
const PREFILL_PRIOR_US: f64 = 100.0;

/// Record `e` as this request's answer and turn it into a hook error.
pub(super) fn fail(ctx: &mut RequestCtx, e: GatewayError) -> Box<Error> {
    let pe = e.to_pingora();
    ctx.record.error = Some(e);
    pe
}

/// A refusal as a hook error: its answer recorded, or the connection
/// closed under a client that left.
fn refuse(ctx: &mut RequestCtx, r: Refusal) -> Box<Error> {
    match r {
        Refusal::Answer(e) => fail(ctx, e),
        Refusal::ClientGone(why) => Error::explain(ErrorType::ConnectionClosed, why).into_down(),
    }
}

/// How long a backend whose connection failed under a request has to
/// answer its health check before it is taken for gone.
const STILL_THERE_WITHIN: Duration = Duration::from_secs(1);

/// A request whose backend's connection failed before any byte of its
/// answer is re-sent (SPEC §3.6): to another candidate when that backend
/// is gone (its health check or passive health say so, or it does not
/// answer its health check now: a process that died is not running the
/// request any more) or was ejected as hung holding it, its session
/// rebound there; to the same backend when the
/// connection was a reused one it closed (an engine's idle keep-alive
/// close racing the request); else not at all (a live backend that closed
/// a fresh connection under a request may be running it). Once: a request
/// whose re-send fails so too ends with 502, so one that kills engines
/// does not walk the fleet.
pub(super) async fn after_a_lost_answer(gw: &Gateway, ctx: &mut RequestCtx) -> Result<()> {
    let Some(LostAnswer {
        slot,
        reused,
        unsent,
        hung,
    }) = ctx.answer.lost_answer.take()
    else {
        return Ok(());
    };
    let route = ctx.route.as_mut().expect("routed in request_filter");
    let tier = Arc::clone(route.tier());
    let Some(backend) = tier.backend_by_slot(slot).cloned() else {
        return Ok(());
    };
    let health = &route.request().routing().config.health.path;
    let gone = hung || !tier.healthy(&backend) || !answers_health(&backend, health).await;
    if gone || unsent || reused {
        gw.metrics
            .upstream_retries
            .with_label_values(&[&tier.name, &backend.id])
            .inc();
    }
    match route.resend(slot, gone, unsent, reused) {
        Resend::Elsewhere => log::warn!(
            "backend {} {} with a request it held before any answer; sending it elsewhere once",
            backend.id,
            match hung {
                true => "was ejected as hung",
                false => "is gone",
            }
        ),
        Resend::Not => {
            return Err(fail(
                ctx,
                GatewayError::upstream_failed(format!(
                    "backend `{}` closed the connection before answering; not re-sent, as it may be running the request",
                    backend.id
                )),
            ))
        }
        Resend::Anywhere | Resend::Same => {}
    }
    Ok(())
}

/// Whether `backend` answers its health check now (`path`), within
/// [`STILL_THERE_WITHIN`]. A connect alone is no proof: a process killed a
/// moment ago may not have closed its listening socket yet, and the kernel
/// accepts into it. A TLS backend is asked for a connection only.
async fn answers_health(backend: &Backend, path: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let probe = async {
        let mut s = tokio::net::TcpStream::connect(backend.addr).await.ok()?;
        if backend.tls.is_some() {
            return Some(true);
        }
        let ask = format!(
            "GET {path} HTTP/1.1\r\nhost: {}\r\nconnection: close\r\n\r\n",
            backend.addr
        );
        s.write_all(ask.as_bytes()).await.ok()?;
        let mut head = [0u8; 12];
        s.read_exact(&mut head).await.ok()?;
        Some(head.starts_with(b"HTTP/1.") && head[9] == b'2')
    };
    matches!(
        tokio::time::timeout(STILL_THERE_WITHIN, probe).await,
        Ok(Some(true))
    )
}

/// `upstream_peer`: the backend this request goes to, with a slot there.
pub(super) async fn choose(
    gw: &Gateway,
    session: &mut Session,
    ctx: &mut RequestCtx,
) -> Result<Box<HttpPeer>> {
    after_a_lost_answer(gw, ctx).await?;
    // A retry after a connect failure starts over: the failed attempt's
    // in-flight count and slot end here; its lease is handed over when
    // the route decides again.
    ctx.answer.in_flight = None;
    ctx.who.permit = None;
    let route = ctx.route.as_mut().expect("routed in request_filter");
    let routing = Arc::clone(route.request().routing());
    let prompt = route.request().prompt_tokens();
    let mut seats = ClientSeats {
        gw,
        cfg: &routing.config,
        session,
        who: &mut ctx.who,
        asks_stream: ctx.body.asks_stream,
    };
    let prefill = match route.place(gw.tables(), &mut seats).await {
        Ok(prefill) => prefill,
        Err(r) => return Err(refuse(ctx, r)),
    };
    let route = ctx.route.as_ref().expect("routed in request_filter");
    let backend = route.backend().expect("decided");
    let elsewhere = ctx
        .who
        .permit
        .as_ref()
        .map_or(Default::default(), |p| p.fleet_ahead);
    ctx.answer.in_flight = Some(InFlight::behind(
        &backend.stats,
        prefill.unwrap_or_else(|| backend.stats.cost.body_estimate(prompt)),
        prompt,
        elsewhere,
    ));
    let peer = peer(backend, &routing.config, route.replayed);
    if ctx.body.whole.is_none() {
        // A retry streams the body again from Pingora's retry buffer.
        ctx.body.bytes = 0;
    }
    // Time parked here was not the client's to send its body in.
    if let Some(conn) = &ctx.body.conn {
        conn.body_clock_restart();
    }
    Ok(Box::new(peer))
}

/// How the gateway connects to `backend`.
fn peer(backend: &Backend, cfg: &Config, replayed: bool) -> HttpPeer {
    let mut peer = match &backend.tls {
        Some(sni) => HttpPeer::new(backend.addr, true, sni.clone()),
        None => HttpPeer::new(backend.addr, false, String::new()),
    };
    let server = &cfg.server;
    peer.options.connection_timeout = Some(server.connect_timeout);
    if backend.tls.is_some() {
        // A backend that accepts TCP and stalls the handshake must not
        // hold the request (and its session's waiters) forever.
        peer.options.total_connection_timeout =
            Some(server.connect_timeout + server.tls_handshake_timeout);
    }
    peer.options.read_timeout = server.read_timeout;
    peer.options.idle_timeout = Some(server.upstream_idle_timeout);
    if replayed {
        peer.group_key = upstream_conn::fresh_group_key();
    }
    peer
}

/// Admission's side of a request's placement: its client, watched while it
/// waits for a slot.
struct ClientSeats<'a> {
    gw: &'a Gateway,
    cfg: &'a Config,
    session: &'a mut Session,
    who: &'a mut Admittance,
    asks_stream: Option<bool>,
}

impl Seats for ClientSeats<'_> {
    fn who(&self) -> (Class, u64) {
        (self.who.class, self.who.tenant)
    }

    fn asker(&self) -> Asker {
        self.who.asker()
    }

    fn claimed(&mut self, seat: Option<u64>) {
        self.who.claim = seat;
    }

    fn client_gone(&self) -> bool {
        client_gone(self.session)
    }

    /// A slot at the decided backend.
    async fn seat(
        &mut self,
        route: &mut Route,
        idle_elsewhere: Vec<Arc<str>>,
    ) -> std::result::Result<Slot, Refusal> {
        let gw = self.gw;
        let tier = Arc::clone(route.tier());
        let decision = route.decision().expect("decided");
        let (backend, prefill) = (Arc::clone(&decision.backend), decision.prefill);
        // Subagents inherit their parent session's class unless they name one.
        let named = self.who.class_named.then_some(self.who.class);
        if let Some(class) = route.class_of_session(gw.tables(), named) {
            self.who.inherit_class(class);
        }
        let tokens = prefill.unwrap_or(route.request().prompt_tokens());
        // An HTTP/2 stream says itself when it is reset or its connection
        // goes (other streams of the connection may wait on); an HTTP/1
        // client's socket is looked at now and then.
        let socket = self
            .session
            .as_downstream()
            .digest()
            .and_then(|d| d.socket_digest.clone());
        let closed = self.session.as_downstream_mut().watch_h2_stream_close();
        let h1 = closed.is_none();
        let ask = Ask {
            tier: &tier.name,
            tier_metrics: &tier.metrics,
            backend: backend.slot,
            backend_id: &backend.id,
            tokens,
            room: prefill_room(self.cfg, &backend, self.asks_stream),
            idle_elsewhere,
        };
        let watch = Watch {
            closed,
            client_gone: || h1 && socket_closed(socket.as_deref()),
            backend_gone: || backend_gone(gw, &tier, &backend),
        };
        // Its placement is real enough once it waits: the session's other
        // requests (a parent's subagents starting together) follow it and
        // wait for the same backend, instead of waiting out
        // `single_flight_wait` for this one to connect.
        let held = self
            .who
            .wait_for_slot(&gw.admission, &gw.metrics, ask, || route.confirm(), watch)
            .await?;
        if held == Slot::Held {
            let cost = &backend.stats.cost;
            self.who.clock_prefill(self.asks_stream, tokens, || {
                cost.prefill_us_per_token(PREFILL_PRIOR_US, 1)
            });
        }
        Ok(held)
    }
}

/// The room for prefills at `backend` as of this request, in tokens at its
/// learned cost: `admission.prefill_queue_ms` of work sent and not answered
/// beyond one request (unless `max_prefilling` counts requests instead),
/// and, under a learned cap of one, what may prefill beyond it all the
/// same (work too short to wait for).
fn prefill_room(cfg: &Config, backend: &Backend, asks_stream: Option<bool>) -> PrefillRoom {
    let adm = &cfg.admission;
    let us = backend
        .stats
        .cost
        .prefill_us_per_token(PREFILL_PRIOR_US, 1)
        .max(0.01);
    let tokens = |d: std::time::Duration| ((d.as_micros() as f64 / us) as u64).max(1);
    PrefillRoom {
        budget: match adm.max_prefilling > 0 || adm.prefill_queue.is_zero() {
            true => 0,
            false => tokens(adm.prefill_queue),
        },
        slack: tokens(crate::upstream::cost::VOTE_MIN_AHEAD),
        json: asks_stream == Some(false),
    }
}

/// Whether the client has closed its connection (FIN or RST seen). Used while
/// a request waits, when no read on the socket is in progress.
fn client_gone(session: &Session) -> bool {
    socket_closed(
        session
            .as_downstream()
            .digest()
            .and_then(|d| d.socket_digest.as_deref()),
    )
}

/// The same, for a socket read before its session was borrowed elsewhere.
fn socket_closed(socket: Option<&pingora_core::protocols::SocketDigest>) -> bool {
    const TCP_ESTABLISHED: u8 = 1;
    socket
        .and_then(|s| s.tcp_info())
        .is_some_and(|info| info.tcpi_state != TCP_ESTABLISHED)
}

/// Whether `backend` of `tier` can no longer take a waiting request:
/// unhealthy or ejected as the configuration in force sees it, or gone
/// from it.
fn backend_gone(gw: &Gateway, tier: &Tier, backend: &Backend) -> bool {
    let routing = gw.routing();
    let Some(now) = routing.tier_by_name(&tier.name) else {
        return true;
    };
    match now.backend_by_id(&backend.id) {
        Some(b) if b.addr == backend.addr => !now.healthy(b),
        _ => true,
    }
}

/// `fail_to_connect`: nothing reached the backend: try the next candidate.
/// `upstream_peer` rebinds the session (counted broken) or answers 502
/// when none is left.
pub(super) fn connect_failed(gw: &Gateway, ctx: &mut RequestCtx, mut e: Box<Error>) -> Box<Error> {
    if let Some(b) = ctx.backend().cloned() {
        log::warn!("backend {} ({}) refused connection: {e}", b.id, b.addr);
        if matches!(
            e.etype(),
            ErrorType::ConnectTimedout | ErrorType::TLSHandshakeTimedout
        ) {
            gw.metrics
                .timeouts
                .with_label_values(&["upstream_connect"])
                .inc();
        }
        if let Some(route) = ctx.route.as_mut() {
            route.exclude(b.slot);
        }
        record_outcome(gw, ctx, &b, Outcome::Failure);
    }
    e.set_retry(true);
    e
}

/// `error_while_proxy`: whether the request may be sent again on a fresh
/// connection (see upstream_conn.rs); where, [`after_a_lost_answer`] decides.
pub(super) fn proxy_error(
    peer: &HttpPeer,
    session: &mut Session,
    e: Box<Error>,
    ctx: &mut RequestCtx,
    client_reused: bool,
) -> Box<Error> {
    let mut e = e.more_context(format!("Peer: {peer}"));
    let body_replayable =
        ctx.body.whole.is_some() || !session.as_downstream().retry_buffer_truncated();
    // A request that waited for its slot is treated as one on a reused
    // connection: the backend may have died while it waited (a crash
    // frees the slot it then takes), and a connection to a dying process
    // can be accepted, then reset before any answer.
    let reused = client_reused || ctx.who.waited;
    let Some(route) = ctx.route.as_mut() else {
        return e;
    };
    // Failed before any byte of the answer, on a connection reused or
    // fresh: whether it is sent again is decided once it is known whether
    // its backend is still there (a fresh connection that failed so is a
    // backend that died, or one that closes connections it took).
    let mut replay = upstream_conn::should_replay(&e, route.replayed, body_replayable);
    // Its backend was ejected as hung while it waited for its first byte,
    // its connection cut (`upstream::stall`): sent once elsewhere, or a 504.
    let hung = ctx
        .answer
        .in_flight
        .as_mut()
        .is_some_and(InFlight::cut_as_hung);
    if hung {
        let resend = route.request().routing().config.outlier.on_hung == OnHung::Resend;
        replay =
            resend && !route.replayed && body_replayable && session.response_written().is_none();
        if !replay {
            let id = route.backend().map_or("?", |b| &*b.id);
            ctx.record.error = Some(GatewayError::upstream_timeout(format!(
                "backend `{id}` stopped answering and was ejected while it held this request"
            )));
        }
    }
    e.set_retry(replay);
    if replay {
        route.replayed = true;
        if upstream_conn::reset_unread(&e) {
            ctx.answer.unsent = true;
        }
        // Its first attempt may have reached its backend (it was written):
        // that backend may have begun running it, so the replay goes there,
        // elsewhere only if that backend is gone, or nowhere.
        let unsent = std::mem::take(&mut ctx.answer.unsent);
        ctx.answer.lost_answer = route.backend().map(|b| LostAnswer {
            slot: b.slot,
            reused,
            unsent,
            hung,
        });
        if let (Some(backend), true) = (route.backend(), reused) {
            upstream_conn::stop_reusing(&backend.stats);
        }
    }
    e
}

/// Feed one request's outcome to its backend's passive health; eject it
/// when that was one failure too many (and the tier can spare it).
fn record_outcome(gw: &Gateway, ctx: &RequestCtx, backend: &Backend, outcome: Outcome) {
    let Some(route) = &ctx.route else {
        return;
    };
    let tier = route.tier();
    let cfg = &route.request().routing().config.outlier;
    let now = crate::clock::now_ms();
    let ejected = backend
        .stats
        .outlier
        .record_in(&tier.ejections, outcome, cfg, now, || {
            tier.may_eject(cfg.max_ejected_percent)
        });
    if let Some(span) = ejected {
        log::warn!(
            "backend {} ejected for {} s after {} failed requests in a row",
            backend.id,
            span.as_secs(),
            cfg.consecutive_failures
        );
        gw.metrics
            .backend_ejections
            .with_label_values(&[&tier.name, &backend.id])
            .inc();
    }
}

/// Record, once per request, what it says about its backend (passive
/// health): when the gateway answers a failure, before that answer is
/// written; otherwise when the request ends.
pub(super) fn settle_outcome(
    gw: &Gateway,
    session: &Session,
    e: Option<&Error>,
    ctx: &mut RequestCtx,
) {
    if ctx.answer.outcome_settled {
        return;
    }
    ctx.answer.outcome_settled = true;
    if let Some(backend) = ctx.backend().cloned() {
        if let Some(outcome) = outcome(session, e, ctx) {
            record_outcome(gw, ctx, &backend, outcome);
        }
    }
}

/// What a finished request says about its backend: `None` when the
/// backend was not at fault either way (the client left, bad input).
fn outcome(session: &Session, e: Option<&Error>, ctx: &RequestCtx) -> Option<Outcome> {
    if let Some(g) = &ctx.record.error {
        return matches!(g.code, "backend_error" | "backend_timeout").then_some(Outcome::Failure);
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
