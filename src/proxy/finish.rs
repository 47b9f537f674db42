//! The end of a request: the answer to a failure (SPEC §8 JSON errors),
//! then what its end teaches and records: metrics, passive health, the
//! backend's costs, the route's binding and index, the tenant's tokens,
//! the trace.

use super::answer::Answer;
use super::conn_guard;
use super::ctx::RequestCtx;
use super::peer::settle_outcome;
use super::response::Usage;
use crate::affinity::Reason;
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use pingora_core::{Error, ErrorSource, ErrorType};
use pingora_proxy::{FailToProxy, Session};
use std::sync::Arc;

/// `fail_to_proxy`: the answer to a request that failed, unless one has
/// started already (it can only be ended).
pub(super) async fn answer_failure(
    gw: &Gateway,
    session: &mut Session,
    e: &Error,
    ctx: &mut RequestCtx,
) -> FailToProxy {
    let code = match failure(gw, e, ctx) {
        // A response already started cannot be replaced: just end it.
        // (A forwarded `100 Continue` is no answer: the final one can
        // follow. A `101` is: the connection speaks another protocol.)
        Some(g)
            if session.response_written().is_none_or(|r| {
                r.status.is_informational() && r.status != http::StatusCode::SWITCHING_PROTOCOLS
            }) =>
        {
            // The connection closes after this answer (below): say so, or
            // a client reusing it races the close.
            session.set_keepalive(None);
            // The backend's failure counts before the client hears of it:
            // its next request must already see an ejection this causes.
            ctx.record.error = Some(g.clone());
            settle_outcome(gw, session, Some(e), ctx);
            let tier = ctx.tier_name().map(str::to_string);
            let backend = ctx.backend().map(|b| Arc::clone(&b.id));
            let id = ctx.record.request_id.clone();
            if let Err(we) = g
                .write(session, tier.as_deref(), backend.as_deref(), id.as_ref())
                .await
            {
                log::debug!("writing error response failed: {we}");
            }
            g.status
        }
        _ => 0,
    };
    FailToProxy {
        error_code: code,
        can_reuse_downstream: false,
    }
}

/// What a failure `e` is answered with: the error a hook recorded, a slow
/// or malformed client's, the backend's; `None` for a client that left.
fn failure(gw: &Gateway, e: &Error, ctx: &RequestCtx) -> Option<GatewayError> {
    let downstream = e.esource() == &ErrorSource::Downstream;
    if downstream && e.etype() == &ErrorType::WriteTimedout {
        gw.metrics
            .timeouts
            .with_label_values(&["client_write"])
            .inc();
    }
    if let Some(g) = &ctx.record.error {
        return Some(g.clone());
    }
    if downstream {
        let slow = conn_guard::client_timeout(ctx.body.conn.as_deref(), e, &gw.metrics);
        let malformed = matches!(e.etype().as_str(), "InvalidChunk" | "InvalidTrailerEnd");
        if malformed {
            if let Some(route) = &ctx.route {
                route.forget_new_binding(gw.tables());
            }
        }
        if slow.is_some() {
            return slow;
        }
        if malformed {
            return Some(GatewayError::bad_body(format!(
                "malformed request body: {}",
                e.etype().as_str()
            )));
        }
    }
    let backend = ctx.backend().map_or("?", |b| &*b.id);
    match (e.etype(), e.esource()) {
        (ErrorType::HTTPStatus(code), _) => Some(GatewayError {
            status: *code,
            kind: "gateway_error",
            code: "gateway_error",
            message: e.to_string(),
            retry_after: None,
        }),
        (ErrorType::ReadTimedout, ErrorSource::Upstream) => {
            gw.metrics
                .timeouts
                .with_label_values(&["upstream_read"])
                .inc();
            let timeout = ctx
                .route
                .as_ref()
                .and_then(|r| r.request().routing().config.server.read_timeout);
            Some(GatewayError::upstream_timeout(format!(
                "backend {backend} sent nothing for {} ms",
                timeout.map_or(0, |t| t.as_millis())
            )))
        }
        (_, ErrorSource::Upstream) => Some(GatewayError::upstream_failed(format!(
            "backend {backend} failed: {}",
            e.etype().as_str()
        ))),
        (_, ErrorSource::Downstream) => None,
        _ => Some(GatewayError {
            status: 500,
            kind: "internal_error",
            code: "internal_error",
            message: "internal gateway error".into(),
            retry_after: None,
        }),
    }
}

/// `logging`: the request ended (answered, failed or abandoned).
pub(super) async fn finish(
    gw: &Gateway,
    session: &mut Session,
    e: Option<&Error>,
    ctx: &mut RequestCtx,
) {
    if let Some(conn) = &ctx.body.conn {
        conn.request_done();
    }
    settle_outcome(gw, session, e, ctx);
    let status = session
        .response_written()
        .map(|r| r.status.as_u16())
        .or(ctx.record.error.as_ref().map(|g| g.status))
        .unwrap_or(0);
    count(gw, ctx, status);
    let usage = ctx.answer.usage();
    // A socket's usage is its turns' added up; they teach no one cost.
    let answer = usage.filter(|_| ctx.answer.websocket.is_none());
    let answered = status == 200 && ctx.backend().is_some() && ctx.answer.first_byte.is_some();
    let prefill_seen = match (answer, answered) {
        (Some(u), true) => learn_cost(ctx, u),
        _ => None,
    };
    if status == 200 {
        vote_on_prefills(gw, ctx, prefill_seen);
    }
    if let Some(route) = &ctx.route {
        let reported = usage.map(|u| (u.prompt_tokens, u.cached_tokens));
        let answered = answered && answer.is_some();
        if route.end(gw.tables(), status, reported, answered) {
            let backend = ctx.backend().map_or("none", |b| &*b.id);
            gw.metrics
                .prefix_index_corrections
                .with_label_values(&[ctx.tier_name().unwrap_or("none"), backend])
                .inc();
        }
    }
    tenant(gw, ctx, usage);
    if let Some(r) = &ctx.who.reservation {
        // Its tenant's tokens, settled by what it used.
        let used = usage.map(|u| u.prompt_tokens + u.completion_tokens);
        r.settle(used, ctx.answer.first_byte.is_some()).await;
    }
    tokens(gw, ctx, usage);
    trace(gw, session, ctx, status, usage);
}

/// The request's metrics: errors, durations, hits and misses, requests by
/// status.
fn count(gw: &Gateway, ctx: &RequestCtx, status: u16) {
    let m = &gw.metrics;
    let tier_name = ctx.tier_name().unwrap_or("none");
    if let Some(g) = &ctx.record.error {
        m.gateway_errors
            .with_label_values(&[tier_name, &g.status.to_string()])
            .inc();
    }
    if let Some(route) = &ctx.route {
        let tier = route.tier();
        tier.metrics
            .duration
            .observe(ctx.record.start.elapsed().as_secs_f64());
        if let Some(fb) = ctx.answer.first_byte {
            tier.metrics
                .ttfb
                .observe(fb.duration_since(ctx.record.start).as_secs_f64());
        }
        if let (Some(d), true) = (route.decision(), route.request().bound()) {
            match d.affinity_hit {
                true => tier.metrics.hits.inc(),
                false => tier.metrics.misses.inc(),
            }
        }
    }
    let backend_id = ctx.backend().map_or("none", |b| &*b.id);
    match ctx.backend() {
        Some(b) if status == 200 => b.counters.ok_requests(m, tier_name, backend_id).inc(),
        _ => m
            .requests
            .with_label_values(&[tier_name, backend_id, &status.to_string()])
            .inc(),
    }
}

/// What a 200's usage `u` teaches of its backend: its prefill cost and
/// queueing, and what a first prompt finds cached there. Returns its
/// prefill part and uncached tokens, as its usage tells them.
fn learn_cost(ctx: &RequestCtx, u: Usage) -> Option<(std::time::Duration, u64)> {
    let (route, b, fb) = (ctx.route.as_ref()?, ctx.backend()?, ctx.answer.first_byte?);
    let in_flight = ctx.answer.in_flight.as_ref();
    let (alone, behind) = in_flight.map_or((false, None), |f| f.explains());
    // From when it was sent on: a wait for a slot here is not the
    // backend's (the cost learned it as prefill before).
    let ttfb = fb.duration_since(in_flight.map_or(ctx.record.start, |f| f.sent));
    let cost = &b.stats.cost;
    if ctx.answer.streamed {
        cost.observe_decode(fb.elapsed(), u.completion_tokens);
    }
    // An engine that does not report its cache: what the gateway
    // expected to be cached there stands in for it.
    let cached = u.cached_tokens.unwrap_or_else(|| {
        let uncached = in_flight.map_or(1.0, |f| f.uncached_share);
        (u.prompt_tokens as f64 * (1.0 - uncached)) as u64
    });
    let prefill = cost.prefill_part(ttfb, u.completion_tokens, ctx.answer.streamed);
    if let Some(prefill) = prefill {
        cost.observe(prefill, u.prompt_tokens, cached, alone, behind);
    }
    let first_turn = route
        .decision()
        .is_some_and(|d| d.reason == Reason::FirstTurn);
    if let (true, None, Some(reported)) = (first_turn, route.request().parent(), u.cached_tokens) {
        cost.observe_first_prompt(reported);
    }
    Some((prefill?, u.prompt_tokens.saturating_sub(cached)))
}

/// What an answer says about whether its engine's prefills queue behind
/// each other: what admission learns its cap on prefills from
/// ([`crate::admission::Admission::vote_prefill`]). Its prefill part and
/// uncached tokens come from its usage (`seen`), or, for a stream without
/// usage (the SDKs' default), from its first byte and the gateway's
/// estimate.
fn vote_on_prefills(gw: &Gateway, ctx: &RequestCtx, seen: Option<(std::time::Duration, u64)>) {
    let Answer {
        in_flight: Some(f),
        first_byte: Some(fb),
        streamed,
        websocket,
        ..
    } = &ctx.answer
    else {
        return;
    };
    let Some(b) = ctx.backend() else {
        return;
    };
    let Some((prefill, uncached)) = seen.or_else(|| {
        (*streamed && websocket.is_none()).then(|| (fb.duration_since(f.sent), f.tokens))
    }) else {
        return;
    };
    let cost = &b.stats.cost;
    if f.on_its_own() && cost.observe_own(prefill, uncached) {
        gw.admission.prefill_cost_known(b.slot);
    }
    let Some(permit) = ctx.who.permit.as_ref() else {
        return;
    };
    // Behind another gateway's prefill, the work ahead is a rough guess.
    let rough = permit.fleet_ahead.tokens > 0;
    let vote = f.sent_behind().and_then(|ahead| match rough {
        true => cost.prefill_vote_rough(prefill, uncached, ahead),
        false => cost.prefill_vote(prefill, uncached, ahead),
    });
    // A probe sent behind too little work to tell says so (not one whose
    // wait fell between the rough bounds: that tells nothing).
    if vote.is_none() && (rough || !(permit.probe && cost.knows_own_cost())) {
        return;
    }
    log::debug!(
        "backend {}: prefill vote {vote:?} (sent behind {:?}, {uncached} tokens of its own, {prefill:?})",
        b.id,
        f.sent_behind()
    );
    match gw.admission.vote_prefill(b.slot, vote) {
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

/// With client keys: the request and its tokens by tenant (the keys
/// file's names; everyone else is `other`).
fn tenant(gw: &Gateway, ctx: &RequestCtx, usage: Option<Usage>) {
    let keys = ctx
        .route
        .as_ref()
        .map(|r| r.request().routing())
        .is_some_and(|r| r.config.auth.keys_file.is_some());
    if !keys {
        return;
    }
    let m = &gw.metrics;
    let counters = match &ctx.who.client {
        Some(c) => c.tenant.counters.get_or_init(|| m.tenant(&c.tenant.name)),
        None => gw.other_tenant.get_or_init(|| m.tenant("other")),
    };
    counters.requests.inc();
    if let Some(u) = usage {
        counters.prompt_tokens.inc_by(u.prompt_tokens);
        counters.completion_tokens.inc_by(u.completion_tokens);
    }
}

/// The backend's prompt and cached prompt tokens, from the answer's usage.
fn tokens(gw: &Gateway, ctx: &RequestCtx, usage: Option<Usage>) {
    let (Some(u), Some(b)) = (usage, ctx.backend()) else {
        return;
    };
    let m = &gw.metrics;
    let tier_name = ctx.tier_name().unwrap_or("none");
    b.counters
        .prompt_tokens(m, tier_name, &b.id)
        .inc_by(u.prompt_tokens);
    if let Some(cached) = u.cached_tokens {
        b.counters
            .cached_prompt_tokens(m, tier_name, &b.id)
            .inc_by(cached);
    }
}

/// The request's span (`telemetry`) and its line in the trace log.
fn trace(gw: &Gateway, session: &Session, ctx: &RequestCtx, status: u16, usage: Option<Usage>) {
    let req = session.req_header();
    let route = ctx.route.as_ref();
    let decision = route.and_then(|r| r.decision());
    let session_id = route
        .and_then(|r| r.request().session())
        .map(|s| s.id.as_str());
    let reason = decision.map(|d| d.reason.as_str());
    let hit = decision.is_some_and(|d| d.affinity_hit);
    if let (Some(t), Some(span)) = (&gw.telemetry, &ctx.record.span) {
        t.end(
            span,
            &req.headers,
            &crate::telemetry::Finished {
                method: req.method.as_str(),
                path: req.uri.path(),
                model: ctx.record.model.as_deref(),
                status,
                error_code: ctx.record.error.as_ref().map(|g| g.code),
                request_id: ctx.record.request_id(),
                tier: ctx.tier_name(),
                backend: ctx.backend().map(|b| (&*b.id, b.addr)),
                affinity_hit: hit,
                reason,
                session: session_id,
                queue_wait: ctx.who.queue_wait,
                usage: usage.map(|u| (u.prompt_tokens, u.completion_tokens, u.cached_tokens)),
            },
        );
    }
    if let Some(trace) = &gw.trace {
        let start = ctx.record.start;
        trace.record(&crate::trace::TraceRecord {
            // Wall-clock start: now, less what the request took.
            time_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.saturating_sub(start.elapsed()).as_millis() as u64),
            request_id: ctx.record.request_id(),
            trace_id: ctx.record.span.as_ref().map(|s| s.trace_id()),
            method: req.method.as_str(),
            path: req.uri.path(),
            tier: ctx.tier_name(),
            session: session_id,
            parent: route.and_then(|r| r.request().parent()),
            backend: ctx.backend().map(|b| &*b.id),
            affinity_hit: hit,
            reason,
            moved_because: decision.and_then(|d| d.moved).map(|m| m.as_str()),
            prefix_tokens: route.and_then(|r| r.request().prefix_tokens()),
            status,
            prompt_tokens: usage.map(|u| u.prompt_tokens),
            cached_tokens: usage.and_then(|u| u.cached_tokens),
            ttfb_ms: ctx
                .answer
                .first_byte
                .map(|fb| fb.duration_since(start).as_secs_f64() * 1000.0),
            total_ms: start.elapsed().as_secs_f64() * 1000.0,
        });
    }
}
