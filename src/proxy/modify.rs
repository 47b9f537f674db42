//! Request and response modifiers: headers to the backend, response
//! metadata (headers and the `x_agent_serve` member), usage and a stored
//! response's id read on the way.

use super::answer::{Answer, Cut};
use super::ctx::RequestCtx;
use super::request::fields_bytes;
use super::response::{IdRewriter, JsonAppender, ResponseIdScanner, UsageScanner};
use super::upstream_conn;
use super::websocket::WebSocket;
use crate::errors::GatewayError;
use crate::gateway::Gateway;
use crate::headers;
use crate::routing::Route;
use bytes::Bytes;
use pingora_core::Result;
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::Session;
use std::time::Instant;

/// Anthropic's client key header, stripped upstream with `Authorization`.
const X_API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");

/// `upstream_request_filter`: the request id and trace upstream, keys
/// stripped or set (`upstream_authorization`).
pub(super) fn upstream_request(
    session: &Session,
    upstream_request: &mut RequestHeader,
    ctx: &RequestCtx,
) -> Result<()> {
    if let Some(body) = &ctx.body.whole {
        // The gateway already answered the client's 100-continue.
        upstream_request.remove_header("expect");
        if ctx.body.rewritten
            && upstream_request
                .headers
                .contains_key(http::header::CONTENT_LENGTH)
        {
            upstream_request.insert_header(http::header::CONTENT_LENGTH, body.len())?;
        }
    }
    if let Some(id) = &ctx.record.request_id {
        upstream_request.insert_header(headers::REQUEST_ID, id.clone())?;
    }
    if let Some(path) = ctx.route.as_ref().and_then(|r| r.request().upstream_path()) {
        // A stored response, asked for by the engine's own id.
        let uri = http::Uri::try_from(path).map_err(|e| {
            pingora_core::Error::because(
                pingora_core::ErrorType::InvalidHTTPHeader,
                "upstream path",
                e,
            )
        })?;
        upstream_request.set_uri(uri);
    }
    if ctx.backend().is_some_and(|b| b.kv_events.is_some()) {
        // The engine's KV events name the session that stored each block:
        // always the gateway's keyed name, never what a client wrote (a
        // keyless request's own `X-Session-ID` would label its blocks).
        match ctx.route.as_ref().and_then(|r| r.upstream_session_id()) {
            Some(id) => upstream_request.insert_header(crate::kv::session::SESSION_HEADER, id)?,
            None => {
                upstream_request.remove_header(&crate::kv::session::SESSION_HEADER);
            }
        }
    }
    if let Some(span) = &ctx.record.span {
        // The engine's spans nest under the gateway's.
        upstream_request.insert_header("traceparent", span.traceparent())?;
    }
    if ctx
        .backend()
        .is_some_and(|b| upstream_conn::avoid_reuse(&b.stats))
        && !session.is_upgrade_req()
    {
        upstream_request.insert_header("connection", "close")?;
    }
    if let Some(tier) = ctx.tier() {
        use crate::config::UpstreamAuthorization as Up;
        match &tier.upstream_authorization {
            Up::Pass => {}
            // By their constant names: a name given as text is parsed
            // each time (a tenth of what keys cost a request).
            Up::Strip => {
                upstream_request.remove_header(&http::header::AUTHORIZATION);
                upstream_request.remove_header(&X_API_KEY);
            }
            Up::Set(v) => {
                upstream_request.remove_header(&X_API_KEY);
                upstream_request.insert_header(http::header::AUTHORIZATION, v.clone())?;
            }
        }
    }
    Ok(())
}

/// `response_filter`: the answer's metadata headers; what its body will
/// be read for.
pub(super) fn response(
    gw: &Gateway,
    session: &mut Session,
    resp: &mut ResponseHeader,
    ctx: &mut RequestCtx,
) -> Result<()> {
    let Some((route, decision)) = ctx.route.as_ref().and_then(|r| Some((r, r.decision()?))) else {
        return Ok(());
    };
    let backend = &decision.backend;
    let limit = route
        .request()
        .routing()
        .config
        .server
        .client
        .max_header_bytes;
    if fields_bytes(&resp.headers, 0) > limit {
        let e = GatewayError::upstream_failed(format!(
            "backend {} sent response headers over the gateway's limit of {limit} bytes",
            backend.id
        ));
        return Err(super::peer::fail(ctx, e));
    }
    resp.insert_header(headers::BACKEND, backend.id_header.clone())?;
    if let Some(id) = &ctx.record.request_id {
        resp.insert_header(headers::REQUEST_ID, id.clone())?;
    }
    // Static values: a `&str` is checked and copied into a new value.
    static TRUE: http::HeaderValue = http::HeaderValue::from_static("true");
    static FALSE: http::HeaderValue = http::HeaderValue::from_static("false");
    let hit = if decision.affinity_hit { &TRUE } else { &FALSE };
    resp.insert_header(headers::HIT, hit.clone())?;
    resp.insert_header(headers::TIER, route.tier().name_header.clone())?;
    if session.is_upgrade(resp) == Some(true) {
        upgraded(gw, session, ctx);
        return Ok(());
    }
    read_for(session, resp, ctx)
}

/// What the answer's body is read for: its usage (JSON or an event
/// stream), a stored response's id, and the metadata merged into a JSON
/// body (its `Content-Length` made to fit).
fn read_for(session: &Session, resp: &mut ResponseHeader, ctx: &mut RequestCtx) -> Result<()> {
    let content_type = resp
        .headers
        .get(http::header::CONTENT_TYPE)
        .map_or(&b""[..], |v| v.as_bytes());
    let is_type = |t: &[u8]| {
        content_type
            .get(..t.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(t))
    };
    let is_json = is_type(b"application/json");
    let is_sse = is_type(b"text/event-stream");
    let encoded = resp.headers.get(http::header::CONTENT_ENCODING).is_some();
    let answer = &mut ctx.answer;
    if (is_json || is_sse) && !encoded {
        answer.usage = Some(UsageScanner::default());
    }
    answer.streamed = is_sse;
    let Some(route) = ctx.route.as_ref() else {
        return Ok(());
    };
    let stores = route.request().keeps_responses() && resp.status.as_u16() == 200 && !encoded;
    if stores {
        answer.response_id = Some(ResponseIdScanner::default());
    }
    // Stored responses' ids are rewritten to the gateway's (held until the
    // new one is read): lengths change, so the answer goes chunked.
    let rewrites = stores && (is_json || is_sse) && route.issues_response_ids();
    if rewrites {
        let mut ids = IdRewriter::new(true);
        if let Some((engine, client)) = route.followed_ids() {
            ids.add(engine, client);
        }
        answer.ids = Some(ids);
        answer.upstream_body_len = resp
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok()?.parse().ok());
        resp.remove_header(&http::header::CONTENT_LENGTH);
        resp.insert_header(http::header::TRANSFER_ENCODING, "chunked")?;
    }
    let bodyless = session.req_header().method == http::Method::HEAD
        || resp.status.as_u16() == 204
        || resp.status.as_u16() == 304;
    if is_json && !encoded && !bodyless {
        let appender = JsonAppender::new(metadata_member(route));
        let declared = resp
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<usize>().ok());
        match declared.map(|len| (len, len.checked_add(appender.extra_len()))) {
            // A length no body can have: pass the response on untouched.
            // (An answer whose ids are rewritten declares none any more.)
            Some((_, None)) => return Ok(()),
            Some((len, Some(total))) => {
                resp.insert_header(http::header::CONTENT_LENGTH, http::HeaderValue::from(total))?;
                answer.upstream_body_len = Some(len);
            }
            None => {}
        }
        answer.appender = Some(appender);
    }
    Ok(())
}

/// `response_body_filter`: the first byte, usage, the tenant's tokens, a
/// stored response's id and a socket's frames read on the way; ids
/// rewritten; the metadata merged into the end of a JSON body.
pub(super) fn response_body(
    gw: &Gateway,
    body: &mut Option<Bytes>,
    end_of_stream: bool,
    written: usize,
    ctx: &mut RequestCtx,
) -> pingora_core::Result<()> {
    if let Cut::Sent(through) = ctx.answer.cut {
        *body = None;
        if written >= through && !end_of_stream {
            // Its error event is written: the response ends here, and the
            // backend's request with its connection.
            return Err(pingora_core::Error::explain(
                pingora_core::ErrorType::Custom("stream_over_limit"),
                "a stream past its tenant's tokens_per_minute, cut",
            ));
        }
        return Ok(());
    }
    if let Some(chunk) = body.as_ref() {
        read_chunk(gw, chunk, ctx);
        ctx.answer.upstream_body_seen += chunk.len();
    }
    let answer = &mut ctx.answer;
    if let (Some(ws), Some(route), Some(chunk)) =
        (answer.websocket.as_mut(), ctx.route.as_ref(), body.as_ref())
    {
        if let Some(out) = ws.forward_to_client(chunk, |engine| route.issue_response_id(engine)) {
            *body = (!out.is_empty()).then(|| Bytes::from(out));
        }
    }
    let complete = answer
        .upstream_body_len
        .is_some_and(|len| answer.upstream_body_seen >= len);
    if let Some(ids) = answer.ids.as_mut() {
        let chunk = body.take().unwrap_or_default();
        let out = ids.push(&chunk, end_of_stream || complete);
        *body = (!out.is_empty()).then_some(out);
    }
    if let Some(appender) = answer.appender.as_mut() {
        let mut out = match body.take() {
            Some(chunk) => appender.push(chunk),
            None => Bytes::new(),
        };
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
    if answer.cut == Cut::Due {
        cut_after(body, answer, ctx.record.error.as_ref());
    }
    answer.emitted += body.as_ref().map_or(0, Bytes::len);
    Ok(())
}

/// A stream to be cut: once what goes out ends at an event boundary, the
/// error that cuts it (`error`, the 429 recorded) follows as an SSE `error`
/// event (the OpenAI and Anthropic SDKs raise it), and the next chunk ends
/// the response.
fn cut_after(body: &mut Option<Bytes>, answer: &mut Answer, error: Option<&GatewayError>) {
    let (Some(out), Some(error)) = (body.as_ref(), error) else {
        return;
    };
    if !(out.ends_with(b"\n\n") || out.ends_with(b"\r\n\r\n")) {
        return;
    }
    const HEAD: &[u8] = b"event: error\ndata: ";
    let event = error.body();
    let mut joined = Vec::with_capacity(out.len() + HEAD.len() + event.len() + 2);
    joined.extend_from_slice(out);
    joined.extend_from_slice(HEAD);
    joined.extend_from_slice(&event);
    joined.extend_from_slice(b"\n\n");
    answer.cut = Cut::Sent(answer.emitted + joined.len());
    *body = Some(Bytes::from(joined));
}

/// What one chunk of the answer tells, before it goes on.
fn read_chunk(gw: &Gateway, chunk: &Bytes, ctx: &mut RequestCtx) {
    let answer = &mut ctx.answer;
    if answer.first_byte.is_none() && !chunk.is_empty() {
        answer.first_byte = Some(Instant::now());
        if let Some(f) = answer.in_flight.as_mut() {
            f.prefilled();
        }
        if let Some(p) = ctx.who.permit.as_mut() {
            p.prefilled();
        }
    }
    let route = ctx.route.as_ref();
    if let Some(ws) = answer.websocket.as_mut() {
        // Where the gateway issues ids (see `response_body`), there is
        // nothing to learn.
        let learn = !route.is_some_and(|r| r.issues_response_ids());
        ws.backend_bytes(chunk, &mut |id| match route {
            Some(route) if learn => route.learn_response(gw.tables(), id),
            _ => {}
        });
    }
    if let Some(scanner) = answer.usage.as_mut() {
        scanner.push(chunk);
    }
    if let Some(r) = ctx.who.reservation.as_mut() {
        match answer.websocket.as_ref() {
            // A socket's turns are charged as their usage comes back.
            Some(ws) => r.charge_up_to(ws.used_tokens(), 1),
            None => r.saw(chunk, answer.streamed),
        }
        if answer.streamed && answer.websocket.is_none() && answer.cut == Cut::No {
            if let Some(over) = r.spent() {
                ctx.record.error = Some(over.answer(r.client(), &gw.metrics));
                answer.cut = Cut::Due;
            }
        }
    }
    let Some(scanner) = answer.response_id.as_mut() else {
        return;
    };
    match (scanner.push(chunk), route, answer.ids.as_mut()) {
        // The client is given the gateway's id, which carries its route:
        // there is nothing to learn.
        (Some(engine), Some(route), Some(ids)) => {
            if let Some(issued) = route.issue_response_id(&engine) {
                ids.add(&engine, &issued);
            }
            ids.ready();
        }
        (Some(id), Some(route), None) => route.learn_response(gw.tables(), &id),
        (None, _, Some(ids)) if scanner.done() => ids.ready(),
        _ => {}
    }
}

/// The backend switched protocols (a WebSocket): from here on the
/// connection is a socket that lives across turns. It holds no admission
/// slot and counts as no request in flight (an idle socket is no load), no
/// body clock runs on what the client sends, and it may idle as long as
/// the backend's `read_timeout` allows.
fn upgraded(gw: &Gateway, session: &mut Session, ctx: &mut RequestCtx) {
    let ws = match ctx.route.as_ref().is_some_and(|r| r.issues_response_ids()) {
        true => WebSocket::rewriting(),
        false => WebSocket::default(),
    };
    ctx.answer.websocket = Some(Box::new(ws));
    ctx.who.permit = None;
    ctx.answer.in_flight = None;
    if let Some(conn) = &ctx.body.conn {
        conn.body_done();
    }
    session.set_read_timeout(None);
    gw.metrics.websockets.inc();
}

/// The `x_agent_serve` member merged into JSON responses, written directly
/// (this runs once per response; a `serde_json::Value` would allocate a map).
fn metadata_member(route: &Route) -> Vec<u8> {
    fn string(out: &mut Vec<u8>, s: &str) {
        // serde_json escapes exactly as JSON requires; writing to a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    }
    let req = route.request();
    let mut out = Vec::with_capacity(160);
    out.extend_from_slice(b"\"x_agent_serve\":{\"backend\":");
    let decision = route.decision();
    string(&mut out, decision.map_or("", |d| &*d.backend.id));
    out.extend_from_slice(b",\"affinity_hit\":");
    let hit = decision.is_some_and(|d| d.affinity_hit);
    out.extend_from_slice(if hit { b"true" } else { b"false" });
    out.extend_from_slice(b",\"tier\":");
    string(&mut out, &req.tier().name);
    out.extend_from_slice(b",\"session\":");
    match req.session() {
        Some(s) => string(&mut out, &s.id),
        None => out.extend_from_slice(b"null"),
    }
    out.extend_from_slice(b",\"reason\":");
    match decision {
        Some(d) => string(&mut out, d.reason.as_str()),
        None => out.extend_from_slice(b"null"),
    }
    if let Some(tokens) = req.prefix_tokens() {
        out.extend_from_slice(b",\"prefix_tokens\":");
        out.extend_from_slice(tokens.to_string().as_bytes());
    }
    out.push(b'}');
    out
}
