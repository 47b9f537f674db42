//! What a request says about its route, read once: its headers first
//! ([`Intake::read`]), then its body when routing needs it
//! ([`Intake::body_need`], [`Intake::read_body`]), then the
//! [`RouteRequest`] it makes ([`Intake::finish`]).

use super::edits::Edits;
use super::path::Judged;
use super::request::{RouteRequest, StoredRef};
use super::salt;
use super::stored;
use super::tables::Tables;
use crate::affinity::hrw::{HrwHasher, KeyKind};
use crate::affinity::prefix::conversation::Conversation;
use crate::affinity::prefix::PromptRoute;
use crate::affinity::responses::ResponseRoute;
use crate::affinity::session::{self, BodyProbe, RequestHeaders, SessionId};
use crate::affinity::SessionRef;
use crate::config::Config;
use crate::errors::GatewayError;
use crate::upstream::{Routing, Tier};
use std::borrow::Cow;
use std::sync::Arc;

/// What the headers said, and then the body.
pub struct Intake {
    routing: Arc<Routing>,
    /// The tier the header named, or the body's model picked.
    tier: Option<Arc<Tier>>,
    session: Option<SessionId>,
    parent: Option<SessionId>,
    parent_agent: Option<SessionId>,
    /// The tenant part of a binding's scope (empty without tenants).
    tenant_scope: String,
    target: Option<String>,
    final_turn: bool,
    /// A keyed request's binding key, when its tier is known before its
    /// body (kept unless the body changes either).
    early: Option<(Arc<Tier>, SessionRef)>,
    /// A path whose prompt an engine's prefix cache serves.
    prompt_path: bool,
    /// A Responses request (`/responses`).
    responses_api: bool,
    /// An Anthropic Messages request (`/messages`): its clients move their
    /// `cache_control` markers turn by turn.
    messages_api: bool,
    /// A request for one stored response (`/responses/{id}`, and its
    /// `/input_items` or `/cancel`): its id, and its path and query with the
    /// id cut out (before, after).
    response_path: Option<(String, String, String)>,
    upgrade: bool,
    /// What its body said, once read for routing.
    prompt: Option<Box<PromptRoute>>,
    stored: Option<Box<StoredRef>>,
    responses_scope: Option<String>,
    /// The prompt is worth reading (`affinity.prefix`): set by `body_need`.
    read_prompt: bool,
    /// The path and query the backend is asked for, when not the client's.
    upstream_path: Option<String>,
    /// Its prompt carries its tenant's `cache_salt` (`auth.cache_salt`):
    /// set by `body_need`.
    salted: bool,
}

/// Whether routing reads the body before choosing a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyNeed {
    /// Streams through unread.
    None,
    /// Routing cannot do without it (the tier or the session key may be
    /// in it; a Responses request may follow a stored response).
    Must,
    /// Its prompt places the request better, when the body can be read
    /// whole within the budget; else it routes unread.
    Worth,
}

/// What the body said besides the route: what the proxy and admission
/// keep of it.
#[derive(Default)]
pub struct BodyFacts {
    pub max_output: Option<u64>,
    pub asks_stream: Option<bool>,
    pub model: Option<String>,
    /// The body as the backend is to get it: a stored response it follows
    /// named by the engine's own id.
    pub rewritten: Option<Vec<u8>>,
}

/// The stored response a path names (`…/responses/{id}`, `…/{id}/input_items`),
/// and its path and query before and after the id.
fn response_path(uri: &http::Uri, path: &Judged<'_>) -> Option<(String, String, String)> {
    use super::path::RESPONSE_SEGMENT;
    let pq = uri.path_and_query()?.as_str();
    let at = path.find(RESPONSE_SEGMENT)? + RESPONSE_SEGMENT.len();
    let path = path.as_str();
    let end = path[at..].find('/').map_or(path.len(), |e| at + e);
    let id = &path[at..end];
    (!id.is_empty() && session::check_value(id.as_bytes()).is_ok())
        .then(|| (id.to_string(), pq[..at].to_string(), pq[end..].to_string()))
}

/// The tenant part of a binding's scope, from `affinity.tenant`: empty when
/// tenants are not configured.
fn tenant_scope(
    cfg: &Config,
    headers: &RequestHeaders<'_>,
    hasher: &HrwHasher,
) -> Result<String, GatewayError> {
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
fn scope_of<'a>(tier: &'a str, tenant_suffix: &str) -> Cow<'a, str> {
    if tenant_suffix.is_empty() {
        Cow::Borrowed(tier)
    } else {
        // Not `format!`: this runs for every keyed request.
        let mut scope = String::with_capacity(tier.len() + tenant_suffix.len());
        scope.push_str(tier);
        scope.push_str(tenant_suffix);
        Cow::Owned(scope)
    }
}

/// What the binding table is keyed with: a subagent's group, the session's
/// own key, the conversation `implicit` names (no key from the client), or
/// the session of the stored response it `follows` (a follow-up without a
/// key of its own). The one place a request's key is made.
fn session_ref(
    h: &HrwHasher,
    scope: &str,
    parent: &Option<SessionId>,
    parent_agent: &Option<SessionId>,
    session_id: &Option<SessionId>,
    implicit: Option<&Conversation>,
    follows: Option<&ResponseRoute>,
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
        (None, None, None) => follows.map(|r| SessionRef::resumed(r.key, r.hash, r.slot)),
        (None, _, Some(_)) if implicit.is_some() => implicit.map(|c| {
            let mut s = SessionRef::conversation(c.id);
            s.continued_at = c.continues.map(|at| at.slot);
            s.probation = c.continues.is_none();
            s.forked_at = c.forked_at;
            s
        }),
        (None, _, Some(s)) => Some(SessionRef::new(h, KeyKind::Session, scope, &s.id)),
        (None, Some(_), None) => None,
    }
}

fn session_header(
    headers: &RequestHeaders<'_>,
    names: &[http::HeaderName],
) -> Result<Option<SessionId>, GatewayError> {
    session::from_headers(headers, names)
        .map_err(|e| GatewayError::bad_session_header(e.to_string()))
}

impl Intake {
    /// What the request's headers say of its session: its session and
    /// parent keys, an explicit backend, a last turn; `upgrade`: it asks
    /// to switch protocols (a WebSocket). Its tenant's scope and its tier
    /// follow ([`Intake::scope`], [`Intake::tier`]), in the order the
    /// gateway refuses what is wrong with a request.
    pub fn read(
        routing: Arc<Routing>,
        headers: &RequestHeaders<'_>,
        uri: &http::Uri,
        upgrade: bool,
    ) -> Result<Intake, GatewayError> {
        // Settled by `path::canonical` before the request got here.
        let path = Judged::new(uri.path());
        let cfg = &routing.config;
        let session = session_header(headers, &cfg.affinity.session_headers)?;
        let parent = session_header(headers, &cfg.affinity.parent_session_headers)?;
        let parent_agent = session_header(headers, &cfg.affinity.parent_agent_headers)?;
        let final_turn = cfg.affinity.session_final_headers.iter().any(|h| {
            headers
                .get(h)
                .is_some_and(|v| matches!(v.as_bytes(), b"true" | b"1" | b"TRUE" | b"True"))
        });
        let target = match headers.get(&crate::headers::TARGET) {
            Some(_) if !cfg.affinity.allow_explicit_target => {
                return Err(GatewayError::explicit_target_forbidden())
            }
            Some(t) => Some(String::from_utf8_lossy(t.as_bytes()).into_owned()),
            None => None,
        };
        if path.miscased() {
            // Engines route case-sensitively: judged as the endpoint, it
            // would be answered as none.
            return Err(GatewayError::bad_path(
                "the request path spells an API endpoint in other letter case".into(),
            ));
        }
        let salted = cfg.auth.cache_salt == crate::config::CacheSalt::Tenant;
        if upgrade && salted && path.ends_with("/responses") {
            // Its turns travel in frames the gateway does not rewrite.
            return Err(GatewayError::bad_path(
                "Responses over WebSocket cannot carry the tenant's cache salt \
                 (auth.cache_salt: tenant): send the turns over HTTP"
                    .into(),
            ));
        }
        Ok(Intake {
            // Routed to the least busy backend, nothing of it kept, unless
            // its prompt is one an engine's prefix cache serves.
            prompt_path: path.prompt_endpoint(),
            responses_api: path.ends_with("/responses"),
            messages_api: path.ends_with("/messages"),
            response_path: response_path(uri, &path),
            upgrade,
            routing,
            tier: None,
            session,
            parent,
            parent_agent,
            tenant_scope: String::new(),
            target,
            final_turn,
            early: None,
            prompt: None,
            stored: None,
            responses_scope: None,
            read_prompt: false,
            upstream_path: None,
            salted: false,
        })
    }

    /// The tenant's part of its bindings' scope: its client key's tenant
    /// (`of_key`: a header cannot claim another's), else what
    /// `affinity.tenant` reads from the headers.
    pub fn scope(
        &mut self,
        of_key: Option<&str>,
        headers: &RequestHeaders<'_>,
    ) -> Result<(), GatewayError> {
        self.tenant_scope = match of_key {
            Some(scope) => scope.to_string(),
            None => tenant_scope(&self.routing.config, headers, &self.routing.hasher)?,
        };
        Ok(())
    }

    /// The tier its header names (404 for one that is unknown); with it,
    /// or with only the default tier, a keyed request's binding key.
    pub fn tier(&mut self, headers: &RequestHeaders<'_>) -> Result<(), GatewayError> {
        let routing = &self.routing;
        if let Some(v) = headers.get(&crate::headers::TIER) {
            let name = v
                .to_str()
                .map_err(|_| GatewayError::unknown_tier("invalid tier header".into()))?;
            self.tier = Some(Arc::clone(routing.tier_by_name(name).ok_or_else(|| {
                GatewayError::unknown_tier(format!("unknown tier `{name}`"))
            })?));
        }
        let tier_now = match &self.tier {
            Some(t) => Some(t),
            None if !routing.routes_by_model() => Some(routing.default_tier()),
            None => None,
        };
        self.early = tier_now.and_then(|t| {
            let scope = scope_of(&t.name, &self.tenant_scope);
            session_ref(
                &routing.hasher,
                &scope,
                &self.parent,
                &self.parent_agent,
                &self.session,
                None,
                None,
            )
            .map(|s| (Arc::clone(t), s))
        });
        Ok(())
    }

    /// A request for one stored response (`GET /v1/responses/{id}`, its
    /// `input_items`, `DELETE`, `cancel`) goes where the response is kept,
    /// asking the engine by its own id, as a follow-up naming it does.
    pub async fn read_path(&mut self, t: Tables<'_>) {
        let Some((id, before, after)) = self.response_path.take() else {
            return;
        };
        let routing = Arc::clone(&self.routing);
        let tier = Arc::clone(self.tier.as_ref().unwrap_or_else(|| routing.default_tier()));
        let scope = scope_of(&tier.name, &self.tenant_scope).into_owned();
        let stored = stored::presented(t, &routing, &tier, &scope, id).await;
        if let Some(engine) = stored.as_ref().and_then(|s| s.engine.as_deref()) {
            self.upstream_path = Some(format!("{before}{engine}{after}"));
        }
        self.stored = stored.map(Box::new);
        self.responses_scope = Some(scope);
    }

    /// Whether routing reads the body (`has_body`: the method carries one
    /// and it is not declared empty; `declared`: its Content-Length).
    ///
    /// The prompt is read to name a keyless conversation, to place a new
    /// binding where its prefix lives, and in soft mode to weigh a move by
    /// what each backend holds of it. A keyed turn of a live binding (hard
    /// mode) needs none of that and streams through unread.
    pub fn body_need(&mut self, t: Tables<'_>, has_body: bool, declared: Option<u64>) -> BodyNeed {
        let cfg = &self.routing.config;
        self.read_prompt = t.prefix.enabled()
            && self.prompt_path
            && (self.session.is_none()
                || cfg.affinity.mode == crate::affinity::policy::Mode::Soft
                || !self
                    .early
                    .as_ref()
                    .is_some_and(|(_, s)| t.affinity.is_live(s.key)));
        let responses_api = has_body && self.responses_api;
        self.salted =
            has_body && self.prompt_path && cfg.auth.cache_salt == crate::config::CacheSalt::Tenant;
        let must = has_body
            && ((self.tier.is_none() && self.routing.routes_by_model())
                || (self.session.is_none() && !cfg.affinity.body_session_fields.is_empty())
                || responses_api
                || self.salted);
        if must {
            BodyNeed::Must
        } else if has_body && self.read_prompt && declared.is_some() {
            BodyNeed::Worth
        } else {
            BodyNeed::None
        }
    }

    /// Read what the `body` says of the route: the tier its model picks, a
    /// session key in its fields, the stored response it follows, its
    /// prompt (`affinity.prefix`).
    pub async fn read_body(
        &mut self,
        t: Tables<'_>,
        body: &[u8],
    ) -> Result<BodyFacts, GatewayError> {
        let Some(probe) = BodyProbe::parse(body) else {
            if self.salted {
                // Forwarded as it is, it would reach the engine unsalted.
                return Err(GatewayError::bad_body(
                    "the body must be a JSON object (auth.cache_salt)".into(),
                ));
            }
            if self.prompt_path {
                // Every prompt endpoint takes a JSON object: what is not one
                // gets our error, not the engine's (whose shape varies).
                // The scan that failed is not the judge: a body serde reads
                // as an object goes on as before.
                if let Some(why) = not_a_json_object(body) {
                    return Err(GatewayError::bad_body(why));
                }
            }
            return Ok(BodyFacts::default());
        };
        let routing = Arc::clone(&self.routing);
        let cfg = &routing.config;
        let model = probe.model();
        if self.tier.is_none() {
            if let Some(model) = &model {
                self.tier = routing.tier_by_model(model).cloned();
            }
        }
        let responses_api = self.responses_api;
        if self.session.is_none() {
            // The Conversations API's id (a Responses field) first.
            self.session = responses_api
                .then(|| probe.conversation())
                .flatten()
                .or_else(|| probe.session(&cfg.affinity.body_session_fields));
        }
        let routed_in = Arc::clone(self.tier.as_ref().unwrap_or_else(|| routing.default_tier()));
        let mut edits = Edits::default();
        if responses_api {
            // Response ids are kept under the tier and tenant too.
            let scope = scope_of(&routed_in.name, &self.tenant_scope);
            if let Some(id) = probe.previous_response_id() {
                let stored = stored::presented(t, &routing, &routed_in, &scope, id).await;
                // The engine is asked for its own id.
                if let (Some(engine), Some(raw)) = (
                    stored.as_ref().and_then(|s| s.engine.as_deref()),
                    probe.raw("previous_response_id"),
                ) {
                    edits.string_at(body, raw, engine);
                }
                self.stored = stored.map(Box::new);
            }
            self.responses_scope = Some(scope.into_owned());
        }
        // A follow-up of a stored response sends only its new input: it is
        // a turn of the session that made the response, at the backend
        // that holds it, and its prompt is not the engine's.
        if self.read_prompt && self.stored.is_none() {
            // Cached under its tier and tenant: one tenant's prompts never
            // find another's holdings.
            let keyless = self.session.is_none() && self.parent.is_none();
            self.prompt = t
                .prefix
                .read(
                    &scope_of(&routed_in.name, &self.tenant_scope),
                    model.as_deref(),
                    keyless,
                    self.messages_api,
                    &probe,
                )
                .map(Box::new);
            self.continue_fleets(t, &routed_in).await;
        }
        if self.salted {
            salt::write(
                &routing.hasher,
                &self.tenant_scope,
                body,
                &probe,
                &mut edits,
            )?;
        }
        Ok(BodyFacts {
            max_output: probe.max_output_tokens(),
            asks_stream: Some(probe.is_stream()),
            model,
            rewritten: edits.apply(body),
        })
    }

    /// A keyless conversation new here may be one another gateway of the
    /// fleet routed: asked of the store once (with its binding).
    async fn continue_fleets(&mut self, t: Tables<'_>, tier: &Tier) {
        let (Some(prompt), Some(store)) = (self.prompt.as_mut(), t.store) else {
            return;
        };
        let Some(ends) = prompt.fleet_lookups() else {
            return;
        };
        if let Some(f) = crate::fleet::conversations::find(store, ends, tier, &**t.affinity).await {
            prompt.continue_fleets(t.prefix, f.id, f.slot, f.bound);
        }
    }

    /// The request, as routing will follow it. `body_len`: the body's bytes
    /// when read, else its Content-Length (0 when neither is known).
    pub fn finish(self, body_len: u64) -> RouteRequest {
        let routing = self.routing;
        let tier = self
            .tier
            .unwrap_or_else(|| Arc::clone(routing.default_tier()));
        let mut session = self.session;
        // No key from the client: the conversation its prompt belongs to.
        let implicit = match (&session, self.prompt.as_deref()) {
            (None, Some(route)) => route.conversation().copied(),
            _ => None,
        };
        if let Some(c) = &implicit {
            session = Some(SessionId {
                id: format!("prompt-{:016x}", (c.id >> 64) as u64),
                source: session::Source::Prompt,
            });
        }
        let prompt_tokens = match self.prompt.as_deref() {
            Some(route) => route.tokens(),
            None => body_len / crate::affinity::prefix::prompt::BYTES_PER_TOKEN,
        };
        let mut req = RouteRequest {
            tier,
            session,
            parent: None,
            key: None,
            prompt: self.prompt,
            stored: self.stored,
            responses_scope: self.responses_scope,
            target: self.target,
            final_turn: self.final_turn,
            prompt_tokens,
            upstream_path: self.upstream_path,
            routing,
        };
        // A follow-up of a stored response without a key of its own: the
        // session of the response it follows.
        let follows = match (&req.stored, &req.session, &self.parent, &self.parent_agent) {
            (Some(s), None, None, None) => Some(s.route),
            _ => None,
        };
        let key = match self.early {
            // Nothing the body said changed the tier or the key.
            Some((t, sref)) if Arc::ptr_eq(&t, &req.tier) && implicit.is_none() => Some(sref),
            _ => session_ref(
                &req.routing.hasher,
                &scope_of(&req.tier.name, &self.tenant_scope),
                &self.parent,
                &self.parent_agent,
                &req.session,
                implicit.as_ref(),
                follows.as_ref(),
            ),
        };
        if let Some(route) = &follows {
            req.session = Some(SessionId {
                id: format!("response-chain-{:016x}", route.hash),
                source: session::Source::StoredResponse,
            });
        } else if self.upgrade && self.responses_api {
            // Responses over WebSocket: the ids its events announce are kept too.
            req.responses_scope = Some(scope_of(&req.tier.name, &self.tenant_scope).into_owned());
        }
        // Weighed by its prompt's tokens.
        req.key = key.map(|mut k| {
            k.prompt_tokens = prompt_tokens;
            k
        });
        req.parent = self.parent.or(self.parent_agent).map(|p| p.id);
        req
    }
}

/// Why `body` is not a JSON object, or `None` when it is one.
fn not_a_json_object(body: &[u8]) -> Option<String> {
    use serde::de::IgnoredAny;
    match serde_json::from_slice::<std::collections::HashMap<String, IgnoredAny>>(body) {
        Ok(_) => None,
        Err(e) if e.is_data() => Some("the body must be a JSON object".into()),
        Err(e) => Some(format!("the body is not valid JSON: {e}")),
    }
}
