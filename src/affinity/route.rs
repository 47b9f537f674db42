//! The vocabulary of a routing decision: the session being routed
//! ([`SessionRef`]), why its request went where it went ([`Reason`]), and
//! what the router answers ([`Selection`], [`Choice`]).

use super::candidate::Candidate;
use super::hrw::{HrwHasher, KeyKind};
use super::lease::Lease;
use super::policy::MoveReason;
use super::table::BindingKey;

/// A session as the policy sees it.
#[derive(Clone, Debug)]
pub struct SessionRef {
    pub key: BindingKey,
    pub hash: u64,
    /// For a subagent group: the parent session's binding, whose backend the
    /// group's first request prefers (the children share the parent's prefix).
    pub parent: Option<BindingKey>,
    /// This request's prompt, estimated from its body's size (0: unknown).
    pub prompt_tokens: u64,
    /// The candidates' [`Candidate::prefix_tokens`] were read from the
    /// prefix index for this prompt.
    pub indexed: bool,
    /// A keyless conversation's turn that continues one whose last turn went
    /// to this backend: a binding made for it prefers that backend (while
    /// it is within the balance bound), and reaching it is a hit.
    pub continued_at: Option<u32>,
    /// A new keyless conversation on probation: placed, but not bound (see
    /// [`crate::affinity::prefix::conversation`]).
    pub probation: bool,
    /// A new keyless conversation that forks one whose turn went to this
    /// backend: it prefers it while it is within the balance bound, as a
    /// keyed subagent group prefers its parent's.
    pub forked_at: Option<u32>,
}

impl SessionRef {
    pub fn new(hasher: &HrwHasher, kind: KeyKind, tier: &str, id: &str) -> Self {
        Self::of_bytes(hasher, kind, tier, id.as_bytes())
    }

    /// The session a stored response's request was a turn of
    /// ([`crate::affinity::responses`]): a follow-up is its next turn, at
    /// the backend that holds the response.
    pub fn resumed(key: BindingKey, hash: u64, at: u32) -> Self {
        SessionRef {
            key,
            hash,
            continued_at: Some(at),
            ..SessionRef::conversation(key)
        }
    }

    /// A keyless conversation, named by its digest: keyed by
    /// `affinity.hash_key` and scoped by tier and tenant already (see
    /// [`crate::affinity::prefix::conversation`]), so it is its own binding
    /// key, in a domain no header's fingerprint reaches.
    pub fn conversation(id: u128) -> Self {
        SessionRef {
            key: id,
            hash: super::hrw::mix((id >> 64) as u64 ^ id as u64),
            parent: None,
            prompt_tokens: 0,
            indexed: false,
            continued_at: None,
            probation: false,
            forked_at: None,
        }
    }

    /// A session named by bytes that are not text.
    pub fn of_bytes(hasher: &HrwHasher, kind: KeyKind, tier: &str, id: &[u8]) -> Self {
        SessionRef {
            key: hasher.fingerprint_bytes(kind, tier, id),
            hash: hasher.session_hash_bytes(kind, tier, id),
            parent: None,
            prompt_tokens: 0,
            indexed: false,
            continued_at: None,
            probation: false,
            forked_at: None,
        }
    }
}

/// Why a request went where it went (the `reason` of `x_agent_serve`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The live binding was used.
    Hit,
    /// No binding existed.
    FirstTurn,
    /// The binding had expired.
    Expired,
    /// The binding's backend was down, removed or failed: rebound.
    Broken,
    /// A new binding went where the prompt's prefix is cached (`affinity.prefix`).
    Prefix,
    /// Affinity is off (TTL 0): hashed, not stored.
    Disabled,
    /// The table is full of in-flight bindings: served unpinned.
    TableFull,
    /// The request carried no session key.
    NoSession,
    /// The policy moved a live binding (soft mode, or a drain that moves sessions).
    Moved,
    /// `x-agent-serve-backend-id` named the backend.
    ExplicitTarget,
}

/// Whether the prefix index set `backend` apart among `open`: it holds
/// more of the prompt than some other backend that could take it.
pub(super) fn prefix_chose(backend: u32, open: &[Candidate]) -> bool {
    let held = |slot| {
        open.iter()
            .find(|c| c.slot == slot)
            .map(|c| c.prefix_tokens)
    };
    let least = open.iter().map(|c| c.prefix_tokens).min().unwrap_or(0);
    held(backend).is_some_and(|h| h > least)
}

impl Reason {
    /// A new binding was made (the session's first turn here, by whatever
    /// placement), not a kept, moved or broken one.
    pub fn new_binding(self) -> bool {
        matches!(self, Reason::FirstTurn | Reason::Expired | Reason::Prefix)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Hit => "hit",
            Reason::FirstTurn => "first_turn",
            Reason::Expired => "expired",
            Reason::Prefix => "prefix",
            Reason::Broken => "broken",
            Reason::Disabled => "affinity_disabled",
            Reason::TableFull => "table_full",
            Reason::NoSession => "no_session",
            Reason::Moved => "moved",
            Reason::ExplicitTarget => "explicit_target",
        }
    }
}

/// The outcome of [`Affinity::select_backend`].
#[derive(Debug)]
pub struct Selection {
    /// Index into the candidates slice.
    pub index: usize,
    pub backend: u32,
    pub affinity_hit: bool,
    pub reason: Reason,
    pub version: u32,
    /// Set when `reason` is [`Reason::Moved`].
    pub moved: Option<MoveReason>,
    /// For a kept binding: the estimate of this turn's prefill there
    /// ([`table::Turns::next_uncached`]). `None` for new bindings, and before
    /// the backend reported any usage.
    pub new_tokens: Option<u64>,
    /// Held while the request is in flight; dropping it ends the lease.
    pub lease: Option<Lease>,
    /// The binding was made for this request (a new one, whatever its
    /// reason: a keyless conversation's second turn continuing where its
    /// first went is a hit, and its binding new all the same).
    pub created: bool,
}

/// What [`Affinity::select_backend`] decided.
#[derive(Debug)]
pub enum Choice {
    Go(Selection),
    /// Another request of this session is placing it: wait on
    /// [`Affinity::waiter`], then ask again.
    Wait,
}
