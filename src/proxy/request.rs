//! Request filters: what the request is (tier, session, parent, body when
//! routing needs it) and whether it is acceptable at all.

use super::*;
use crate::affinity::prefix::conversation::Conversation;
use crate::affinity::responses::{parse_stored, response_key, ResponseRoute};

// Parsed once: a lookup by `&str` parses the header name on every request.
static TARGET_NAME: http::HeaderName = http::HeaderName::from_static(TARGET_HEADER);
static TIER_NAME: http::HeaderName = http::HeaderName::from_static(TIER_HEADER);

/// The tenant part of a binding's scope: empty when tenants are not configured.
fn tenant_scope(
    cfg: &crate::config::Config,
    headers: &session::RequestHeaders<'_>,
    hasher: &crate::affinity::hrw::HrwHasher,
) -> std::result::Result<String, GatewayError> {
    use crate::config::TenantSource;
    let value = match &cfg.affinity.tenant {
        TenantSource::None => return Ok(String::new()),
        TenantSource::Header(h) => headers.get(h),
        TenantSource::Authorization => headers.get(&http::header::AUTHORIZATION),
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

/// Bindings are scoped by tier (and tenant, when configured).
fn scope_of<'a>(tier: &'a str, tenant_suffix: &str) -> std::borrow::Cow<'a, str> {
    if tenant_suffix.is_empty() {
        std::borrow::Cow::Borrowed(tier)
    } else {
        // Not `format!`: this runs for every keyed request.
        let mut scope = String::with_capacity(tier.len() + tenant_suffix.len());
        scope.push_str(tier);
        scope.push_str(tenant_suffix);
        std::borrow::Cow::Owned(scope)
    }
}

/// What the binding table is keyed with: a subagent's group, the session's
/// own key, or the conversation `implicit` names (no key from the client).
fn session_ref(
    h: &crate::affinity::hrw::HrwHasher,
    scope: &str,
    parent: &Option<SessionId>,
    parent_agent: &Option<SessionId>,
    session_id: &Option<SessionId>,
    implicit: Option<&Conversation>,
) -> Option<SessionRef> {
    match (parent, parent_agent, session_id) {
        // A subagent (Dynamo style): the group of the parent session.
        (Some(p), _, _) => {
            let mut group = SessionRef::new(h, KeyKind::Group, scope, &p.id);
            group.parent = Some(h.fingerprint(KeyKind::Session, scope, &p.id));
            Some(group)
        }
        // A subagent (Claude Code style): the group of a parent agent within
        // this session; the session's own binding is the parent to follow.
        (None, Some(agent), Some(s)) => {
            let id = format!("{}\u{1f}{}", s.id, agent.id);
            let mut group = SessionRef::new(h, KeyKind::Group, scope, &id);
            group.parent = Some(h.fingerprint(KeyKind::Session, scope, &s.id));
            Some(group)
        }
        (None, _, Some(_)) if implicit.is_some() => implicit.map(|c| {
            let mut s = SessionRef::conversation(c.id);
            s.continued_at = c.continues.map(|at| at.slot);
            s.probation = c.continues.is_none();
            s.forked_at = c.forked_at;
            s
        }),
        (None, _, Some(s)) => Some(SessionRef::new(h, KeyKind::Session, scope, &s.id)),
        (None, _, None) => None,
    }
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

/// Whether a request's path is one whose prompt an engine's prefix cache
/// serves: chat and text completions, Responses, Anthropic Messages (under
/// any prefix: `/v1/...`, or a proxy's `/openai/v1/...`). Embeddings,
/// rerank, scoring and tokenizing calls hold no KV cache to return to: they
/// are routed to the least busy backend and nothing of them is kept.
fn prompt_path(path: &str) -> bool {
    [
        "/chat/completions",
        "/completions",
        "/responses",
        "/messages",
    ]
    .iter()
    .any(|p| path.ends_with(p))
}

fn method_has_body(req: &RequestHeader) -> bool {
    !matches!(
        req.method,
        http::Method::GET | http::Method::HEAD | http::Method::OPTIONS | http::Method::DELETE
    )
}

impl GatewayProxy {
    pub(super) async fn on_request(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<bool> {
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
        ctx.request_id = Some(self.request_id(&session.req_header().headers));
        if let Some(t) = &self.gw.telemetry {
            ctx.span = Some(t.start(&session.req_header().headers));
        }
        match self.route_request(session, ctx).await {
            Ok(()) => Ok(false),
            Err(e) => {
                let tier = ctx.tier_name().map(str::to_string);
                e.write(session, tier.as_deref(), None, ctx.request_id.as_ref())
                    .await?;
                ctx.error = Some(e);
                Ok(true)
            }
        }
    }

    /// Everything `request_filter` decides; `Err` is answered to the client.
    /// Who sent the request: its key's tenant (401 without a known key
    /// where keys are required; 429 over the tenant's limits), its fair-share
    /// tenant, priority class and deadline.
    fn identify(
        &self,
        cfg: &crate::config::Config,
        headers: &http::HeaderMap,
        ctx: &mut RequestCtx,
    ) -> std::result::Result<(), GatewayError> {
        let key = crate::auth::presented_key(headers);
        let client = match (&cfg.auth.keys_file, key) {
            (Some(_), Some(k)) => self.gw.auth.keys().look_up(k),
            _ => None,
        };
        let m = &self.gw.metrics;
        if client.is_none() && cfg.auth.required {
            m.client_rejected
                .with_label_values(&["other", "unauthorized"])
                .inc();
            return Err(GatewayError::unauthorized());
        }
        let adm = &cfg.admission;
        if let Some(c) = &client {
            let slot = c.take_slot().map_err(|e| self.over_limit(c, e))?;
            ctx.who.tenant_slot = Some(slot);
            if c.has_rates() {
                // A fleet's gateways draw from one bucket in the store
                // (once the body is read: see `charge`); without the store,
                // each from its own.
                match &self.gw.store {
                    Some(store) if store.healthy() => ctx.who.fleet_rates = true,
                    store => {
                        if store.is_some() {
                            m.tenant_limits_local.inc();
                        }
                        c.take_rates().map_err(|e| self.over_limit(c, e))?;
                    }
                }
            }
        }
        ctx.who.client = client;
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

    /// A tenant over one of its limits: counted, and the 429 that says so.
    fn over_limit(
        &self,
        c: &crate::admission::Client,
        e: crate::admission::OverLimit,
    ) -> GatewayError {
        self.gw
            .metrics
            .client_rejected
            .with_label_values(&[&c.tenant.name, e.limit])
            .inc();
        GatewayError::over_limit(e.limit, &c.tenant.name, e.retry_after_s)
    }

    /// Charge the request to its tenant's per-minute limits, its tokens as
    /// estimated now (its prompt, and the output it may ask for): in the
    /// fleet's store, or, when that cannot answer, in this gateway's own
    /// buckets. What it used settles the estimate when it ends.
    async fn charge(
        &self,
        ctx: &mut RequestCtx,
        max_output: Option<u64>,
    ) -> std::result::Result<(), GatewayError> {
        let Some(c) = ctx.who.client.clone().filter(|c| c.has_rates()) else {
            return Ok(());
        };
        let prompt = super::peer::body_tokens(ctx);
        let charged = match c.counts_tokens() {
            true => prompt.saturating_add(max_output.unwrap_or(0)),
            false => 0,
        };
        let mut local = true;
        if let Some(store) = self.gw.store.as_ref().filter(|_| ctx.who.fleet_rates) {
            match c.take_fleet_rates(store, charged).await {
                Ok(taken) => {
                    taken.map_err(|e| self.over_limit(&c, e))?;
                    local = false;
                }
                Err(_) => {
                    // The store went away meanwhile.
                    self.gw.metrics.tenant_limits_local.inc();
                    ctx.who.fleet_rates = false;
                    c.take_rates().map_err(|e| self.over_limit(&c, e))?;
                }
            }
        }
        if local {
            c.charge_tokens(charged.min(i64::MAX as u64) as i64);
        }
        if c.counts_tokens() {
            ctx.who.tokens = Some(crate::admission::TokenTally::new(charged, prompt));
        }
        Ok(())
    }

    pub(super) async fn route_request(
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
        let headers = &session::RequestHeaders::new(&req.headers);
        let session_id = session::from_headers(headers, &cfg.affinity.session_headers)
            .map_err(|e| GatewayError::bad_session_header(e.to_string()))?;
        let parent = session::from_headers(headers, &cfg.affinity.parent_session_headers)
            .map_err(|e| GatewayError::bad_session_header(e.to_string()))?;
        let parent_agent = session::from_headers(headers, &cfg.affinity.parent_agent_headers)
            .map_err(|e| GatewayError::bad_session_header(e.to_string()))?;
        ctx.session_final = cfg.affinity.session_final_headers.iter().any(|h| {
            headers
                .get(h)
                .is_some_and(|v| matches!(v.as_bytes(), b"true" | b"1" | b"TRUE" | b"True"))
        });
        if let Some(target) = headers.get(&TARGET_NAME) {
            if !cfg.affinity.allow_explicit_target {
                return Err(GatewayError::explicit_target_forbidden());
            }
            ctx.explicit_target = Some(String::from_utf8_lossy(target.as_bytes()).into_owned());
        }
        self.identify(cfg, &req.headers, ctx)?;
        let client = ctx.who.client.clone();
        let scope_suffix = match &client {
            // A key's tenant scopes bindings: a header cannot claim another's.
            Some(c) => std::borrow::Cow::Borrowed(c.tenant.scope.as_str()),
            None => std::borrow::Cow::Owned(tenant_scope(cfg, headers, &routing.hasher)?),
        };
        let declared = request_body::content_length(session)?;
        let limit = cfg.server.max_body_bytes;
        if declared.is_some_and(|len| len > limit) {
            return Err(GatewayError::body_too_large(limit));
        }
        ctx.declared_len = declared;

        let mut tier = match headers.get(&TIER_NAME) {
            Some(v) => {
                let name = v
                    .to_str()
                    .map_err(|_| GatewayError::unknown_tier("invalid tier header".into()))?;
                Some(Arc::clone(routing.tier_by_name(name).ok_or_else(|| {
                    GatewayError::unknown_tier(format!("unknown tier `{name}`"))
                })?))
            }
            None => None,
        };
        let mut session_id = session_id;
        let has_body = method_has_body(session.req_header()) && declared != Some(0);
        let prefix = &self.gw.prefix;
        // A keyed request's binding key, when its tier is known before its
        // body (it is reused below unless the body changes either).
        let tier_now = match &tier {
            Some(t) => Some(t),
            None if !routing.routes_by_model() => Some(routing.default_tier()),
            None => None,
        };
        let early = tier_now.and_then(|t| {
            let scope = scope_of(&t.name, &scope_suffix);
            session_ref(
                &routing.hasher,
                &scope,
                &parent,
                &parent_agent,
                &session_id,
                None,
            )
            .map(|s| (Arc::clone(t), s))
        });
        // The prompt is read to name a keyless conversation, to place a new
        // binding where its prefix lives, and in soft mode to weigh a move
        // by what each backend holds of it. A keyed turn of a live binding
        // (hard mode) needs none of that and streams through unread.
        let read_prompt = prefix.enabled()
            && prompt_path(session.req_header().uri.path())
            && (session_id.is_none()
                || cfg.affinity.mode == crate::affinity::policy::Mode::Soft
                || !early
                    .as_ref()
                    .is_some_and(|(_, s)| self.gw.affinity.is_live(s.key)));
        // Routing cannot do without the body when the tier or the session
        // key is in it; the prompt alone is worth reading only when the body
        // can still be forwarded whole (a declared length: see
        // request_body.rs) and the budget allows — else it routes unread. A
        // Responses request is read: it may follow a stored response, which
        // one backend alone holds (`previous_response_id`), or name its
        // conversation.
        let responses_api = has_body && session.req_header().uri.path().ends_with("/responses");
        let must_read = has_body
            && ((tier.is_none() && routing.routes_by_model())
                || (session_id.is_none() && !cfg.affinity.body_session_fields.is_empty())
                || responses_api);
        let mut needs_body = must_read || (has_body && read_prompt && declared.is_some());
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
                None if must_read => return Err(GatewayError::busy_reading_bodies()),
                None => {
                    needs_body = false;
                    None
                }
            }
        } else {
            None
        };
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
        let mut chain = None;
        let mut max_output = None;
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
                max_output = probe.max_output_tokens();
                ctx.asks_stream = Some(probe.is_stream());
                let model = probe.model();
                if ctx.span.as_ref().is_some_and(|s| s.sampled()) {
                    ctx.model = model.as_deref().map(Box::from);
                }
                if tier.is_none() {
                    if let Some(model) = &model {
                        tier = routing.tier_by_model(model).cloned();
                    }
                }
                if session_id.is_none() {
                    // The Conversations API's id (a Responses field) first.
                    session_id = responses_api
                        .then(|| probe.conversation())
                        .flatten()
                        .or_else(|| probe.session(&cfg.affinity.body_session_fields));
                }
                let routed_in = tier.as_ref().unwrap_or_else(|| routing.default_tier());
                if responses_api {
                    // Response ids are kept under the tier and tenant too.
                    let scope = scope_of(&routed_in.name, &scope_suffix);
                    if let Some(id) = probe.previous_response_id() {
                        let key = response_key(&routing.hasher, &scope, &id);
                        if let Some(route) = self.stored_response(key, routed_in).await {
                            chain = Some(route);
                            ctx.stored_at = Some((route.slot, id));
                        }
                    }
                    ctx.responses_scope = Some(scope.into_owned());
                }
                // A follow-up of a stored response sends only its new input:
                // it is a turn of the session that made the response, at the
                // backend that holds it, and its prompt is not the engine's.
                if read_prompt && chain.is_none() {
                    // Cached under its tier and tenant: one tenant's prompts
                    // never find another's holdings.
                    let cached_in = routed_in;
                    let keyless = session_id.is_none() && parent.is_none();
                    ctx.prefix = prefix
                        .read(
                            &scope_of(&cached_in.name, &scope_suffix),
                            model.as_deref(),
                            keyless,
                            &probe,
                        )
                        .map(Box::new);
                }
            }
            ctx.body = Some(body);
        }
        let tier = tier.unwrap_or_else(|| Arc::clone(routing.default_tier()));
        self.charge(ctx, max_output).await?;
        // No key from the client: the conversation its prompt belongs to.
        let implicit = match (&session_id, ctx.prefix.as_deref()) {
            (None, Some(route)) => route.conversation().copied(),
            _ => None,
        };
        if let Some(c) = &implicit {
            session_id = Some(SessionId {
                id: format!("prompt-{:016x}", (c.id >> 64) as u64),
                source: session::Source::Prompt,
            });
        }

        // A follow-up of a stored response without a key of its own: the
        // session of the response it follows.
        if let (Some(route), None, None, None) = (chain, &session_id, &parent, &parent_agent) {
            ctx.session_ref = Some(SessionRef::resumed(route.key, route.hash, route.slot));
            ctx.session = Some(SessionId {
                id: format!("response-chain-{:016x}", route.hash),
                source: session::Source::StoredResponse,
            });
            ctx.tier = Some(tier);
            ctx.routing = Some(routing);
            return Ok(());
        }
        if session.is_upgrade_req() && session.req_header().uri.path().ends_with("/responses") {
            // Responses over WebSocket: the ids its events announce are kept too.
            ctx.responses_scope = Some(scope_of(&tier.name, &scope_suffix).into_owned());
        }
        ctx.session_ref = match early {
            // Nothing the body said changed the tier or the key.
            Some((t, sref)) if Arc::ptr_eq(&t, &tier) && implicit.is_none() => Some(sref),
            _ => session_ref(
                &routing.hasher,
                &scope_of(&tier.name, &scope_suffix),
                &parent,
                &parent_agent,
                &session_id,
                implicit.as_ref(),
            ),
        };
        ctx.parent = parent.or(parent_agent).map(|p| p.id);
        ctx.session = session_id;
        ctx.tier = Some(tier);
        ctx.routing = Some(routing);
        Ok(())
    }

    /// Where the response kept under `key` lives: this gateway's own
    /// routes, else the fleet's store (another gateway saw it answered).
    /// A backend the store names that is not in `tier` here gets a slot no
    /// candidate has: the follow-up is told its backend is gone.
    async fn stored_response(&self, key: u64, tier: &Tier) -> Option<ResponseRoute> {
        let now = crate::clock::now_ms();
        if let Some(route) = self.gw.responses.find(key, now) {
            return Some(route);
        }
        let store = self.gw.store.as_ref().filter(|s| s.healthy())?;
        let value = store.get_response(key).await.ok()??;
        let (backend, session, hash) = parse_stored(&value)?;
        let route = ResponseRoute {
            slot: tier.backend_by_id(backend).map_or(u32::MAX, |b| b.slot),
            key: session,
            hash,
        };
        if route.slot != u32::MAX {
            self.gw.responses.learn(key, route, now);
        }
        Some(route)
    }

    /// The 408 for a client that was too slow (its body stalled or crawled),
    /// counted by kind; `None` when `e` is not that.
    pub(super) fn client_timeout(&self, ctx: &RequestCtx, e: &Error) -> Option<GatewayError> {
        let kind = match ctx.conn.as_ref().and_then(|c| c.cut()) {
            // The wrapper counted its own cut.
            Some(cut) => return Some(GatewayError::request_timeout(cut.as_str())),
            None if e.etype() == &ErrorType::ReadTimedout => "body_idle",
            None => return None,
        };
        self.gw.metrics.timeouts.with_label_values(&[kind]).inc();
        Some(GatewayError::request_timeout(kind))
    }

    pub(super) async fn on_request_body(
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
        if let (Some((_, streams)), Some(chunk)) = (ctx.prefill_clock.as_mut(), body.as_ref()) {
            *streams |= asks_stream(chunk);
        }
        // A sampled span names the model of a body that streams through unread.
        if ctx.model.is_none() && ctx.span.as_ref().is_some_and(|s| s.sampled()) {
            ctx.model = body.as_deref().and_then(model_in).map(Box::from);
        }
        if end_of_stream {
            if let (Some((within, false)), Some(p)) =
                (ctx.prefill_clock.take(), ctx.who.permit.as_mut())
            {
                p.prefill_within(within);
            }
        }
        if let Some(chunk) = body {
            ctx.body_bytes += chunk.len() as u64;
            let limit = ctx
                .routing
                .as_ref()
                .map_or(u64::MAX, |r| r.config.server.max_body_bytes);
            // A socket's turns are held to the limit one message at a time.
            let over = match ctx.websocket.as_mut() {
                Some(ws) => ws.client_bytes(chunk, limit).is_err(),
                None => ctx.body_bytes > limit,
            };
            if over {
                return Err(self.fail(ctx, GatewayError::body_too_large(limit)));
            }
        }
        Ok(())
    }
}

/// Whether a piece of a request body holds `"stream": true` (a member split
/// between two pieces is missed: the request is then timed as one that does
/// not stream, which only ends its count as prefilling early).
fn asks_stream(chunk: &[u8]) -> bool {
    // Built once: a searcher built per call cost more than the search.
    static STREAM: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"stream\""));
    STREAM.find_iter(chunk).any(|at| {
        let rest = chunk[at + 8..].trim_ascii_start();
        rest.strip_prefix(b":")
            .is_some_and(|v| v.trim_ascii_start().starts_with(b"true"))
    })
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

    #[test]
    fn a_body_asks_for_a_stream_by_its_member_only() {
        use super::asks_stream;
        assert!(asks_stream(br#"{"messages":[],"stream" : true}"#));
        assert!(asks_stream(br#"{"stream":true,"messages":[]}"#));
        assert!(!asks_stream(br#"{"stream":false}"#));
        assert!(!asks_stream(
            br#"{"stream_options":{"include_usage":true}}"#
        ));
        assert!(!asks_stream(br#"{"content":"stream"}"#));
        assert!(!asks_stream(br#"{"stream""#));
    }
}
