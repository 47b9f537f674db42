//! The end of a request: the answer to a failure (SPEC §8 JSON errors),
//! then metrics, passive health, usage and the trace record.

use super::*;

impl GatewayProxy {
    pub(super) async fn answer_failure(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy {
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
            // request made (a binding that existed before stays), here and
            // in the fleet's store, which it was written to when placed.
            if let (Some(sref), Some(true)) =
                (&ctx.session_ref, ctx.reason.map(Reason::new_binding))
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
                retry_after: None,
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
                    retry_after: None,
                }),
            },
        };
        let code = match gateway_error {
            // A response already started cannot be replaced: just end it.
            // (A forwarded `100 Continue` is no answer: the final one can
            // follow. A `101` is: the connection speaks another protocol.)
            Some(g)
                if session.response_written().is_none_or(|r| {
                    r.status.is_informational() && r.status != http::StatusCode::SWITCHING_PROTOCOLS
                }) =>
            {
                // The connection closes after this answer (below): say so,
                // or a client reusing it races the close.
                session.set_keepalive(None);
                // The backend's failure counts before the client hears of it:
                // its next request must already see an ejection this causes.
                ctx.error = Some(g.clone());
                self.settle_outcome(session, Some(e), ctx);
                let tier = ctx.tier_name().map(str::to_string);
                let status = g.status;
                let backend = ctx.backend.as_ref().map(|b| Arc::clone(&b.id));
                let id = ctx.request_id.clone();
                if let Err(we) = g
                    .write(session, tier.as_deref(), backend.as_deref(), id.as_ref())
                    .await
                {
                    log::debug!("writing error response failed: {we}");
                }
                status
            }
            _ => 0,
        };
        FailToProxy {
            error_code: code,
            can_reuse_downstream: false,
        }
    }

    pub(super) async fn finish(
        &self,
        session: &mut Session,
        e: Option<&Error>,
        ctx: &mut RequestCtx,
    ) {
        if let Some(conn) = &ctx.conn {
            conn.request_done();
        }
        self.settle_outcome(session, e, ctx);
        let tier_name = ctx.tier_name().unwrap_or("none");
        let status = session
            .response_written()
            .map(|r| r.status.as_u16())
            .or(ctx.error.as_ref().map(|g| g.status))
            .unwrap_or(0);
        let m = &self.gw.metrics;
        if let Some(g) = &ctx.error {
            m.gateway_errors
                .with_label_values(&[tier_name, &g.status.to_string()])
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
        match &ctx.backend {
            Some(b) if status == 200 => b.counters.ok_requests(m, tier_name, backend_id).inc(),
            _ => m
                .requests
                .with_label_values(&[tier_name, backend_id, &status.to_string()])
                .inc(),
        }
        // A socket's usage is its turns' added up; they teach no one cost.
        let usage = match &ctx.websocket {
            Some(ws) => ws.usage,
            None => ctx.usage.as_ref().and_then(UsageScanner::usage),
        };
        // What the backend's answer teaches: its prefill cost and queueing,
        // and how much of this session it still had cached.
        let answer = usage.filter(|_| ctx.websocket.is_none());
        // Its prefill part and uncached tokens, as its usage tells them.
        let mut prefill_seen = None;
        if let (Some(u), Some(b), Some(fb), 200) = (answer, &ctx.backend, ctx.first_byte, status) {
            let (alone, behind) = ctx
                .in_flight
                .as_ref()
                .map_or((false, None), |f| f.explains());
            // From when it was sent on: a wait for a slot here is not the
            // backend's (the cost learned it as prefill before).
            let ttfb = fb.duration_since(ctx.in_flight.as_ref().map_or(ctx.start, |f| f.sent));
            if ctx.streamed {
                b.stats
                    .cost
                    .observe_decode(fb.elapsed(), u.completion_tokens);
            }
            // An engine that does not report its cache: what the gateway
            // expected to be cached there stands in for it.
            let cached = u.cached_tokens.unwrap_or_else(|| {
                let uncached = ctx.in_flight.as_ref().map_or(1.0, |f| f.uncached_share);
                (u.prompt_tokens as f64 * (1.0 - uncached)) as u64
            });
            if let Some(prefill) =
                b.stats
                    .cost
                    .prefill_part(ttfb, u.completion_tokens, ctx.streamed)
            {
                b.stats
                    .cost
                    .observe(prefill, u.prompt_tokens, cached, alone, behind);
                prefill_seen = Some((prefill, u.prompt_tokens.saturating_sub(cached)));
            }
            if let (Some(Reason::FirstTurn), None, Some(reported)) =
                (ctx.reason, &ctx.parent, u.cached_tokens)
            {
                b.stats.cost.observe_first_prompt(reported);
            }
            if let Some(sref) = ctx.session_ref.as_ref().filter(|_| !ctx.session_final) {
                self.gw
                    .affinity
                    .record_usage(sref.key, u.prompt_tokens, u.cached_tokens);
            }
        }
        if status == 200 {
            self.vote_on_prefills(ctx, prefill_seen);
        }
        // The backend answered: it holds the prompt now, and what it
        // reports cached corrects the index.
        if let Some(route) = ctx.prefix.as_deref() {
            let reported = usage.map(|u| (u.prompt_tokens, u.cached_tokens));
            if route.settle(&self.gw.prefix, status == 200, reported) {
                m.prefix_index_corrections
                    .with_label_values(&[tier_name, backend_id])
                    .inc();
            }
        }
        if ctx
            .routing
            .as_ref()
            .is_some_and(|r| r.config.auth.keys_file.is_some())
        {
            // By tenant (the keys file's names; everyone else is `other`).
            let counters = match &ctx.who.client {
                Some(c) => c.tenant.counters.get_or_init(|| m.tenant(&c.tenant.name)),
                None => self.gw.other_tenant.get_or_init(|| m.tenant("other")),
            };
            counters.requests.inc();
            if let Some(u) = usage {
                counters.prompt_tokens.inc_by(u.prompt_tokens);
                counters.completion_tokens.inc_by(u.completion_tokens);
            }
            if let (Some(c), Some(tally)) = (&ctx.who.client, &ctx.who.tokens) {
                let used = usage.map(|u| u.prompt_tokens + u.completion_tokens);
                let settle = tally.settle(used, ctx.first_byte.is_some());
                let fleet = self.gw.store.as_ref().filter(|_| ctx.who.fleet_rates);
                let settled = match fleet {
                    Some(store) => c.charge_fleet_tokens(store, settle).await.is_ok(),
                    None => false,
                };
                if !settled {
                    c.charge_tokens(settle);
                }
            }
        }
        if let (Some(u), Some(b)) = (usage, &ctx.backend) {
            b.counters
                .prompt_tokens(m, tier_name, backend_id)
                .inc_by(u.prompt_tokens);
            if let Some(cached) = u.cached_tokens {
                b.counters
                    .cached_prompt_tokens(m, tier_name, backend_id)
                    .inc_by(cached);
            }
        }
        if let (Some(t), Some(span)) = (&self.gw.telemetry, &ctx.span) {
            let req = session.req_header();
            t.end(
                span,
                &req.headers,
                &crate::telemetry::Finished {
                    method: req.method.as_str(),
                    path: req.uri.path(),
                    model: ctx.model.as_deref(),
                    status,
                    error_code: ctx.error.as_ref().map(|g| g.code),
                    request_id: ctx
                        .request_id
                        .as_ref()
                        .map_or("", |v| v.to_str().unwrap_or_default()),
                    tier: ctx.tier_name(),
                    backend: ctx.backend.as_ref().map(|b| (&*b.id, b.addr)),
                    affinity_hit: ctx.affinity_hit,
                    reason: ctx.reason.map(Reason::as_str),
                    session: ctx.session.as_ref().map(|s| s.id.as_str()),
                    queue_wait: ctx.who.queue_wait,
                    usage: usage.map(|u| (u.prompt_tokens, u.completion_tokens, u.cached_tokens)),
                },
            );
        }
        if let Some(trace) = &self.gw.trace {
            let req = session.req_header();
            trace.record(&crate::trace::TraceRecord {
                // Wall-clock start: now, less what the request took.
                time_ms: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| {
                        d.saturating_sub(ctx.start.elapsed()).as_millis() as u64
                    }),
                request_id: ctx
                    .request_id
                    .as_ref()
                    .map_or("", |v| v.to_str().unwrap_or_default()),
                trace_id: ctx.span.as_ref().map(|s| s.trace_id()),
                method: req.method.as_str(),
                path: req.uri.path(),
                tier: ctx.tier_name(),
                session: ctx.session.as_ref().map(|s| s.id.as_str()),
                parent: ctx.parent.as_deref(),
                backend: ctx.backend.as_ref().map(|b| &*b.id),
                affinity_hit: ctx.affinity_hit,
                reason: ctx.reason.map(Reason::as_str),
                moved_because: ctx.moved.map(|m| m.as_str()),
                prefix_tokens: ctx.prefix_tokens(),
                status,
                prompt_tokens: usage.map(|u| u.prompt_tokens),
                cached_tokens: usage.and_then(|u| u.cached_tokens),
                ttfb_ms: ctx
                    .first_byte
                    .map(|fb| fb.duration_since(ctx.start).as_secs_f64() * 1000.0),
                total_ms: ctx.start.elapsed().as_secs_f64() * 1000.0,
            });
        }
    }
}

impl GatewayProxy {
    /// What an answer says about whether its engine's prefills queue behind
    /// each other: what admission learns its cap on prefills from
    /// ([`crate::admission::Admission::vote_prefill`]). Its prefill part
    /// and uncached tokens come from its usage (`seen`), or, for a stream
    /// without usage (the SDKs' default), from its first byte and the
    /// gateway's estimate.
    fn vote_on_prefills(&self, ctx: &RequestCtx, seen: Option<(std::time::Duration, u64)>) {
        let (Some(b), Some(fb), Some(f)) = (&ctx.backend, ctx.first_byte, ctx.in_flight.as_ref())
        else {
            return;
        };
        let Some((prefill, uncached)) = seen.or_else(|| {
            (ctx.streamed && ctx.websocket.is_none()).then(|| (fb.duration_since(f.sent), f.tokens))
        }) else {
            return;
        };
        let cost = &b.stats.cost;
        if f.on_its_own() && cost.observe_own(prefill, uncached) {
            self.gw.admission.prefill_cost_known(b.slot);
        }
        let Some(permit) = ctx.who.permit.as_ref() else {
            return;
        };
        let vote = f
            .sent_behind()
            .and_then(|ahead| cost.prefill_vote(prefill, uncached, ahead));
        // A probe sent behind too little work to tell says so.
        if vote.is_none() && !(permit.probe && cost.knows_own_cost()) {
            return;
        }
        log::debug!(
            "backend {}: prefill vote {vote:?} (sent behind {:?}, {uncached} tokens of its own, {prefill:?})",
            b.id,
            f.sent_behind()
        );
        match self.gw.admission.vote_prefill(b.slot, vote) {
            Some(true) => log::info!(
                "backend {}: prefills queue behind each other; one at a time",
                b.id
            ),
            Some(false) => log::info!(
                "backend {}: prefills run side by side; no cap on them",
                b.id
            ),
            None => {}
        }
    }
}
