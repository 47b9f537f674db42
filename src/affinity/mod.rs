//! Session affinity: which backend a session's request goes to.
//!
//! [`Affinity::select_backend`] is the whole policy: look the session's binding
//! up; keep it while its backend is a candidate and the policy agrees (a hit);
//! otherwise choose by first placement ([`placement`]: bounded-load keyed
//! rendezvous hashing by default) and bind (a miss, "broken" when
//! a binding to a backend that is no longer a candidate was replaced, "moved"
//! when the policy moved a live one). A new binding is *pending* until its first
//! request reaches the backend; concurrent requests of that session wait for it
//! (single-flight). It needs no network, so unit tests and benchmarks drive it.

pub mod hrw;
pub mod placement;
pub mod policy;
pub mod prefix;
pub mod scan;
pub mod session;
pub mod store;
pub mod table;

use arc_swap::ArcSwap;
use hrw::{HrwHasher, KeyKind, Scored};
use placement::bounded_hrw::BoundedHrw;
use placement::{FirstKind, FirstPlacement, LoadMeasure};
use policy::{BindingPolicy, DefaultPolicy, MoveReason, ThisTurn};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
pub use table::BindingKey;
use table::{Acquired, BindingTable, Decision};
use tokio::sync::Notify;

/// One backend a request may go to: healthy, in the tier, not excluded.
#[derive(Clone, Copy, Debug, Default)]
pub struct Candidate {
    /// Stable process-wide backend number (see `upstream::Slots`).
    pub slot: u32,
    pub seed: u64,
    pub weight: u32,
    pub in_flight: u64,
    /// Running + waiting requests as the engine itself last reported them
    /// (fresh scrapes only; 0 when unknown).
    pub engine_requests: u64,
    /// Takes no new bindings.
    pub draining: bool,
    /// Drained with "move sessions": its bindings move on their next turn.
    pub move_on_drain: bool,
    /// Learned prefill cost per uncached token, µs (0: not enough samples yet).
    pub prefill_us_per_token: f64,
    /// Estimated uncached tokens of this gateway's requests there that have
    /// not begun to answer: the prefill work a new request waits behind now.
    pub queued_tokens: u64,
    /// How long the head of that queue has been prefilling, ms.
    pub head_ms: u64,
    /// The head's own estimated tokens (0: unknown, the whole queue's
    /// progress is taken as the head's).
    pub head_tokens: u64,
    /// Tokens of this request's prompt the prefix index says it holds
    /// (`affinity.prefix`; 0: none, or not known).
    pub prefix_tokens: u64,
    /// Its last requests failed, enough in a row to eject it, but the
    /// ejection cap keeps it in: sessions leave it for a backend that works.
    pub failing: bool,
}

/// A queue's head is overdue — the backend has stalled or slowed several
/// times over since it last taught its cost — once it has prefilled this many
/// times longer than the whole queue's tokens at that cost predict, plus
/// [`OVERDUE_FLOOR_US`]. The whole queue, not the head's own tokens: an engine
/// that prefills requests together (vLLM's and SGLang's batched, chunked
/// prefill) may finish the head only with the others, never later than all of
/// them. And well past it: a busy host's scheduling, or an estimate of the
/// tokens that is off, makes heads late too (at 2× plus 10 ms, a run beside
/// the test suite read ordinary backends as slow and moved a heavy session).
pub const OVERDUE: f64 = 4.0;
pub const OVERDUE_FLOOR_US: f64 = 50_000.0;
/// Heads smaller than this teach nothing about a backend's speed (their
/// time is mostly fixed overheads), as in learning the cost.
pub const OVERDUE_MIN_TOKENS: u64 = 64;

impl Candidate {
    /// Its prefill cost per token now: learned, else `unlearned`
    /// ([`unlearned_cost`]); or, when the head of its queue is overdue (a
    /// backend that has just slowed down or stalled, before any slow answer
    /// has come back to teach it), what the head has taken per token so far.
    pub fn cost_or(&self, unlearned: f64) -> f64 {
        let base = self.base_cost(unlearned);
        self.overdue(base).unwrap_or(base)
    }

    fn base_cost(&self, unlearned: f64) -> f64 {
        if self.prefill_us_per_token > 0.0 {
            self.prefill_us_per_token
        } else {
            unlearned
        }
    }

    /// `Some(µs per token so far)` when the head is overdue at `base`.
    fn overdue(&self, base: f64) -> Option<f64> {
        if self.queued_tokens == 0 || self.head_tokens < OVERDUE_MIN_TOKENS {
            return None;
        }
        let elapsed = self.head_ms as f64 * 1000.0;
        let all_of_it = self.queued_tokens as f64 * base;
        (elapsed > OVERDUE * all_of_it + OVERDUE_FLOOR_US)
            .then(|| elapsed / self.head_tokens as f64)
    }

    /// How long, µs, until a request sent now could begin its own prefill:
    /// the queued work at its cost per token, less what the head has done.
    /// An overdue head (see [`Candidate::cost_or`]) is expected to run late
    /// by as much again as it already has, and the rest of the queue at the
    /// cost it shows; so a stalled backend's wait grows while it stalls
    /// instead of reading as done. 0 with nothing queued.
    pub fn wait_us(&self, unlearned: f64) -> f64 {
        let base = self.base_cost(unlearned);
        match self.overdue(base) {
            Some(live) => {
                let late = self.head_ms as f64 * 1000.0 - self.head_tokens as f64 * base;
                late + live * self.queued_tokens.saturating_sub(self.head_tokens) as f64
            }
            None => {
                let left = queued_after(self.queued_tokens, self.head_ms, self.head_tokens, base);
                base * left as f64
            }
        }
    }
}

/// The prefill cost per token to assume for a candidate that has not taught
/// its own yet: the fastest that `candidates` have learned, or `prior` if
/// that is faster still (or nothing is learned). Weighing one backend's
/// learned cost against another's prior reads the difference as a queue, so
/// a backend with a few answers behind it is not costed at a prior far above
/// what its tier shows; and a tier whose only learned backend is the one that
/// slowed down must not make every other backend look as slow. An unknown
/// backend is thus taken to be as fast as the best known: sessions may move
/// to it, and leave it only for a clear gain, until it has taught its own.
pub fn unlearned_cost(candidates: &[Candidate], prior: f64) -> f64 {
    candidates
        .iter()
        .map(|c| c.prefill_us_per_token)
        .filter(|&us| us > 0.0)
        .fold(prior, f64::min)
}

/// `queued` tokens less what the head of the queue (`head_tokens` of them;
/// 0: unknown, no limit) has prefilled in `head_ms` at `us_per_token` (0:
/// unknown, nothing taken off). A 7,000-token prompt that has prefilled for
/// nine tenths of its time is a short wait; a head that has run past its
/// estimate is no more than done, the requests behind it still ahead.
pub fn queued_after(queued: u64, head_ms: u64, head_tokens: u64, us_per_token: f64) -> u64 {
    if us_per_token <= 0.0 {
        return queued;
    }
    let done = (head_ms as f64 * 1000.0 / us_per_token) as u64;
    let done = match head_tokens {
        0 => done,
        head => done.min(head),
    };
    queued.saturating_sub(done)
}

impl Scored for Candidate {
    fn seed(&self) -> u64 {
        self.seed
    }
    fn weight(&self) -> u32 {
        self.weight
    }
}

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
}

impl SessionRef {
    pub fn new(hasher: &HrwHasher, kind: KeyKind, tier: &str, id: &str) -> Self {
        Self::of_bytes(hasher, kind, tier, id.as_bytes())
    }

    /// A session named by bytes that are not text (a conversation's digest).
    pub fn of_bytes(hasher: &HrwHasher, kind: KeyKind, tier: &str, id: &[u8]) -> Self {
        SessionRef {
            key: hasher.fingerprint_bytes(kind, tier, id),
            hash: hasher.session_hash_bytes(kind, tier, id),
            parent: None,
            prompt_tokens: 0,
            indexed: false,
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
fn prefix_chose(backend: u32, open: &[Candidate]) -> bool {
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
}

/// Why [`Affinity::select_waiting`] returned without a selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitEnd {
    /// `candidates` was empty.
    NoCandidate,
    /// The client closed its connection while the request waited.
    ClientGone,
}

/// What [`Affinity::select_backend`] decided.
#[derive(Debug)]
pub enum Choice {
    Go(Selection),
    /// Another request of this session is placing it: wait on
    /// [`Affinity::waiter`], then ask again.
    Wait,
}

const WAITER_SHARDS: usize = 64;

/// How sessions without a live binding are placed.
pub struct Placement {
    pub first: Box<dyn FirstPlacement>,
    pub load: LoadMeasure,
}

impl Placement {
    pub fn new(kind: FirstKind, bounded: BoundedHrw, load: LoadMeasure) -> Self {
        Placement {
            first: placement::build(kind, bounded),
            load,
        }
    }
}

/// The binding table plus the clock, TTL and policy it is read with.
pub struct Affinity {
    table: BindingTable,
    /// `crate::clock` at creation.
    epoch_ms: u64,
    /// 0 disables affinity.
    ttl_ms: AtomicU64,
    policy: ArcSwap<DefaultPolicy>,
    placement: ArcSwap<Placement>,
    /// Woken when a pending binding is confirmed or abandoned.
    waiters: Box<[Notify]>,
    /// Per backend slot (modulo [`MOVE_SLOTS`]): when a session last moved
    /// off it for cost (table ms; 0: never).
    moved_off: Box<[AtomicU64]>,
    /// Unit tests stop the table's clock here (0: it runs).
    #[cfg(test)]
    frozen_ms: AtomicU64,
}

const MOVE_SLOTS: usize = 1024;

impl Affinity {
    pub fn new(max_bindings: usize, ttl: Option<Duration>) -> Arc<Self> {
        Arc::new(Affinity {
            table: BindingTable::new(max_bindings),
            epoch_ms: crate::clock::now_ms(),
            #[cfg(test)]
            frozen_ms: AtomicU64::new(0),
            ttl_ms: AtomicU64::new(ttl.map_or(0, |d| d.as_millis() as u64)),
            policy: ArcSwap::from_pointee(DefaultPolicy::hard()),
            placement: ArcSwap::from_pointee(Placement::new(
                FirstKind::BoundedHrw,
                BoundedHrw {
                    balance_factor: 1.0,
                    speed_aware: false,
                    queue_aware: false,
                    prior_us_per_token: 100.0,
                },
                LoadMeasure::Sessions,
            )),
            waiters: (0..WAITER_SHARDS).map(|_| Notify::new()).collect(),
            moved_off: (0..MOVE_SLOTS).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    pub fn set_policy(&self, policy: DefaultPolicy) {
        self.policy.store(Arc::new(policy));
    }

    pub fn set_placement(&self, placement: Placement) {
        self.placement.store(Arc::new(placement));
    }

    /// Remember what a session's turn found cached (the cost-aware policy's p_hit).
    pub fn record_usage(&self, key: BindingKey, prompt: u64, cached: u64) {
        self.table.record_usage(key, prompt, cached);
    }

    /// Live bindings that name `backend` (its sessions).
    pub fn backend_bindings(&self, backend: u32) -> u64 {
        self.table.backend_len(backend)
    }

    /// Where a session without a live binding goes among `pool`: the
    /// preferred (parent's) backend while it is within the balance bound,
    /// else the configured first placement.
    fn place(&self, hash: u64, pool: &[Candidate], preferred: Option<u32>) -> Option<u32> {
        if pool.is_empty() {
            return None;
        }
        let placement = self.placement.load();
        let load: Vec<u64> = pool
            .iter()
            .map(|c| placement.load.of(c, self.table.backend_len(c.slot)))
            .collect();
        if let Some(i) = preferred.and_then(|p| pool.iter().position(|c| c.slot == p)) {
            if !placement.first.overloaded(i, pool, &load) {
                return Some(pool[i].slot);
            }
        }
        placement
            .first
            .place(hash, pool, &load)
            .map(|i| pool[i].slot)
    }

    /// Whether a session may move off `bound` for cost now, claiming the
    /// move if so: moves off one backend are [`policy::MOVE_GAP_MS`] apart.
    /// Without it, requests reviewed at the same moment read the same queues
    /// and every session of a backend that looks slow leaves at once (a herd
    /// that swamps the others).
    fn claim_move_off(&self, bound: &Candidate, now: u64) -> bool {
        let cell = &self.moved_off[bound.slot as usize % MOVE_SLOTS];
        let last = cell.load(Ordering::Relaxed);
        // `now` counts from this table's creation; 0 means never moved.
        let stamp = now.max(1);
        (last == 0 || now.saturating_sub(last) >= policy::MOVE_GAP_MS)
            && cell
                .compare_exchange(last, stamp, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Notified when a pending binding of `key` (or one sharing its shard)
    /// is confirmed or abandoned.
    pub fn waiter(&self, key: BindingKey) -> &Notify {
        &self.waiters[(key as usize) % WAITER_SHARDS]
    }

    fn wake(&self, key: BindingKey) {
        self.waiter(key).notify_waiters();
    }

    /// Whether `key` has a live binding (pending or not).
    pub fn is_live(&self, key: BindingKey) -> bool {
        self.table.get(key, self.now_ms()).is_some()
    }

    /// Whether `key`'s binding is still waiting for its first request.
    pub fn is_pending(&self, key: BindingKey) -> bool {
        self.table
            .get(key, self.now_ms())
            .is_some_and(|b| b.pending)
    }

    /// A shorter TTL applies to idle bindings at once (and keeps their
    /// expiry order); a longer one to bindings released from now on.
    pub fn set_ttl(&self, ttl: Option<Duration>) {
        let ms = ttl.map_or(0, |d| d.as_millis() as u64);
        let old = self.ttl_ms.swap(ms, Ordering::Relaxed);
        if ms > 0 && ms < old {
            self.table.clamp_deadlines(self.now_ms() + ms);
        }
    }

    pub fn ttl(&self) -> Option<Duration> {
        match self.ttl_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    pub fn table(&self) -> &BindingTable {
        &self.table
    }

    /// Milliseconds since this table was created: the clock deadlines use.
    pub fn now_ms(&self) -> u64 {
        #[cfg(test)]
        match self.frozen_ms.load(Ordering::Relaxed) {
            0 => {}
            ms => return ms,
        }
        crate::clock::now_ms().saturating_sub(self.epoch_ms)
    }

    /// Convert a table deadline to wall-clock time remaining.
    pub fn remaining(&self, deadline_ms: u64) -> Duration {
        Duration::from_millis(deadline_ms.saturating_sub(self.now_ms()))
    }

    /// [`Affinity::select_backend`], waiting (at most `wait`) while another
    /// request of the same session is placing it: single-flight. Nearly every
    /// request is decided at once; only one that has to wait registers as a
    /// waiter and reads the clock. Out of patience, it follows the pending
    /// placement. `client_gone` is polled while waiting; when it says the
    /// client left, the wait ends with [`WaitEnd::ClientGone`].
    pub async fn select_waiting(
        self: &Arc<Self>,
        session: &SessionRef,
        tier: u16,
        candidates: &[Candidate],
        owner: bool,
        wait: Duration,
        client_gone: impl Fn() -> bool,
    ) -> Result<Selection, WaitEnd> {
        let mut join = owner;
        match self.select_backend(session, tier, candidates, join) {
            Some(Choice::Go(sel)) => return Ok(sel),
            Some(Choice::Wait) => {}
            None => return Err(WaitEnd::NoCandidate),
        }
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.waiter(session.key).notified();
            tokio::pin!(notified);
            // Register before asking, so a confirmation in between is not missed.
            notified.as_mut().enable();
            match self.select_backend(session, tier, candidates, join) {
                Some(Choice::Go(sel)) => return Ok(sel),
                Some(Choice::Wait) => {}
                None => return Err(WaitEnd::NoCandidate),
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                join = true;
                continue;
            }
            let poll = Duration::from_millis(25).min(deadline - now);
            tokio::select! {
                _ = notified => {}
                _ = tokio::time::sleep(poll) => {
                    if client_gone() {
                        return Err(WaitEnd::ClientGone);
                    }
                }
            }
        }
    }

    /// Choose the backend for `session` among `candidates` and lease its binding.
    ///
    /// `candidates` are the tier's backends that may take this request now
    /// (healthy, not excluded by an earlier connect failure). `None` when there
    /// is no candidate. `join_pending`: follow a pending binding instead of
    /// waiting (its own first request retrying, or a waiter out of patience).
    pub fn select_backend(
        self: &Arc<Self>,
        session: &SessionRef,
        tier: u16,
        candidates: &[Candidate],
        join_pending: bool,
    ) -> Option<Choice> {
        if candidates.is_empty() {
            return None;
        }
        // New bindings avoid draining backends and failing ones, unless
        // nothing else is left. (No allocation in the common case.)
        let usable: Vec<Candidate>;
        let open: &[Candidate] = if candidates.iter().any(|c| c.draining || c.failing) {
            usable = candidates
                .iter()
                .copied()
                .filter(|c| !c.draining && !c.failing)
                .collect();
            if usable.is_empty() {
                candidates
            } else {
                &usable
            }
        } else {
            candidates
        };
        let ttl_ms = self.ttl_ms.load(Ordering::Relaxed);
        if ttl_ms == 0 {
            let slot = self.place(session.hash, open, None)?;
            return Some(Choice::Go(Selection {
                index: candidates.iter().position(|c| c.slot == slot)?,
                backend: slot,
                affinity_hit: false,
                reason: Reason::Disabled,
                version: 0,
                moved: None,
                new_tokens: None,
                lease: None,
            }));
        }
        let now = self.now_ms();
        let position = |slot: u32| candidates.iter().position(|c| c.slot == slot);
        // Read the parent's binding before locking our own shard: two shard
        // locks are never held at once.
        let preferred = session
            .parent
            .and_then(|p| self.table.get(p, now))
            .map(|b| b.backend)
            .filter(|&slot| open.iter().any(|c| c.slot == slot));
        let fresh = |exclude: Option<u32>| -> Option<u32> {
            match exclude {
                None => self.place(session.hash, open, preferred),
                Some(x) => {
                    let pool: Vec<Candidate> =
                        open.iter().copied().filter(|c| c.slot != x).collect();
                    self.place(session.hash, &pool, preferred)
                }
            }
        };
        let policy = self.policy.load();
        let mut moved = None;
        let mut new_tokens = None;
        let acquired =
            self.table.acquire(
                session.key,
                tier,
                now,
                join_pending,
                |current| match current.and_then(|c| Some((position(c.backend)?, c.turns))) {
                    // Its backend fails its requests but may not be ejected
                    // (the cap): rebind where requests work, as if broken.
                    Some((i, _)) if candidates[i].failing && open.iter().any(|c| !c.failing) => {
                        match fresh(Some(candidates[i].slot)) {
                            Some(slot) => Decision::Bind(slot),
                            None => Decision::Keep,
                        }
                    }
                    Some((i, turns)) => {
                        let new = turns.next_uncached(session.prompt_tokens);
                        new_tokens = (turns.prompt > 0).then_some(new);
                        let turn = ThisTurn {
                            new,
                            indexed_prompt: session.indexed.then_some(session.prompt_tokens),
                        };
                        match policy.review(&candidates[i], candidates, &turns, &turn, now) {
                            None => Decision::Keep,
                            Some(MoveReason::Cost) if !self.claim_move_off(&candidates[i], now) => {
                                Decision::Keep
                            }
                            Some(reason) => match policy
                                .destination(reason, &candidates[i], open, &turns, &turn)
                                .or_else(|| fresh(Some(candidates[i].slot)))
                            {
                                Some(slot) => {
                                    moved = Some(reason);
                                    Decision::Bind(slot)
                                }
                                None => Decision::Keep,
                            },
                        }
                    }
                    None => match fresh(None) {
                        Some(slot) => Decision::Bind(slot),
                        None => Decision::Skip,
                    },
                },
            );
        let lease = |generation, pending_owner| {
            Some(Lease {
                affinity: Arc::clone(self),
                key: session.key,
                generation,
                pending_owner,
            })
        };
        let (backend, affinity_hit, reason, version, lease) = match acquired {
            Acquired::Kept {
                backend,
                version,
                generation,
            } => (
                backend,
                true,
                Reason::Hit,
                version,
                lease(generation, false),
            ),
            Acquired::Bound {
                backend,
                version,
                generation,
                previous,
                expired,
            } => {
                let reason = if moved.is_some() {
                    Reason::Moved
                } else if previous.is_some() {
                    Reason::Broken
                } else if prefix_chose(backend, open) {
                    Reason::Prefix
                } else if expired {
                    Reason::Expired
                } else {
                    Reason::FirstTurn
                };
                // Only brand-new bindings are pending (a rebind of a pending
                // one can only come from its own first request, joining).
                let owner = previous.is_none() || join_pending;
                (backend, false, reason, version, lease(generation, owner))
            }
            Acquired::Full { backend } => (backend, false, Reason::TableFull, 0, None),
            // The first request is still on its way to a backend that can
            // take it: wait for it. If that backend stopped being a candidate
            // (down, ejected, refused this request), waiting is pointless.
            Acquired::Pending { backend } if candidates.iter().any(|c| c.slot == backend) => {
                return Some(Choice::Wait)
            }
            Acquired::Pending { .. } => {
                return self.select_backend(session, tier, candidates, true);
            }
            Acquired::Skipped => return None,
        };
        Some(Choice::Go(Selection {
            index: position(backend)?,
            backend,
            affinity_hit,
            reason,
            version,
            moved,
            new_tokens: new_tokens.filter(|_| affinity_hit),
            lease,
        }))
    }

    /// Forget a session's binding (admin delete, `x-dynamo-session-final`).
    pub fn forget(&self, key: BindingKey) -> bool {
        self.table.remove(key).is_some()
    }

    /// Remove expired bindings; returns how many.
    pub fn sweep(&self) -> usize {
        self.table.sweep(self.now_ms(), 4096)
    }
}

/// A request's hold on its binding; released on drop, so a finished, failed or
/// abandoned request (client gone) all end the lease the same way. The first
/// request of a new binding owns its pending state: it confirms the binding
/// once it reaches the backend, and dropping it unconfirmed removes the
/// binding so a waiting request can choose instead.
pub struct Lease {
    affinity: Arc<Affinity>,
    key: BindingKey,
    /// The binding's incarnation this lease is on (see the table).
    generation: u32,
    pending_owner: bool,
}

impl Lease {
    pub fn key(&self) -> BindingKey {
        self.key
    }

    pub fn owns_pending(&self) -> bool {
        self.pending_owner
    }

    /// The request reached its backend: waiters may follow the binding.
    pub fn confirm(&mut self) {
        if self.pending_owner {
            self.pending_owner = false;
            self.affinity.table.confirm(self.key, self.generation);
            self.affinity.wake(self.key);
        }
    }

    /// End the lease without giving up a pending binding (its owner is
    /// retrying under a new lease).
    pub fn hand_over(mut self) {
        self.pending_owner = false;
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({:032x})", self.key)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let a = &self.affinity;
        let (now, ttl) = (a.now_ms(), a.ttl_ms.load(Ordering::Relaxed));
        if self.pending_owner {
            a.table.abandon(self.key, self.generation, now, ttl);
            a.wake(self.key);
        } else {
            a.table.release(self.key, self.generation, now, ttl);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(h: &HrwHasher, n: u32) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                slot: i,
                seed: h.backend_seed(&format!("b{i}")),
                weight: 1,
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn a_queue_is_read_less_its_heads_progress_and_no_more() {
        // 7,000 + 500 tokens queued at 50 µs a token.
        assert_eq!(queued_after(7_500, 0, 7_000, 50.0), 7_500);
        assert_eq!(queued_after(7_500, 300, 7_000, 50.0), 1_500);
        // Past its estimate the head is done, not the request behind it.
        assert_eq!(queued_after(7_500, 400, 7_000, 50.0), 500);
        assert_eq!(queued_after(7_500, 400, 0, 50.0), 0, "head unknown");
        assert_eq!(queued_after(7_500, 400, 7_000, 0.0), 7_500, "cost unknown");
        let c = Candidate {
            queued_tokens: 7_500,
            head_tokens: 7_000,
            head_ms: 300,
            ..Default::default()
        };
        assert_eq!(c.wait_us(50.0), 75_000.0);
        assert_eq!(Candidate::default().wait_us(50.0), 0.0, "idle");
    }

    /// Select as a dispatched request would: confirm the binding.
    fn go(a: &Arc<Affinity>, s: &SessionRef, c: &[Candidate]) -> Selection {
        match a.select_backend(s, 0, c, false) {
            Some(Choice::Go(mut sel)) => {
                if let Some(l) = sel.lease.as_mut() {
                    l.confirm();
                }
                sel
            }
            other => panic!("expected a selection, got {other:?}"),
        }
    }

    #[test]
    fn first_turn_misses_then_hits() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let first = go(&a, &s, &c);
        assert!(!first.affinity_hit);
        assert_eq!(first.reason, Reason::FirstTurn);
        drop(first.lease);
        let second = go(&a, &s, &c);
        assert!(second.affinity_hit);
        assert_eq!(second.backend, first.backend);
    }

    #[test]
    fn concurrent_first_requests_wait_for_the_first_placement() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let Some(Choice::Go(mut first)) = a.select_backend(&s, 0, &c, false) else {
            panic!("first request places the session");
        };
        assert!(matches!(
            a.select_backend(&s, 0, &c, false),
            Some(Choice::Wait)
        ));
        first.lease.as_mut().unwrap().confirm();
        let second = go(&a, &s, &c);
        assert!(second.affinity_hit);
        assert_eq!(second.backend, first.backend);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_request_follows_the_first_placement_once_it_is_confirmed() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let wait = Duration::from_secs(3600);
        let mut first = a
            .select_waiting(&s, 0, &c, false, wait, || false)
            .await
            .expect("the first request places the session");
        let polls = Arc::new(AtomicU64::new(0));
        let waiter = {
            let (a, s, c, polls) = (Arc::clone(&a), s.clone(), c.clone(), Arc::clone(&polls));
            tokio::spawn(async move {
                a.select_waiting(&s, 0, &c, false, wait, || {
                    polls.fetch_add(1, Ordering::Relaxed);
                    false
                })
                .await
            })
        };
        // The second request is parked until the first reaches its backend:
        // an hour of (paused) time later it is still waiting, and has been
        // checking on its client all along.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiter.is_finished());
        assert!(polls.load(Ordering::Relaxed) >= 10, "it waited in its loop");
        first.lease.as_mut().unwrap().confirm();
        let second = waiter.await.unwrap().expect("follows the placement");
        assert!(second.affinity_hit);
        assert_eq!(second.backend, first.backend);
    }

    #[tokio::test]
    async fn a_waiter_out_of_patience_joins_the_pending_placement_or_leaves_with_its_client() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let wait = Duration::from_millis(100);
        let first = a
            .select_waiting(&s, 0, &c, false, wait, || false)
            .await
            .unwrap();
        // Never confirmed: after `wait` the second request goes where the first went.
        let second = a
            .select_waiting(&s, 0, &c, false, wait, || false)
            .await
            .expect("joins after the wait");
        assert_eq!(second.backend, first.backend);
        // A client that leaves while waiting ends the wait.
        let third = a.select_waiting(&s, 0, &c, false, Duration::from_secs(60), || true);
        assert_eq!(third.await.unwrap_err(), WaitEnd::ClientGone);
        assert_eq!(
            a.select_waiting(&s, 0, &[], false, wait, || false)
                .await
                .unwrap_err(),
            WaitEnd::NoCandidate
        );
    }

    #[test]
    fn a_waiter_stops_waiting_when_the_pending_backend_is_no_longer_a_candidate() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let Some(Choice::Go(first)) = a.select_backend(&s, 0, &c, false) else {
            panic!("first request places the session");
        };
        // Its backend goes down while its first request is still connecting.
        let rest: Vec<Candidate> = c
            .iter()
            .filter(|x| x.slot != first.backend)
            .cloned()
            .collect();
        let Some(Choice::Go(second)) = a.select_backend(&s, 0, &rest, false) else {
            panic!("no point waiting for a backend that is gone");
        };
        assert_ne!(second.backend, first.backend);
        assert_eq!(second.reason, Reason::Broken);
        // The first request gives up: the second one's binding stays.
        let (first_backend, second_backend) = (first.backend, second.backend);
        drop(first);
        let mut second = second;
        second.lease.as_mut().unwrap().confirm();
        drop(second);
        let third = go(&a, &s, &rest);
        assert!(third.affinity_hit);
        assert_eq!(third.backend, second_backend);
        assert_ne!(third.backend, first_backend);
    }

    #[test]
    fn an_abandoned_first_placement_lets_the_next_request_choose() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let Some(Choice::Go(first)) = a.select_backend(&s, 0, &c, false) else {
            panic!();
        };
        drop(first); // client gone before the backend was reached
        assert!(a.table().is_empty());
        let next = go(&a, &s, &c);
        assert_eq!(next.reason, Reason::FirstTurn);
    }

    #[test]
    fn binding_beats_hrw_while_its_backend_is_a_candidate() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let all = fleet(&h, 4);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let winner = go(&a, &s, &all).backend;
        // Bind while the winner is down...
        let without: Vec<_> = all.iter().copied().filter(|c| c.slot != winner).collect();
        let rebound = go(&a, &s, &without);
        assert_eq!(rebound.reason, Reason::Broken);
        assert_ne!(rebound.backend, winner);
        assert_eq!(rebound.version, 2);
        // ...and the binding holds after the winner comes back: no flapping.
        let back = go(&a, &s, &all);
        assert!(back.affinity_hit);
        assert_eq!(back.backend, rebound.backend);
    }

    #[test]
    fn draining_takes_no_new_sessions_and_soft_mode_moves_off_it() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let mut c = fleet(&h, 3);
        let sessions: Vec<SessionRef> = (0..30)
            .map(|i| SessionRef::new(&h, KeyKind::Session, "t", &format!("s{i}")))
            .collect();
        let placed: Vec<u32> = sessions.iter().map(|s| go(&a, s, &c).backend).collect();
        c[0].draining = true;
        // Hard mode: existing sessions stay, new ones avoid the draining backend.
        for (s, &b) in sessions.iter().zip(&placed) {
            assert_eq!(go(&a, s, &c).backend, b);
        }
        for i in 0..30 {
            let s = SessionRef::new(&h, KeyKind::Session, "t", &format!("new{i}"));
            assert_ne!(go(&a, &s, &c).backend, 0);
        }
        // Soft mode: sessions on the draining backend move, counted as moves.
        a.set_policy(DefaultPolicy {
            mode: policy::Mode::Soft,
            ..DefaultPolicy::hard()
        });
        for (s, &b) in sessions.iter().zip(&placed) {
            let sel = go(&a, s, &c);
            if b == 0 {
                assert_eq!(sel.reason, Reason::Moved);
                assert_eq!(sel.moved, Some(MoveReason::Drain));
                assert_ne!(sel.backend, 0);
            } else {
                assert!(sel.affinity_hit);
            }
        }
    }

    /// A table whose bindings the cost-aware soft policy reviews.
    fn cost_aware() -> Arc<Affinity> {
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        a.set_policy(DefaultPolicy {
            mode: policy::Mode::Soft,
            soft: policy::SoftPolicy::Cost,
            soft_max_in_flight: 0,
            cost: policy::CostParams::default(),
        });
        a
    }

    #[test]
    fn cost_moves_off_one_backend_are_spaced_not_a_herd() {
        let h = HrwHasher::new("k");
        let a = cost_aware();
        let mut c = fleet(&h, 2);
        let sessions: Vec<SessionRef> = (0..4)
            .map(|i| SessionRef::new(&h, KeyKind::Session, "t", &format!("s{i}")))
            .collect();
        for s in &sessions {
            // Placed while backend 0 was the only one; nothing cached there.
            drop(go(&a, s, &c[..1]));
            a.record_usage(s.key, 1000, 0);
        }
        // Backend 0 now has 2 s of prefill queued (20,000 tokens at the
        // 100 µs prior), backend 1 nothing: each session alone would leave,
        // but reviewed at the same moment only one may.
        c[0].queued_tokens = 20_000;
        let moves = |sessions: &[SessionRef]| -> Vec<u32> {
            sessions
                .iter()
                .map(|s| go(&a, s, &c))
                .filter(|sel| sel.reason == Reason::Moved)
                .map(|sel| sel.backend)
                .collect()
        };
        // The clock stands still: on a busy machine the reviews of one
        // moment could otherwise span the gap.
        a.frozen_ms.store(10_000, Ordering::Relaxed);
        assert_eq!(moves(&sessions), vec![1]);
        // Just short of the gap: still none; at the gap, one more.
        a.frozen_ms
            .store(10_000 + policy::MOVE_GAP_MS - 1, Ordering::Relaxed);
        assert_eq!(moves(&sessions[1..]), Vec::<u32>::new());
        a.frozen_ms
            .store(10_000 + policy::MOVE_GAP_MS, Ordering::Relaxed);
        assert_eq!(moves(&sessions[1..]), vec![1]);
    }

    #[test]
    fn a_cost_move_goes_where_the_turn_starts_soonest() {
        let h = HrwHasher::new("k");
        let a = cost_aware();
        let mut c = fleet(&h, 3);
        // A session whose hash, between backends 1 and 2, prefers 1: where
        // first placement would send it.
        let s = (0..)
            .map(|i| SessionRef::new(&h, KeyKind::Session, "t", &format!("s{i}")))
            .find(|s| hrw::choose(s.hash, &c[1..]) == Some(0))
            .unwrap();
        drop(go(&a, &s, &c[..1]));
        a.record_usage(s.key, 1000, 0);
        // Backend 0 has 2 s of prefill queued, backend 1 1 s, backend 2 none.
        c[0].queued_tokens = 20_000;
        c[1].queued_tokens = 10_000;
        let sel = go(&a, &s, &c);
        assert_eq!(sel.moved, Some(MoveReason::Cost));
        assert_eq!(sel.backend, 2, "the backend its ΔQ was weighed against");
    }

    #[test]
    fn a_session_leaves_a_backend_that_fails_it_though_it_may_not_be_ejected() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let mut c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let home = go(&a, &s, &c).backend;
        // Two of three fail every request; the cap keeps one of them in.
        for x in c.iter_mut().filter(|x| x.slot != 2) {
            x.failing = true;
        }
        let sel = go(&a, &s, &c);
        if home == 2 {
            assert!(sel.affinity_hit, "its backend works: it stays");
        } else {
            assert_eq!(sel.reason, Reason::Broken);
            assert_eq!(sel.backend, 2, "to the backend that works");
        }
        // New sessions go where requests work, too.
        for i in 0..20 {
            let n = SessionRef::new(&h, KeyKind::Session, "t", &format!("new{i}"));
            assert_eq!(go(&a, &n, &c).backend, 2);
        }
        // With every backend failing, nothing moves (nowhere better).
        c[2].failing = true;
        assert!(go(&a, &s, &c).affinity_hit);
    }

    #[test]
    fn ttl_zero_stores_nothing() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, None);
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        for _ in 0..3 {
            let sel = go(&a, &s, &c);
            assert!(!sel.affinity_hit);
            assert_eq!(sel.reason, Reason::Disabled);
        }
        assert!(a.table().is_empty());
    }

    #[test]
    fn group_prefers_parent_backend() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 8);
        // Find a parent whose HRW backend differs from its group's.
        for i in 0..100 {
            let parent = SessionRef::new(&h, KeyKind::Session, "t", &format!("p{i}"));
            let mut group = SessionRef::new(&h, KeyKind::Group, "t", &format!("p{i}"));
            if hrw::choose(parent.hash, &c) == hrw::choose(group.hash, &c) {
                continue;
            }
            let p = go(&a, &parent, &c);
            group.parent = Some(parent.key);
            let g = go(&a, &group, &c);
            assert_eq!(g.backend, p.backend);
            return;
        }
        panic!("no parent with a differing group placement found");
    }

    #[test]
    fn no_candidates_no_selection() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(10, Some(Duration::from_secs(1)));
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s");
        assert!(a.select_backend(&s, 0, &[], false).is_none());
        assert!(a.table().is_empty());
    }
}
