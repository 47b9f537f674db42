//! Peer selection: which backend serves the request (binding, else first
//! placement; least in flight without a session), waiting while another
//! request of the session places it (`Affinity::route`); connect
//! failures and replays; what a request's outcome tells passive health.

use super::*;

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

/// The room for prefills at `backend` as of this request, in tokens at its
/// learned cost: `admission.prefill_queue_ms` of work sent and not answered
/// beyond one request (unless `max_prefilling` counts requests instead),
/// and, under a learned cap of one, what may prefill beyond it all the
/// same (work too short to wait for).
fn prefill_room(ctx: &RequestCtx, backend: &Backend) -> crate::admission::PrefillRoom {
    let Some(adm) = ctx.routing.as_ref().map(|r| &r.config.admission) else {
        return Default::default();
    };
    let us = backend
        .stats
        .cost
        .prefill_us_per_token(PREFILL_PRIOR_US, 1)
        .max(0.01);
    let tokens = |d: std::time::Duration| ((d.as_micros() as f64 / us) as u64).max(1);
    crate::admission::PrefillRoom {
        budget: match adm.max_prefilling > 0 || adm.prefill_queue.is_zero() {
            true => 0,
            false => tokens(adm.prefill_queue),
        },
        slack: tokens(crate::upstream::cost::VOTE_MIN_AHEAD),
        json: ctx.asks_stream == Some(false),
    }
}

/// What a token of prefill is taken to cost before a backend's answers
/// taught it, µs.
const PREFILL_PRIOR_US: f64 = 100.0;

/// The prompt tokens a request holds: its prompt's own estimate when it was
/// read (token ids counted, text at 4 bytes a token), else estimated from
/// the body's size (read already, or declared in Content-Length, which
/// `request_filter` has held to `max_body_bytes`; 0 when neither is known).
/// The first is in the units of what the prefix index says is held: taking
/// a token-id prompt's held part off its body's bytes / 4 left a phantom
/// third of it queued.
pub(super) fn body_tokens(ctx: &RequestCtx) -> u64 {
    if let Some(route) = ctx.prefix.as_deref() {
        return route.tokens();
    }
    let bytes = match ctx.body.as_ref() {
        Some(body) => body.len() as u64,
        None => ctx.declared_len.unwrap_or(0),
    };
    bytes / crate::affinity::prefix::prompt::BYTES_PER_TOKEN
}

impl GatewayProxy {
    pub(super) async fn choose_peer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        let tier = Arc::clone(ctx.tier.as_ref().expect("routed in request_filter"));
        let routing = Arc::clone(ctx.routing.as_ref().expect("routed in request_filter"));
        // A retry after a connect failure starts over: the failed attempt's
        // in-flight count ends here; its lease is handed over below.
        ctx.in_flight = None;
        ctx.who.permit = None;
        let previous_lease = ctx.lease.take();
        let owner = previous_lease.as_ref().is_some_and(|l| l.owns_pending());
        let mut candidates = tier.candidates(&ctx.excluded);
        if let Some((slot, id)) = &ctx.stored_at {
            // Only the backend that stored the response it follows has it.
            candidates.retain(|c| c.slot == *slot);
            if candidates.is_empty() {
                let why = match tier.backend_by_slot(*slot) {
                    None => "the backend that stored it left the configuration".to_string(),
                    Some(b) if ctx.excluded.contains(slot) => {
                        format!(
                            "backend `{}`, which stored it, refused the connection",
                            b.id
                        )
                    }
                    Some(b) => format!("backend `{}`, which stored it, is not healthy", b.id),
                };
                let e = GatewayError::previous_response_not_found(id, &why);
                return Err(self.fail(ctx, e));
            }
        }
        let admission = routing.config.admission.enabled;
        if admission {
            self.gw
                .admission
                .mark(&mut candidates, ctx.who.class, ctx.who.tenant);
        }
        // New keyless conversations count as sessions, and what each
        // candidate holds of the prompt (`affinity.prefix`).
        self.gw.prefix.fill_probation(&mut candidates);
        if let Some(route) = ctx.prefix.as_mut() {
            route.look_up(&self.gw.prefix, &mut candidates);
        }

        // This request's prefill there, for the backend's queued tokens: its
        // prompt less what the prefix index says is held there (below); else
        // a kept binding's estimate; else the body less the prefix the
        // backend's new sessions find cached.
        let body_tokens = body_tokens(ctx);
        let mut new_tokens = None;
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
                Some(mut sref) => {
                    sref.prompt_tokens = body_tokens;
                    sref.indexed = ctx.prefix.is_some();
                    let wait = routing.config.affinity.single_flight_wait;
                    let gone = || client_gone(session);
                    let sel = match self
                        .gw
                        .affinity
                        .route(&sref, &*tier, &candidates, owner, wait, gone)
                        .await
                    {
                        Ok(sel) => sel,
                        // Only for empty candidates, which are ruled out above.
                        Err(WaitEnd::NoCandidate) => {
                            return Err(GatewayError::no_healthy_backend(&tier.name).to_pingora())
                        }
                        Err(WaitEnd::ClientGone) => {
                            return Err(pingora_core::Error::explain(
                                ErrorType::ConnectionClosed,
                                "client left while waiting for its session's placement",
                            )
                            .into_down())
                        }
                    };
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
                    new_tokens = sel.new_tokens;
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
        if let Some(route) = ctx.prefix.as_mut() {
            let bound = ctx.lease.is_some();
            let held = route.routed(&self.gw.prefix, backend.slot, bound);
            match route.matched() {
                true => tier.metrics.prefix_matched.inc(),
                false => tier.metrics.prefix_none.inc(),
            }
            // Its prefill there: the prompt less what the index says is
            // held. Better than the session's last turn (which under KV
            // pressure found its transcript evicted, yet counts only its
            // growth) or the body less the backend's usual shared prefix.
            new_tokens = Some(body_tokens.saturating_sub(held));
        }
        if admission {
            // Subagents inherit their parent session's class unless they name one.
            if let Some(sref) = &ctx.session_ref {
                let adm = &self.gw.admission;
                if ctx.who.class_named {
                    adm.name_class(sref.key, ctx.who.class);
                } else if let Some(c) = sref.parent.and_then(|p| adm.named_class(p)) {
                    ctx.who.inherit_class(c);
                }
            }
            let prefill = new_tokens.unwrap_or(body_tokens);
            let Some(mut permit) = self.admit(session, ctx, &tier, &backend, prefill).await? else {
                // Its backend went while it waited: it is placed again
                // without it, its session rebound like any turn's whose
                // backend is down.
                log::info!(
                    "backend {} went while requests waited for it; placing them again",
                    backend.id
                );
                ctx.excluded.push(backend.slot);
                return Box::pin(self.choose_peer(session, ctx)).await;
            };
            if ctx.asks_stream != Some(true) && permit.needs_clock {
                // An answer that does not stream shows no end of its
                // prefill: it counts as prefilling for twice what that
                // should take (a body not read yet is looked at on its way).
                // Only a cap on prefills (configured or learned) or
                // `prefill_queue_ms` counts it at all.
                let us = backend.stats.cost.prefill_us_per_token(PREFILL_PRIOR_US, 1);
                let ms = (prefill as f64 * us * 2.0 / 1000.0) as u64;
                let within = std::time::Duration::from_millis(ms.clamp(50, 10_000));
                match ctx.asks_stream {
                    Some(_) => permit.prefill_within(within),
                    None => ctx.prefill_clock = Some((within, false)),
                }
            }
            ctx.who.permit = Some(permit);
        }
        ctx.in_flight = Some(InFlight::new(
            &backend.stats,
            new_tokens.unwrap_or_else(|| backend.stats.cost.body_estimate(body_tokens)),
            body_tokens,
        ));
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
        // Time parked here was not the client's to send its body in.
        if let Some(conn) = &ctx.conn {
            conn.body_clock_restart();
        }
        ctx.backend = Some(backend);
        Ok(Box::new(peer))
    }

    /// A slot at `backend` for this request: at once, or after waiting in
    /// the gateway's queue, in order of class and fair share; else the 429
    /// that says when to come back (its deadline passed, or the queue is
    /// full), before any byte of it has gone upstream.
    async fn admit(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
        tier: &Tier,
        backend: &Backend,
        tokens: u64,
    ) -> Result<Option<crate::admission::Permit>> {
        use crate::admission::{Admit, Waited};
        let adm = &self.gw.admission;
        let m = &self.gw.metrics;
        let class = ctx.who.class.as_str();
        let weight = ctx.who.client.as_ref().map_or(1, |c| c.weight);
        let room = prefill_room(ctx, backend);
        let ticket = match adm.admit_within(
            backend.slot,
            ctx.who.class,
            ctx.who.tenant,
            weight,
            tokens,
            room,
        ) {
            Admit::Now(p) => {
                tier.metrics.admitted_now[ctx.who.class.index()].inc();
                return Ok(Some(p));
            }
            Admit::Full => {
                m.admission_rejected
                    .with_label_values(&[&tier.name, class, "queue_full"])
                    .inc();
                let e = GatewayError::overloaded(
                    "queue_full",
                    format!("tier `{}` is saturated and its queue is full", tier.name),
                    adm.retry_after_s(backend.slot),
                );
                return Err(self.fail(ctx, e));
            }
            Admit::Wait(t) => t,
        };
        // Its placement is real enough now: the session's other requests
        // (a parent's subagents starting together) follow it and wait for
        // the same backend, instead of waiting out `single_flight_wait` for
        // this one to connect.
        if let Some(lease) = ctx.lease.as_mut() {
            lease.confirm();
        }
        let queued = m.admission_queued.with_label_values(&[&tier.name, class]);
        queued.inc();
        let since = Instant::now();
        // An HTTP/2 stream says itself when it is reset or its connection
        // goes (other streams of the connection may wait on); an HTTP/1
        // client's socket is looked at now and then.
        let socket = session
            .as_downstream()
            .digest()
            .and_then(|d| d.socket_digest.clone());
        let h2_closed = session.as_downstream_mut().watch_h2_stream_close();
        let h1 = h2_closed.is_none();
        let got = ticket
            .wait_until(
                ctx.who.max_wait,
                h2_closed,
                || h1 && socket_closed(socket.as_deref()),
                || self.backend_gone(tier, backend),
            )
            .await;
        queued.dec();
        ctx.who.queue_wait = since.elapsed();
        m.admission_wait
            .with_label_values(&[&tier.name, class])
            .observe(ctx.who.queue_wait.as_secs_f64());
        match got {
            // Handed a slot freed by a request that failed there: the
            // backend may have been found sick meanwhile.
            Waited::Admitted(_) if self.backend_gone(tier, backend) => Ok(None),
            Waited::Admitted(p) => {
                m.admission_admitted
                    .with_label_values(&[&tier.name, class, "queued"])
                    .inc();
                ctx.who.waited = true;
                Ok(Some(p))
            }
            // Placed again, as a turn arriving now would be.
            Waited::BackendGone => Ok(None),
            Waited::ClientGone => {
                m.admission_rejected
                    .with_label_values(&[&tier.name, class, got.reason()])
                    .inc();
                Err(pingora_core::Error::explain(
                    ErrorType::ConnectionClosed,
                    "client left while waiting for a slot",
                )
                .into_down())
            }
            Waited::Deadline => {
                m.admission_rejected
                    .with_label_values(&[&tier.name, class, got.reason()])
                    .inc();
                let e = GatewayError::overloaded(
                    "queue_timeout",
                    format!(
                        "no slot at backend {} within {} ms",
                        backend.id,
                        ctx.who.max_wait.as_millis()
                    ),
                    adm.retry_after_s(backend.slot),
                );
                Err(self.fail(ctx, e))
            }
        }
    }

    /// Whether `backend` of `tier` can no longer take a waiting request:
    /// unhealthy or ejected as the configuration in force sees it, or gone
    /// from it.
    fn backend_gone(&self, tier: &Tier, backend: &Backend) -> bool {
        let routing = self.gw.routing();
        let Some(now) = routing.tier_by_name(&tier.name) else {
            return true;
        };
        match now.backend_by_id(&backend.id) {
            Some(b) if b.addr == backend.addr => !now.healthy(b),
            _ => true,
        }
    }

    pub(super) fn least_in_flight(&self, tier: &Tier, candidates: &[Candidate]) -> usize {
        // One snapshot: in-flight counts move while we look, and deciding on
        // two different readings can leave no candidate at the minimum.
        // Full ones (admission) come last.
        let loads: Vec<u64> = candidates
            .iter()
            .map(|c| {
                let full = if c.full { u64::MAX / 2 } else { 0 };
                tier.backend_by_slot(c.slot)
                    .map_or(u64::MAX, |b| b.in_flight().max(c.in_flight) + full)
            })
            .collect();
        let min = loads.iter().copied().min().unwrap_or(0);
        let tied: Vec<usize> = (0..loads.len()).filter(|&i| loads[i] == min).collect();
        let pick = self.tiebreak.fetch_add(1, Ordering::Relaxed);
        // Never empty for the non-empty candidates the caller passes.
        tied.get(pick % tied.len().max(1)).copied().unwrap_or(0)
    }

    pub(super) fn on_connect_failure(
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

    pub(super) fn on_proxy_error(
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
        // A request that waited for its slot is treated as one on a reused
        // connection: the backend may have died while it waited (a crash
        // frees the slot it then takes), and a connection to a dying
        // process can be accepted, then reset before any answer.
        let reused = client_reused || ctx.who.waited;
        let replay = upstream_conn::should_replay(&e, reused, ctx.replayed, body_replayable);
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

    /// Feed one request's outcome to its backend's passive health; eject it
    /// when that was one failure too many (and the tier can spare it).
    pub(super) fn record_outcome(&self, ctx: &RequestCtx, backend: &Backend, outcome: Outcome) {
        let (Some(tier), Some(routing)) = (&ctx.tier, &ctx.routing) else {
            return;
        };
        let cfg = &routing.config.outlier;
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
            self.gw
                .metrics
                .backend_ejections
                .with_label_values(&[&tier.name, &backend.id])
                .inc();
        }
    }

    /// Record, once per request, what it says about its backend (passive
    /// health): when the gateway answers a failure, before that answer is
    /// written; otherwise when the request ends.
    pub(super) fn settle_outcome(
        &self,
        session: &Session,
        e: Option<&Error>,
        ctx: &mut RequestCtx,
    ) {
        if ctx.outcome_settled {
            return;
        }
        ctx.outcome_settled = true;
        if let Some(backend) = ctx.backend.clone() {
            if let Some(outcome) = Self::outcome(session, e, ctx) {
                self.record_outcome(ctx, &backend, outcome);
            }
        }
    }

    /// What a finished request says about its backend: `None` when the
    /// backend was not at fault either way (the client left, bad input).
    pub(super) fn outcome(
        session: &Session,
        e: Option<&Error>,
        ctx: &RequestCtx,
    ) -> Option<Outcome> {
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
}
