//! Request filters: whether the request is acceptable at all (headers,
//! size, its client key and limits), its body read when routing needs it,
//! and what routing makes of it ([`crate::routing::Intake`]).

use super::conn_guard::{self, GuardedStream};
use super::ctx::RequestCtx;
use super::record::RequestIds;
use super::request_body::{self, PreReadError};
use crate::admission::Reservation;
use crate::affinity::session::RequestHeaders;
use crate::config::Config;
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use crate::routing::{BodyNeed, Intake, Route};
use bytes::Bytes;
use pingora_core::Result;
use pingora_http::RequestHeader;
use pingora_proxy::Session;
use std::sync::Arc;

/// `request_filter`: `Ok(true)` when the request was answered here.
pub(super) async fn filter(
    gw: &Gateway,
    ids: &RequestIds,
    session: &mut Session,
    ctx: &mut RequestCtx,
) -> Result<bool> {
    let limits = gw.routing().config.server.client;
    // Pingora's per-read timers: a body that stalls, a client that stops
    // reading its response (the lease and backend connection go with it).
    session.set_read_timeout(Some(limits.body_idle_timeout));
    session.set_write_timeout(Some(limits.write_timeout));
    // Pipelined requests are answered in order instead of dropped.
    session.set_pipelining_enabled(true);
    ctx.body.conn = GuardedStream::of(session.stream()).cloned();
    if let Some(conn) = &ctx.body.conn {
        conn.headers_done(!session.is_body_empty());
    }
    ctx.record.request_id = Some(ids.id(&session.req_header().headers));
    if let Some(t) = &gw.telemetry {
        ctx.record.span = Some(t.start(&session.req_header().headers));
    }
    match read(gw, session, ctx).await {
        Ok(()) => Ok(false),
        Err(e) => {
            let tier = ctx.tier_name().map(str::to_string);
            e.write(
                session,
                tier.as_deref(),
                None,
                ctx.record.request_id.as_ref(),
            )
            .await?;
            ctx.record.error = Some(e);
            Ok(true)
        }
    }
}

/// Everything `request_filter` decides; `Err` is answered to the client.
async fn read(
    gw: &Gateway,
    session: &mut Session,
    ctx: &mut RequestCtx,
) -> std::result::Result<(), GatewayError> {
    let routing = gw.routing();
    let cfg = &routing.config;
    settle_path(session)?;
    let req = session.req_header();
    check_headers(cfg, req)?;
    let headers = RequestHeaders::new(&req.headers);
    let mut intake = Intake::read(
        Arc::clone(&routing),
        &headers,
        &req.uri,
        session.is_upgrade_req(),
    )?;
    identify(gw, cfg, &req.headers, ctx)?;
    let of_key = ctx.who.client.as_ref().map(|c| c.tenant.scope.as_str());
    intake.scope(of_key, &headers)?;
    let declared = request_body::content_length(session)?;
    let limit = cfg.server.max_body_bytes;
    if declared.is_some_and(|len| len > limit) {
        return Err(GatewayError::body_too_large(limit));
    }
    ctx.body.declared = declared;
    intake.tier(&headers)?;
    intake.read_path(gw.tables()).await;
    let has_body = method_has_body(req) && declared != Some(0);
    let need = intake.body_need(gw.tables(), has_body, declared);
    let max_output = read_body(gw, cfg, session, ctx, &mut intake, need).await?;
    let body_len = match &ctx.body.whole {
        Some(body) => body.len() as u64,
        None => declared.unwrap_or(0),
    };
    let route = ctx.route.insert(Route::new(intake.finish(body_len)));
    // Its tenant's per-minute limits, its tokens as estimated now.
    if let Some(r) = ctx.who.reservation.as_mut() {
        let prompt = route.request().prompt_tokens();
        r.reserve(prompt, max_output, &gw.metrics).await?;
    }
    Ok(())
}

/// The request's path as the engine will read it, from here on (routing,
/// salting, limits) and upstream ([`crate::routing::path`]).
fn settle_path(session: &mut Session) -> std::result::Result<(), GatewayError> {
    let req = session.req_header();
    if !req.raw_path_is_utf8() {
        return Err(GatewayError::bad_path(
            "the request path is not UTF-8".into(),
        ));
    }
    let sent = req.uri.path_and_query().map_or("/", |p| p.as_str());
    let settled = crate::routing::path::canonical(sent)?;
    // An absolute-form target (`http://host/path`) goes upstream as its path.
    let origin_form = req.raw_path() == sent.as_bytes();
    if settled.is_none() && origin_form {
        return Ok(());
    }
    let target = settled.unwrap_or_else(|| sent.to_string());
    let uri = http::Uri::try_from(target)
        .map_err(|_| GatewayError::bad_path("the request path is not a valid URI".into()))?;
    session.req_header_mut().set_uri(uri);
    Ok(())
}

/// What no request may be without: a `Host` (HTTP/1.1), headers within
/// `server.client.max_header_bytes`.
fn check_headers(cfg: &Config, req: &RequestHeader) -> std::result::Result<(), GatewayError> {
    if req.version == http::Version::HTTP_11 && !req.headers.contains_key(http::header::HOST) {
        return Err(GatewayError::missing_host());
    }
    let limit = cfg.server.client.max_header_bytes;
    if header_bytes(req) > limit {
        return Err(GatewayError::headers_too_large(limit));
    }
    Ok(())
}

/// Who sent the request: its key's tenant (401 without a known key where
/// keys are required; 429 over the tenant's limits), its fair-share
/// tenant, priority class and deadline.
fn identify(
    gw: &Gateway,
    cfg: &Config,
    headers: &http::HeaderMap,
    ctx: &mut RequestCtx,
) -> std::result::Result<(), GatewayError> {
    let key = crate::auth::presented_key(headers);
    let client = match (&cfg.auth.keys_file, key) {
        (Some(_), Some(k)) => gw.auth.keys().look_up(k),
        _ => None,
    };
    if client.is_none() && cfg.auth.required {
        gw.metrics
            .client_rejected
            .with_label_values(&["other", "unauthorized"])
            .inc();
        return Err(GatewayError::unauthorized());
    }
    if let Some(c) = &client {
        let mut r = Reservation::open(Arc::clone(c), gw.fleet_rates.as_ref(), &gw.metrics)?;
        r.cuts_streams = cfg.auth.stream_over_limit == crate::config::StreamOverLimit::Cut;
        ctx.who.reservation = Some(Box::new(r));
    }
    ctx.who.client = client;
    let adm = &cfg.admission;
    if adm.enabled {
        let rules = crate::admission::who::Rules {
            priority_header: &adm.priority_header,
            max_wait_header: &adm.max_wait_header,
            default_priority: adm.default_priority,
            max_wait: adm.max_wait,
        };
        ctx.who
            .classify(&rules, headers, key)
            .map_err(|_| GatewayError::bad_priority(adm.priority_header.as_str()))?;
    }
    Ok(())
}

/// Read the body before routing when it `need`s it and the budget allows
/// (bodies read to route count against a global budget: a burst of large
/// ones is refused, retry later, instead of exhausting memory), or when it
/// is kept whole for a replay; routing reads what it says. Returns the
/// output tokens it may ask for (`max_tokens`), when read.
async fn read_body(
    gw: &Gateway,
    cfg: &Config,
    session: &mut Session,
    ctx: &mut RequestCtx,
    intake: &mut Intake,
    need: BodyNeed,
) -> std::result::Result<Option<u64>, GatewayError> {
    let declared = ctx.body.declared;
    let limit = cfg.server.max_body_bytes;
    let mut route_hold = None;
    let mut needs_body = need != BodyNeed::None;
    if needs_body {
        let reserve = declared.unwrap_or(request_body::UNKNOWN_LENGTH_RESERVE);
        route_hold = gw
            .body_budget
            .try_hold(reserve.min(limit), cfg.server.preread_budget_bytes);
        match (&route_hold, need) {
            (None, BodyNeed::Must) => return Err(GatewayError::busy_reading_bodies()),
            (None, _) => needs_body = false,
            _ => {}
        }
    }
    // A body larger than Pingora's retry buffer is kept whole (within the
    // budget) so that a request meeting a dead pooled connection can be
    // re-sent; smaller ones Pingora's own buffer replays.
    let replay_hold = match declared {
        Some(len)
            if !needs_body
                && len > request_body::RETRY_BUFFER_BYTES
                && len <= cfg.server.replay_body_bytes =>
        {
            gw.body_budget.try_hold(len, cfg.server.replay_budget_bytes)
        }
        _ => None,
    };
    if !needs_body && replay_hold.is_none() {
        return Ok(None);
    }
    let body = pre_read(gw, session, ctx, declared, limit).await?;
    ctx.body.bytes = body.len() as u64;
    ctx.body.hold = replay_hold.or_else(|| {
        // What the body turned out to be, not what was reserved.
        drop(route_hold);
        Some(gw.body_budget.hold(ctx.body.bytes))
    });
    let mut max_output = None;
    let mut body = body;
    if needs_body {
        let facts = intake.read_body(gw.tables(), &body).await?;
        max_output = facts.max_output;
        ctx.body.asks_stream = facts.asks_stream;
        if ctx.record.sampled() {
            ctx.record.model = facts.model.as_deref().map(Box::from);
        }
        if let Some(rewritten) = facts.rewritten {
            // Sent in its place, with its own length (see modify.rs).
            body = Bytes::from(rewritten);
            ctx.body.rewritten = true;
        }
    }
    ctx.body.whole = Some(body);
    Ok(max_output)
}

/// The whole body, read now (see request_body.rs).
async fn pre_read(
    gw: &Gateway,
    session: &mut Session,
    ctx: &mut RequestCtx,
    declared: Option<u64>,
    limit: u64,
) -> std::result::Result<Bytes, GatewayError> {
    let body = match request_body::pre_read(session, declared, limit).await {
        Ok(b) => b,
        Err(PreReadError::Refused(e)) => return Err(e),
        Err(PreReadError::Io(e)) => {
            let conn = ctx.body.conn.as_deref();
            return Err(conn_guard::client_timeout(conn, &e, &gw.metrics)
                .unwrap_or_else(|| GatewayError::bad_body(format!("reading the body: {e}"))));
        }
    };
    if let Some(conn) = &ctx.body.conn {
        conn.body_done();
    }
    Ok(body)
}

/// `request_body_filter`: a body read before routing is sent whole; one
/// streaming through is held to `server.max_body_bytes` (a socket's, one
/// message at a time) and looked at for what admission and a sampled span
/// want of it.
pub(super) async fn body_filter(
    gw: &Gateway,
    body: &mut Option<Bytes>,
    end_of_stream: bool,
    ctx: &mut RequestCtx,
) -> std::result::Result<(), GatewayError> {
    if end_of_stream {
        if let Some(conn) = &ctx.body.conn {
            conn.body_done();
        }
    }
    if let Some(full) = &ctx.body.whole {
        // See request_body.rs: this is the replayed tail; send everything.
        *body = Some(full.clone());
        return Ok(());
    }
    ctx.who.body_seen(body.as_deref(), end_of_stream);
    // A sampled span names the model of a body that streams through unread.
    if ctx.record.model.is_none() && ctx.record.sampled() {
        ctx.record.model = body.as_deref().and_then(model_in).map(Box::from);
    }
    if let Some(chunk) = body {
        ctx.body.bytes += chunk.len() as u64;
        let limit = ctx.route.as_ref().map_or(u64::MAX, |r| {
            r.request().routing().config.server.max_body_bytes
        });
        // A socket's turns are held to the limit one message at a time,
        // and each after its first (the upgrade counted that one) is a
        // request of its tenant: over a per-minute limit, the socket ends.
        let count = ctx
            .who
            .reservation
            .as_ref()
            .is_some_and(|r| r.counts_requests());
        let (over, turns) = match ctx.answer.websocket.as_mut() {
            Some(ws) => match ws.client_bytes(chunk, limit, count) {
                Ok(turns) => (false, turns),
                Err(_) => (true, 0),
            },
            None => (ctx.body.bytes > limit, 0),
        };
        if over {
            return Err(GatewayError::body_too_large(limit));
        }
        if turns > 0 {
            if let Some(r) = ctx.who.reservation.as_mut() {
                r.socket_turns(turns, &gw.metrics).await?;
            }
        }
        // A socket turn's `previous_response_id` as the engine knows it.
        if let (Some(ws), Some(route)) = (ctx.answer.websocket.as_mut(), ctx.route.as_ref()) {
            if let Some(out) = ws.forward_to_backend(chunk, |id| route.engine_response_id(id)) {
                *chunk = Bytes::from(out);
            }
        }
    }
    Ok(())
}

/// About what the request line and headers took on the wire.
fn header_bytes(req: &RequestHeader) -> usize {
    let uri = req.uri.path_and_query().map_or(1, |p| p.as_str().len())
        + req.uri.authority().map_or(0, |a| a.as_str().len());
    fields_bytes(&req.headers, req.method.as_str().len() + uri + 12)
}

pub(super) fn fields_bytes(headers: &http::HeaderMap, start: usize) -> usize {
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

/// The `model` member of a piece of a request body, when it is a plain
/// string there (one split between pieces or holding escapes is not read).
fn model_in(chunk: &[u8]) -> Option<&str> {
    memchr::memmem::find_iter(chunk, b"\"model\"").find_map(|at| {
        let rest = chunk[at + 7..].trim_ascii_start().strip_prefix(b":")?;
        let rest = rest.trim_ascii_start().strip_prefix(b"\"")?;
        let end = memchr::memchr2(b'"', b'\\', rest)?;
        (rest[end] == b'"' && (1..=256).contains(&end))
            .then(|| std::str::from_utf8(&rest[..end]).ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_plain_model_member_is_read_from_a_piece_of_body() {
        use super::model_in;
        assert_eq!(
            model_in(br#"{"messages":[],"model" : "qwen3-8b"}"#),
            Some("qwen3-8b")
        );
        assert_eq!(model_in(br#"{"content":"model","model":"m"}"#), Some("m"));
        assert_eq!(model_in(br#"{"model":"a\"b"}"#), None);
        assert_eq!(model_in(br#"{"model":""}"#), None);
        assert_eq!(model_in(br#"{"model":"unterminated"#), None);
        assert_eq!(model_in(br#"{"model":7}"#), None);
    }
}
