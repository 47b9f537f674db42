//! Session affinity: which backend a session's request goes to.
//!
//! [`Affinity`] is the session router, and [`Affinity::route`] the one way to
//! a session's route: the binding is brought in step with the store
//! ([`fleet`]: alone, or a fleet's Redis), then [`Affinity::select_backend`]
//! decides — keep the binding while its backend is a candidate and the
//! policy ([`policy`]) agrees (a hit); otherwise choose by first placement
//! ([`placement`]: bounded-load keyed rendezvous hashing by default) and bind
//! (a miss, "broken" when a binding to a backend that is no longer a
//! candidate was replaced, "moved" when the policy moved a live one) — and
//! the store is told. A new binding is *pending* until its first request
//! reaches the backend; concurrent requests of that session wait for it
//! ([`flight`]: single-flight). The binding table ([`table`]) is private to
//! the router. None of it needs a network, so unit tests and benchmarks
//! drive it.

pub mod candidate;
pub mod flight;
pub mod hrw;
pub mod lease;
pub mod placement;
pub mod policy;
pub mod prefix;
pub mod response_id;
pub mod responses;
pub mod route;
pub mod scan;
pub mod session;
pub mod shared;
mod table;

pub use candidate::{queued_after, unlearned_cost, Candidate};
pub use flight::WaitEnd;
pub use lease::Lease;
pub use route::{Choice, Reason, Selection, SessionRef};
pub use table::{Binding, BindingKey, Moves, MAX_BACKENDS, MAX_TIERS};

use arc_swap::ArcSwap;
use flight::Waiters;
use placement::bounded_hrw::BoundedHrw;
use placement::{FirstKind, FirstPlacement, LoadMeasure};
use policy::{BindingPolicy, DefaultPolicy, MoveReason, ThisTurn};
use route::prefix_chose;
use shared::{Alone, BindingStore, LocalBindings, TierBackends};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use table::{Acquired, BindingTable, Current, Decision};

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
    waiters: Waiters,
    /// Per backend slot (modulo [`MOVE_SLOTS`]): when a session last moved
    /// off it for cost (table ms; 0: never).
    moved_off: Box<[AtomicU64]>,
    /// Where bindings are kept besides the table (see [`fleet`]); unset:
    /// nowhere ([`Alone`]).
    store: std::sync::OnceLock<Arc<dyn BindingStore>>,
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
            store: std::sync::OnceLock::new(),
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
            waiters: Waiters::default(),
            moved_off: (0..MOVE_SLOTS).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    pub fn set_policy(&self, policy: DefaultPolicy) {
        self.policy.store(Arc::new(policy));
    }

    pub fn set_placement(&self, placement: Placement) {
        self.placement.store(Arc::new(placement));
    }

    /// Remember what a session's turn found cached (the cost-aware policy's
    /// p_hit); `None`: the engine does not say.
    pub fn record_usage(&self, key: BindingKey, prompt: u64, cached: Option<u64>) {
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

    /// Whether `key` has a live binding (pending or not).
    pub fn is_live(&self, key: BindingKey) -> bool {
        self.table.get(key, self.now_ms()).is_some()
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

    /// `key`'s live binding (pending or not).
    pub fn binding(&self, key: BindingKey) -> Option<Binding> {
        self.table.get(key, self.now_ms())
    }

    /// Every live binding (the admin API's counts, the state file).
    pub fn bindings(&self) -> Vec<(BindingKey, Binding)> {
        self.table.snapshot(self.now_ms())
    }

    /// Take back a binding saved before a restart (see [`BindingTable::restore`]).
    pub fn restore(&self, key: BindingKey, b: Binding) {
        self.table.restore(key, b)
    }

    /// Bindings whose (tier, backend) `matches`.
    pub fn count_bindings_where(&self, matches: impl Fn(u16, u32) -> bool) -> u64 {
        self.table.count_where(matches)
    }

    /// Bindings in a tier, and how many it evicted for room.
    pub fn tier_bindings(&self, tier: u16) -> (i64, u64) {
        (self.table.tier_len(tier), self.table.tier_evictions(tier))
    }

    /// Another gateway's binding for `key` (the fleet's store), as the store
    /// said it at `checked_ms` (this table's clock, taken before asking):
    /// taken in when newer, or, with `force`, as new but elsewhere (the
    /// store decided a race). See [`BindingTable::adopt`].
    pub fn adopt(&self, key: BindingKey, b: Binding, force: bool, checked_ms: u64) -> bool {
        self.table.adopt(key, b, force, checked_ms)
    }

    /// When `key`'s live binding last agreed with the fleet's store.
    pub fn synced_ms(&self, key: BindingKey) -> Option<u64> {
        self.table.synced_ms(key, self.now_ms())
    }

    /// `key`'s binding agreed with the fleet's store as it was at
    /// `checked_ms` (taken before asking: a message missed meanwhile makes
    /// the next check come sooner, not later).
    pub fn mark_synced(&self, key: BindingKey, checked_ms: u64) {
        self.table.mark_synced(key, checked_ms)
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
        let usable = open_to_new(candidates);
        let open = usable.as_deref().unwrap_or(candidates);
        if self.ttl_ms.load(Ordering::Relaxed) == 0 || session.probation {
            return self
                .place_unbound(session, candidates, open)
                .map(Choice::Go);
        }
        let now = self.now_ms();
        // Read the parent's binding before locking our own shard: two shard
        // locks are never held at once. A keyless conversation's turn
        // prefers where its last turn went.
        let preferred = session
            .parent
            .and_then(|p| self.table.get(p, now))
            .map(|b| b.backend)
            .or(session.continued_at)
            .or(session.forked_at)
            .filter(|&slot| open.iter().any(|c| c.slot == slot));
        let mut review = Review {
            affinity: self,
            session,
            candidates,
            open,
            preferred,
            now,
            policy: self.policy.load(),
            moved: None,
            new_tokens: None,
        };
        let acquired = self
            .table
            .acquire(session.key, tier, now, join_pending, |current| {
                review.decide(current)
            });
        let created = matches!(acquired, Acquired::Bound { previous: None, .. });
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
                self.lease(session, generation, false),
            ),
            Acquired::Bound {
                backend,
                version,
                generation,
                previous,
                expired,
            } => {
                let reason = review.bound_reason(backend, previous.is_some(), expired);
                // Only brand-new bindings are pending (a rebind of a pending
                // one can only come from its own first request, joining).
                let owner = previous.is_none() || join_pending;
                let lease = self.lease(session, generation, owner);
                (backend, reason == Reason::Hit, reason, version, lease)
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
            index: candidates.iter().position(|c| c.slot == backend)?,
            backend,
            affinity_hit,
            reason,
            version,
            moved: review.moved,
            new_tokens: review.new_tokens.filter(|_| affinity_hit),
            lease,
            created,
        }))
    }

    /// A lease on `session`'s binding of `generation`.
    fn lease(
        self: &Arc<Self>,
        session: &SessionRef,
        generation: u32,
        owner: bool,
    ) -> Option<Lease> {
        Some(Lease {
            holder: Arc::clone(self) as Arc<dyn lease::Holder>,
            key: session.key,
            generation,
            pending_owner: owner,
        })
    }

    /// A session that binds nothing: affinity is off (TTL 0; hashed, not
    /// stored), or a new keyless conversation on probation (placed, not
    /// bound: its second turn binds it where this one goes). A fork (a
    /// subagent that starts from its parent's transcript, a retried or
    /// branched turn) prefers where it came from, as a subagent naming its
    /// parent does, unless that backend is over its bound.
    fn place_unbound(
        &self,
        session: &SessionRef,
        candidates: &[Candidate],
        open: &[Candidate],
    ) -> Option<Selection> {
        let disabled = self.ttl_ms.load(Ordering::Relaxed) == 0;
        let came_from = session
            .forked_at
            .filter(|&slot| !disabled && open.iter().any(|c| c.slot == slot));
        let slot = self.place(session.hash, open, came_from)?;
        let reason = if disabled {
            Reason::Disabled
        } else if prefix_chose(slot, open) {
            Reason::Prefix
        } else {
            Reason::FirstTurn
        };
        Some(Selection {
            index: candidates.iter().position(|c| c.slot == slot)?,
            backend: slot,
            affinity_hit: false,
            reason,
            version: 0,
            moved: None,
            new_tokens: None,
            lease: None,
            created: false,
        })
    }

    /// Whether `key`'s binding is still waiting for its first request.
    pub fn is_pending(&self, key: BindingKey) -> bool {
        self.table
            .get(key, self.now_ms())
            .is_some_and(|b| b.pending)
    }

    /// [`Affinity::select_backend`], waiting (at most `wait`) while another
    /// request of the same session is placing it: single-flight (see
    /// [`flight::wait_for`]).
    pub async fn select_waiting(
        self: &Arc<Self>,
        session: &SessionRef,
        tier: u16,
        candidates: &[Candidate],
        owner: bool,
        wait: Duration,
        client_gone: impl Fn() -> bool,
    ) -> Result<Selection, WaitEnd> {
        flight::wait_for(
            &self.waiters,
            session.key,
            owner,
            wait,
            client_gone,
            |join| self.select_backend(session, tier, candidates, join),
        )
        .await
    }

    /// Keep bindings in `store` besides the table too (a fleet's Redis); set
    /// once, before the first request.
    pub fn set_store(&self, store: Arc<dyn BindingStore>) {
        let _ = self.store.set(store);
    }

    fn store(&self) -> &dyn BindingStore {
        match self.store.get() {
            Some(s) => &**s,
            None => &Alone,
        }
    }

    /// The route of a session's request: its binding, brought in step with
    /// the store first; kept, or else placed, waiting while another request
    /// of the session places it ([`Affinity::select_waiting`]); then told to
    /// the store, whose answer wins when another gateway decided first. The
    /// one way a session's request is routed.
    #[allow(clippy::too_many_arguments)]
    pub async fn route(
        self: &Arc<Self>,
        session: &SessionRef,
        tier: &dyn TierBackends,
        candidates: &[Candidate],
        owner: bool,
        wait: Duration,
        client_gone: impl Fn() -> bool,
    ) -> Result<Selection, WaitEnd> {
        if session.probation {
            // Nothing is bound, so there is nothing to agree on with a fleet.
            return match self.select_backend(session, tier.index(), candidates, owner) {
                Some(Choice::Go(sel)) => Ok(sel),
                _ => Err(WaitEnd::NoCandidate),
            };
        }
        let store = self.store();
        store.sync_in(&**self, session.key, tier).await;
        let mut sel = self
            .select_waiting(session, tier.index(), candidates, owner, wait, client_gone)
            .await?;
        if let Some(slot) = store.publish(&**self, session.key, tier, &sel).await {
            if let Some(i) = candidates.iter().position(|c| c.slot == slot) {
                sel.index = i;
                sel.backend = slot;
            }
            // The fleet's binding, another gateway's: not this request's.
            sel.created = false;
        }
        Ok(sel)
    }

    /// Forget a session's binding here, and in the store as far as it is
    /// this one (a `x-dynamo-session-final` turn, bad input's new binding;
    /// `tier` names its backend): a newer binding another gateway made
    /// there stays, and so does one made anew at the same version on
    /// another backend.
    pub fn forget(&self, key: BindingKey, tier: &dyn TierBackends) -> bool {
        if let Some(b) = self.binding(key) {
            let backend = tier.backend_id(b.backend).unwrap_or_default().to_string();
            self.store().forget(key, Some((b.version, backend)));
        }
        self.forget_here(key)
    }

    /// Forget a session's binding here and in the store, whatever its
    /// version (the operator's delete), the store's first and awaited (see
    /// [`BindingStore::forget_now`]).
    pub async fn forget_everywhere(&self, key: BindingKey) -> bool {
        self.store().forget_now(key).await;
        self.forget_here(key)
    }

    /// Forget a session's binding in this table only (the store said so).
    fn forget_here(&self, key: BindingKey) -> bool {
        self.table.remove(key).is_some()
    }

    /// Heap bytes the binding table takes.
    pub fn table_heap_bytes(&self) -> usize {
        self.table.heap_bytes()
    }

    /// Remove expired bindings; returns how many.
    pub fn sweep(&self) -> usize {
        self.table.sweep(self.now_ms(), 4096)
    }
}

/// New bindings avoid draining backends and failing ones, unless nothing
/// else is left, and then full ones (admission), unless every other is:
/// the candidates open to a new binding, when that leaves any out (`None`:
/// all of them, with no allocation in the common case).
fn open_to_new(candidates: &[Candidate]) -> Option<Vec<Candidate>> {
    if !candidates.iter().any(|c| c.draining || c.failing || c.full) {
        return None;
    }
    let keep = |skip_full: bool| -> Vec<Candidate> {
        candidates
            .iter()
            .copied()
            .filter(|c| !(c.draining || c.failing || (skip_full && c.full)))
            .collect()
    };
    let usable = match keep(true) {
        with_room if !with_room.is_empty() => with_room,
        // No room anywhere: where the fewest requests would be served
        // before it (a quiet tenant's two new conversations on one backend
        // would wait for each other, while its turns go ahead of a noisy
        // tenant's waiters on every backend).
        _ => {
            let mut all = keep(false);
            let fewest = all.iter().map(|c| c.ahead).min().unwrap_or(0);
            all.retain(|c| c.ahead == fewest);
            all
        }
    };
    (!usable.is_empty()).then_some(usable)
}

/// One session's binding reviewed under its shard's lock: kept, moved, or
/// (re)bound; and why.
struct Review<'a> {
    affinity: &'a Affinity,
    session: &'a SessionRef,
    candidates: &'a [Candidate],
    /// The candidates open to a new binding.
    open: &'a [Candidate],
    /// Where a new binding goes while it is within the balance bound: the
    /// parent's backend, the conversation's last one, the one it forked from.
    preferred: Option<u32>,
    now: u64,
    policy: arc_swap::Guard<Arc<DefaultPolicy>>,
    moved: Option<MoveReason>,
    /// For a kept binding: this turn's prefill there, as its turns say.
    new_tokens: Option<u64>,
}

impl Review<'_> {
    /// First placement among the open candidates, less `exclude`.
    fn place(&self, exclude: Option<u32>) -> Option<u32> {
        let a = self.affinity;
        match exclude {
            None => a.place(self.session.hash, self.open, self.preferred),
            Some(x) => {
                let pool: Vec<Candidate> =
                    self.open.iter().copied().filter(|c| c.slot != x).collect();
                a.place(self.session.hash, &pool, self.preferred)
            }
        }
    }

    /// What becomes of the binding `current` (none: place one).
    fn decide(&mut self, current: Option<Current>) -> Decision {
        let position = |slot: u32| self.candidates.iter().position(|c| c.slot == slot);
        let Some((i, turns)) = current.and_then(|c| Some((position(c.backend)?, c.turns))) else {
            return match self.place(None) {
                Some(slot) => Decision::Bind(slot),
                None => Decision::Skip,
            };
        };
        let bound = &self.candidates[i];
        // Its backend fails its requests but may not be ejected (the cap):
        // rebind where requests work, as if broken.
        if bound.failing && self.open.iter().any(|c| !c.failing) {
            return match self.place(Some(bound.slot)) {
                Some(slot) => Decision::Bind(slot),
                None => Decision::Keep,
            };
        }
        let session = self.session;
        let new = turns.next_uncached(session.prompt_tokens);
        self.new_tokens = (turns.prompt > 0).then_some(new);
        let turn = ThisTurn {
            new,
            indexed_prompt: session.indexed.then_some(session.prompt_tokens),
        };
        let reason = match self
            .policy
            .review(bound, self.candidates, &turns, &turn, self.now)
        {
            None => return Decision::Keep,
            Some(MoveReason::Cost) if !self.affinity.claim_move_off(bound, self.now) => {
                return Decision::Keep
            }
            Some(reason) => reason,
        };
        match self
            .policy
            .destination(reason, bound, self.open, &turns, &turn)
            .or_else(|| self.place(Some(bound.slot)))
        {
            Some(slot) => {
                self.moved = Some(reason);
                Decision::Bind(slot)
            }
            None => Decision::Keep,
        }
    }

    /// Why a binding made for this request (at `backend`; `rebound`: it
    /// replaced one; `expired`: the one before had expired) went there.
    /// A keyless conversation's turn placed where its last one went
    /// continues it there (a hit); placed elsewhere, it left it for load,
    /// or because that backend is gone.
    fn bound_reason(&mut self, backend: u32, rebound: bool, expired: bool) -> Reason {
        let mut broken_elsewhere = false;
        match self.session.continued_at {
            Some(at) if !rebound && at == backend => return Reason::Hit,
            Some(at) if !rebound && self.open.iter().any(|c| c.slot == at) => {
                self.moved = Some(MoveReason::Overloaded)
            }
            Some(_) if !rebound => broken_elsewhere = true,
            _ => {}
        }
        if self.moved.is_some() {
            Reason::Moved
        } else if rebound || broken_elsewhere {
            Reason::Broken
        } else if prefix_chose(backend, self.open) {
            Reason::Prefix
        } else if expired {
            Reason::Expired
        } else {
            Reason::FirstTurn
        }
    }
}

impl lease::Holder for Affinity {
    fn confirm(&self, key: BindingKey, generation: u32) {
        self.table.confirm(key, generation);
        self.waiters.wake(key);
    }

    fn end(&self, key: BindingKey, generation: u32, pending_owner: bool) {
        let (now, ttl) = (self.now_ms(), self.ttl_ms.load(Ordering::Relaxed));
        if pending_owner {
            self.table.abandon(key, generation, now, ttl);
            self.waiters.wake(key);
        } else {
            self.table.release(key, generation, now, ttl);
        }
    }
}

/// The table as the fleet's store keeps it in step (see [`fleet`]).
impl LocalBindings for Affinity {
    fn now_ms(&self) -> u64 {
        Affinity::now_ms(self)
    }

    fn ttl_ms(&self) -> u64 {
        self.ttl_ms.load(Ordering::Relaxed)
    }

    fn binding(&self, key: BindingKey) -> Option<Binding> {
        Affinity::binding(self, key)
    }

    fn bindings(&self) -> Vec<(BindingKey, Binding)> {
        Affinity::bindings(self)
    }

    fn adopt(&self, key: BindingKey, b: Binding, force: bool, checked_ms: u64) -> bool {
        Affinity::adopt(self, key, b, force, checked_ms)
    }

    fn synced_ms(&self, key: BindingKey) -> Option<u64> {
        Affinity::synced_ms(self, key)
    }

    fn mark_synced(&self, key: BindingKey, checked_ms: u64) {
        Affinity::mark_synced(self, key, checked_ms)
    }

    fn forget_here(&self, key: BindingKey) -> bool {
        Affinity::forget_here(self, key)
    }
}

#[cfg(test)]
mod tests;
