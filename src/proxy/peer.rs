//! Peer selection: which backend serves the request (binding, else first
//! placement; least in flight without a session), waiting while another
//! request of the session places it (`Affinity::route`); connect
//! failures and replays; what a request's outcome tells passive health.

use super::*;

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

/// Bytes of a request body per prompt token, for estimating a prefill before
/// the backend has said how many tokens it was (about 4 for English text).
const BODY_BYTES_PER_TOKEN: u64 = 4;

/// The prompt tokens a request's body holds, estimated from its size (read
/// already, or declared in Content-Length, which `request_filter` has held
/// to `max_body_bytes`; 0 when neither is known).
fn body_tokens(ctx: &RequestCtx) -> u64 {
    let bytes = match ctx.body.as_ref() {
        Some(body) => body.len() as u64,
        None => ctx.declared_len.unwrap_or(0),
    };
    bytes / BODY_BYTES_PER_TOKEN
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
        let previous_lease = ctx.lease.take();
        let owner = previous_lease.as_ref().is_some_and(|l| l.owns_pending());
        let mut candidates = tier.candidates(&ctx.excluded);
        // What each candidate holds of the prompt (`affinity.prefix`).
        let held = ctx
            .prefix
            .as_ref()
            .map(|r| self.gw.prefix.look_up(&r.prompt, &mut candidates));

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
                    sref.indexed = held.is_some();
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
        if let (Some(route), Some(held)) = (ctx.prefix.as_mut(), held) {
            let p = &route.prompt;
            let at = candidates.iter().position(|c| c.slot == backend.slot);
            let routed =
                self.gw
                    .prefix
                    .routed(p, backend.slot, at.map(|i| held[i]).unwrap_or_default());
            match held.iter().any(|h| h.blocks > 0) {
                true => tier.metrics.prefix_matched.inc(),
                false => tier.metrics.prefix_none.inc(),
            }
            // Its prefill there: the prompt less what the index says is
            // held. Better than the session's last turn (which under KV
            // pressure found its transcript evicted, yet counts only its
            // growth) or the body less the backend's usual shared prefix.
            new_tokens = Some(body_tokens.saturating_sub(routed.tokens(p)));
            route.routed = Some(routed);
        }
        ctx.in_flight = Some(InFlight::new(
            &backend.stats,
            new_tokens.unwrap_or_else(|| backend.stats.cost.body_estimate(body_tokens)),
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
        ctx.backend = Some(backend);
        Ok(Box::new(peer))
    }

    pub(super) fn least_in_flight(&self, tier: &Tier, candidates: &[Candidate]) -> usize {
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
