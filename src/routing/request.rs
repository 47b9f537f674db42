//! [`RouteRequest`]: everything known about one request for routing, built
//! once by [`super::Intake`] and read by [`super::Route::decide`].

use crate::affinity::prefix::PromptRoute;
use crate::affinity::responses::ResponseRoute;
use crate::affinity::session::SessionId;
use crate::affinity::SessionRef;
use crate::upstream::{Routing, Tier};
use std::sync::Arc;

/// A stored response a Responses request follows (`previous_response_id`).
#[derive(Debug)]
pub struct StoredRef {
    /// Where it is kept.
    pub route: ResponseRoute,
    /// Its id, as the client sent it.
    pub id: String,
    /// The engine's own id, when the client sent one this gateway issued:
    /// what the backend is asked for.
    pub engine: Option<String>,
    /// The id is no response of this client's (another tenant's, another
    /// tier's, forged): there is no such response.
    pub refused: bool,
}

/// Everything known about one request for routing.
pub struct RouteRequest {
    /// The configuration it is routed by.
    pub(super) routing: Arc<Routing>,
    pub(super) tier: Arc<Tier>,
    /// Its session id as the client sent it, or as named here (a keyless
    /// conversation's, a response chain's): for metadata and traces.
    pub(super) session: Option<SessionId>,
    /// Its parent's id (subagents).
    pub(super) parent: Option<String>,
    /// What the binding table is keyed with (a subagent's group, a
    /// session, a conversation); `None`: routed least busy, unbound.
    pub(super) key: Option<SessionRef>,
    /// Its prompt as routing read it, and where it went (`affinity.prefix`).
    /// Boxed: most keyed turns carry none.
    pub(super) prompt: Option<Box<PromptRoute>>,
    /// The stored response it follows (boxed: most requests follow none,
    /// and the context is copied as the request's future moves).
    pub(super) stored: Option<Box<StoredRef>>,
    /// A Responses request: the scope (tier and tenant) its answer's
    /// response id is kept under, for the follow-ups that name it.
    pub(super) responses_scope: Option<String>,
    /// `x-agent-serve-backend-id`, when allowed.
    pub(super) target: Option<String>,
    /// Its binding closes once it ends (`affinity.session_final_headers`).
    pub(super) final_turn: bool,
    /// The path and query the backend is asked for, when not the client's
    /// (a stored response the gateway named, asked for by the engine's id).
    pub(super) upstream_path: Option<String>,
    /// Its prompt's tokens: the prompt's own estimate when it was read,
    /// else from its body's size (read, or declared; 0 when neither is
    /// known). The first is in the units of what the prefix index says
    /// is held.
    pub(super) prompt_tokens: u64,
}

impl RouteRequest {
    pub fn routing(&self) -> &Arc<Routing> {
        &self.routing
    }

    pub fn tier(&self) -> &Arc<Tier> {
        &self.tier
    }

    pub fn session(&self) -> Option<&SessionId> {
        self.session.as_ref()
    }

    pub fn parent(&self) -> Option<&str> {
        self.parent.as_deref()
    }

    pub fn prompt_tokens(&self) -> u64 {
        self.prompt_tokens
    }

    /// Tokens of the prompt the prefix index said its backend held, when
    /// the prompt was looked up.
    pub fn prefix_tokens(&self) -> Option<u64> {
        self.prompt.as_ref()?.prefix_tokens()
    }

    /// Its answer may carry a response id to keep (a Responses request).
    pub fn keeps_responses(&self) -> bool {
        self.responses_scope.is_some()
    }

    /// The path and query to ask the backend for, when not the client's.
    pub fn upstream_path(&self) -> Option<&str> {
        self.upstream_path.as_deref()
    }

    /// It is routed by a binding (a session, a group, a conversation).
    pub fn bound(&self) -> bool {
        self.key.is_some()
    }
}
