//! Request and response modifiers: headers to the backend, response
//! metadata (headers and the `x_agent_serve` member), usage read on the way.

use super::request::fields_bytes;
use super::response::ResponseIdScanner;
use super::*;
use crate::affinity::responses::{response_key, stored_value, ResponseRoute};

/// Anthropic's client key header, stripped upstream with `Authorization`.
const X_API_KEY: http::HeaderName = http::HeaderName::from_static("x-api-key");

impl GatewayProxy {
    pub(super) async fn modify_upstream_request(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        if ctx.body.is_some() {
            // The gateway already answered the client's 100-continue.
            upstream_request.remove_header("expect");
        }
        if let Some(id) = &ctx.request_id {
            upstream_request.insert_header(REQUEST_ID_HEADER, id.clone())?;
        }
        if let Some(span) = &ctx.span {
            // The engine's spans nest under the gateway's.
            upstream_request.insert_header("traceparent", span.traceparent())?;
        }
        if ctx
            .backend
            .as_ref()
            .is_some_and(|b| upstream_conn::avoid_reuse(&b.stats))
            && !session.is_upgrade_req()
        {
            upstream_request.insert_header("connection", "close")?;
        }
        if let Some(tier) = &ctx.tier {
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

    pub(super) async fn modify_response(
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
        resp.insert_header(BACKEND_HEADER, backend.id_header.clone())?;
        if let Some(id) = &ctx.request_id {
            resp.insert_header(REQUEST_ID_HEADER, id.clone())?;
        }
        // Static values: a `&str` is checked and copied into a new value.
        static TRUE: http::HeaderValue = http::HeaderValue::from_static("true");
        static FALSE: http::HeaderValue = http::HeaderValue::from_static("false");
        let hit = if ctx.affinity_hit { &TRUE } else { &FALSE };
        resp.insert_header(HIT_HEADER, hit.clone())?;
        resp.insert_header(TIER_HEADER, tier.name_header.clone())?;
        if session.is_upgrade(resp) == Some(true) {
            self.upgraded(session, ctx);
            return Ok(());
        }

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
        if (is_json || is_sse) && !encoded {
            ctx.usage = Some(UsageScanner::default());
        }
        ctx.streamed = is_sse;
        if ctx.responses_scope.is_some() && resp.status.as_u16() == 200 && !encoded {
            ctx.response_id = Some(ResponseIdScanner::default());
        }
        let bodyless = session.req_header().method == http::Method::HEAD
            || resp.status.as_u16() == 204
            || resp.status.as_u16() == 304;
        if is_json && !encoded && !bodyless {
            let appender = JsonAppender::new(ctx.metadata_member(&backend, &tier));
            let declared = resp
                .headers
                .get(http::header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<usize>().ok());
            match declared.map(|len| (len, len.checked_add(appender.extra_len()))) {
                // A length no body can have: pass the response on untouched.
                Some((_, None)) => return Ok(()),
                Some((len, Some(total))) => {
                    resp.insert_header(
                        http::header::CONTENT_LENGTH,
                        http::HeaderValue::from(total),
                    )?;
                    ctx.upstream_body_len = Some(len);
                }
                None => {}
            }
            ctx.appender = Some(appender);
        }
        Ok(())
    }

    pub(super) fn modify_response_body(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<std::time::Duration>> {
        if let Some(chunk) = body.as_ref() {
            if ctx.first_byte.is_none() && !chunk.is_empty() {
                ctx.first_byte = Some(Instant::now());
                if let Some(f) = ctx.in_flight.as_mut() {
                    f.prefilled();
                }
                if let Some(p) = ctx.who.permit.as_mut() {
                    p.prefilled();
                }
            }
            if let Some(mut ws) = ctx.websocket.take() {
                let mut created = Vec::new();
                ws.backend_bytes(chunk, &mut |id| created.push(id.to_string()));
                ctx.websocket = Some(ws);
                for id in created {
                    self.learn_response(ctx, &id);
                }
            }
            if let Some(scanner) = ctx.usage.as_mut() {
                scanner.push(chunk);
            }
            if let Some(tally) = ctx.who.tokens.as_mut() {
                tally.saw(chunk, ctx.streamed);
            }
            if let Some(id) = ctx.response_id.as_mut().and_then(|s| s.push(chunk)) {
                self.learn_response(ctx, &id);
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

    /// The backend switched protocols (a WebSocket): from here on the
    /// connection is a socket that lives across turns. It holds no
    /// admission slot and counts as no request in flight (an idle socket
    /// is no load), no body clock runs on what the client sends, and it may
    /// idle as long as the backend's `read_timeout` allows.
    fn upgraded(&self, session: &mut Session, ctx: &mut RequestCtx) {
        ctx.websocket = Some(Box::default());
        ctx.who.permit = None;
        ctx.in_flight = None;
        if let Some(conn) = &ctx.conn {
            conn.body_done();
        }
        session.set_read_timeout(None);
        self.gw.metrics.websockets.inc();
    }

    /// The backend that answered stored the response `id`: its follow-ups
    /// go there, as turns of this request's session (a request without one
    /// starts a session named by its response).
    fn learn_response(&self, ctx: &RequestCtx, id: &str) {
        let (Some(scope), Some(backend), Some(routing)) =
            (&ctx.responses_scope, &ctx.backend, &ctx.routing)
        else {
            return;
        };
        let session = ctx.session_ref.clone().unwrap_or_else(|| {
            SessionRef::new(
                &routing.hasher,
                KeyKind::Session,
                scope,
                &format!("response\u{1f}{id}"),
            )
        });
        let key = response_key(&routing.hasher, scope, id);
        let route = ResponseRoute {
            slot: backend.slot,
            key: session.key,
            hash: session.hash,
        };
        self.gw.responses.learn(key, route, crate::clock::now_ms());
        if let Some(store) = self.gw.store.clone().filter(|s| s.healthy()) {
            // The fleet's other gateways route its follow-ups too. Not
            // awaited: the answer streams on meanwhile.
            let value = stored_value(&backend.id, &route);
            let ttl_ms = self.gw.responses.ttl_ms();
            tokio::spawn(async move {
                let _ = store.put_response(key, value, ttl_ms).await;
            });
        }
    }
}
