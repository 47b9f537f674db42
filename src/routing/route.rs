//! [`Route`]: one request's route, decided ([`Route::decide`]) and followed
//! to its end; [`Decision`]: where it went, and why.

use super::request::RouteRequest;
use super::stored;
use super::tables::Tables;
use crate::admission::fleet::{Asker, Placing};
use crate::admission::Class;
use crate::affinity::policy::MoveReason;
use crate::affinity::{Candidate, Lease, Reason, Selection, SessionRef, WaitEnd};
use crate::errors::{GatewayError, Refusal};
use crate::upstream::{Backend, Tier};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Where a request goes, and why.
pub struct Decision {
    pub backend: Arc<Backend>,
    pub affinity_hit: bool,
    pub reason: Reason,
    /// Set when `reason` is [`Reason::Moved`].
    pub moved: Option<MoveReason>,
    /// The session's binding, held while the request is in flight.
    lease: Option<Lease>,
    /// Its prefill there in tokens, when routing knows it: its prompt less
    /// what the prefix index says is held, else a kept binding's estimate.
    pub prefill: Option<u64>,
    /// The session's binding was made for this request.
    created: bool,
    /// The cached tokens it was predicted to find there.
    pub predicted: Option<crate::kv::view::Prediction>,
}

/// A request's route: what it is, and where it went.
pub struct Route {
    pub(super) req: RouteRequest,
    /// Backends that failed it before any byte reached them.
    excluded: Vec<u32>,
    decision: Option<Decision>,
    /// It is re-sent on a fresh connection: it reports its first attempt's
    /// hit and reason (its replay finds the binding that attempt made).
    pub replayed: bool,
    /// What engines' KV events said candidates hold of the session: (slot,
    /// tokens).
    kv_held: Vec<(u32, u64)>,
    /// Backends as the fleet's queue showed them to this request, read
    /// when it was about to be placed: (slot, what it found).
    fleet: Vec<(u32, Placing)>,
    /// The one that read claimed for it.
    claimed: Option<u32>,
}

/// What a WebSocket turn names instead of a response id not issued in its
/// scope: the engine answers that no such response exists.
const NOT_ISSUED_HERE: &str = "resp_not_issued_in_this_scope";

/// Rotates ties among equally loaded backends for session-less requests.
static TIEBREAK: AtomicUsize = AtomicUsize::new(0);

impl Route {
    pub fn new(req: RouteRequest) -> Route {
        Route {
            req,
            excluded: Vec::new(),
            decision: None,
            replayed: false,
            kv_held: Vec::new(),
            fleet: Vec::new(),
            claimed: None,
        }
    }

    /// A session this gateway is about to place (no live binding here),
    /// for `asker`: each backend as the fleet's queue shows it now (one
    /// store round trip, with the fleet's admission queue only). Placement
    /// weighs the prefill other gateways have under way there as it weighs
    /// this gateway's own queue (`placement.queue_aware`): without it, a
    /// new conversation can land where another gateway's prefill runs while
    /// a replica is idle. And with no room anywhere, a new conversation
    /// goes where the fewest waiters would be served before it, counted now
    /// in the queue's order: without it, by this gateway's last sight of
    /// each backend (as old as its last request there) and every waiter
    /// counted, a quiet tenant's new conversations all went to the one
    /// backend that looked least queued and waited behind each other.
    ///
    /// The read claims the backend it decides, where it does (`admission::fleet::Placed`):
    /// returned is the seat the request asks for its slot with.
    pub async fn see_fleet(&mut self, t: Tables<'_>, asker: Asker) -> Option<u64> {
        let session = self.req.key.as_ref()?;
        let placed = self.req.stored.is_some() || self.req.target.is_some();
        if placed || !t.admission.in_fleet() || t.affinity.is_live(session.key) {
            return None;
        }
        // Those open to a new session, in its rendezvous order (a tie in
        // the read goes to the first).
        let tier = &self.req.tier;
        let open: Vec<Candidate> = tier
            .candidates(&self.excluded)
            .into_iter()
            .filter(|c| !(c.draining || c.failing))
            .collect();
        let asked: Vec<(u32, &str)> = crate::affinity::hrw::ranked(session.hash, &open)
            .into_iter()
            .filter_map(|i| {
                let slot = open[i].slot;
                tier.backend_by_slot(slot).map(|b| (slot, &*b.id))
            })
            .collect();
        let (read, seat) = t.admission.fleet_placing(&asked, &asker).await?;
        self.claimed = read.claimed.map(|i| asked[i].0);
        self.fleet = asked
            .iter()
            .map(|(slot, _)| *slot)
            .zip(read.backends)
            .collect();
        seat
    }

    fn fleet_read(&self, slot: u32) -> Option<Placing> {
        self.fleet.iter().find(|(s, _)| *s == slot).map(|(_, p)| *p)
    }

    /// Where this new conversation went to `slot` on a placement read
    /// that found no other gateway's prefill there, and room: the other
    /// backends that read found idle (nothing running, waiting or
    /// prefilling; [`crate::admission::Ask::idle_elsewhere`]). None where
    /// its prompt's prefix chose the backend: that is worth a wait there.
    pub fn idle_elsewhere(&self, slot: u32) -> Vec<Arc<str>> {
        let first = self
            .decision
            .as_ref()
            .is_some_and(|d| d.reason == Reason::FirstTurn);
        let clear = |p: &Placing| p.prefill.tokens == 0 && !p.full;
        if !first || !self.fleet_read(slot).is_some_and(|p| clear(&p)) {
            return Vec::new();
        }
        let idle = |p: &Placing| clear(p) && p.seen == Default::default() && p.claims == 0;
        let tier = &self.req.tier;
        self.fleet
            .iter()
            .filter(|(s, p)| *s != slot && idle(p))
            .filter_map(|(s, _)| tier.backend_by_slot(*s).map(|b| Arc::clone(&b.id)))
            .collect()
    }

    pub fn request(&self) -> &RouteRequest {
        &self.req
    }

    pub fn tier(&self) -> &Arc<Tier> {
        &self.req.tier
    }

    /// The last decision, once made.
    pub fn decision(&self) -> Option<&Decision> {
        self.decision.as_ref()
    }

    pub fn backend(&self) -> Option<&Arc<Backend>> {
        self.decision.as_ref().map(|d| &d.backend)
    }

    /// `slot` cannot take this request (it refused the connection, or went
    /// while the request waited): the next decision leaves it out.
    pub fn exclude(&mut self, slot: u32) {
        self.excluded.push(slot);
    }

    /// The request reached its backend (or is queued for it): the other
    /// requests of a session it is placing may follow it there now.
    pub fn confirm(&mut self) {
        if let Some(lease) = self.decision.as_mut().and_then(|d| d.lease.as_mut()) {
            lease.confirm();
        }
    }

    /// Decide where the request goes, and lease its session's binding.
    /// `who`: its class and fair-share tenant, when admission marks the
    /// backends that have no room; `client_gone`: whether its client left
    /// (looked at while it waits for another request of its session).
    pub async fn decide(
        &mut self,
        t: Tables<'_>,
        who: Option<(Class, u64)>,
        client_gone: impl Fn() -> bool,
    ) -> Result<&Decision, Refusal> {
        // One await (the session router's) and the rest plain calls: this
        // runs for every request.
        let next = match self.candidates(t, who) {
            Err(e) => Err(e.into()),
            Ok(candidates) => match self.unbound(&candidates) {
                Some(decided) => decided.map_err(Refusal::from),
                None => {
                    let (session, owner) = self.session();
                    let tier = &self.req.tier;
                    let wait = self.req.routing.config.affinity.single_flight_wait;
                    let sel = t
                        .affinity
                        .route(&session, &**tier, &candidates, owner, wait, client_gone)
                        .await;
                    self.bound(t, &candidates, sel)
                }
            },
        };
        // The failed attempt's backend stays on record (its answer names
        // it); its lease ends now.
        let mut decision = next.inspect_err(|_| self.end_lease())?;
        if let Some(previous) = self.decision.take() {
            if let Some(old) = previous.lease {
                old.hand_over();
            }
            // A replay finds the binding its own first attempt made: the
            // request is still what that attempt said it was.
            if self.replayed && decision.affinity_hit {
                decision.affinity_hit = previous.affinity_hit;
                decision.reason = previous.reason;
                decision.moved = previous.moved;
            }
        }
        self.routed(t, &mut decision);
        Ok(self.decision.insert(decision))
    }

    fn end_lease(&mut self) {
        if let Some(d) = self.decision.as_mut() {
            d.lease = None;
        }
    }

    /// The backends this request may go to: the tier's healthy ones less
    /// those excluded; only the holder of the stored response it follows;
    /// with admission's room and what each holds of the prompt.
    fn candidates(
        &mut self,
        t: Tables<'_>,
        who: Option<(Class, u64)>,
    ) -> Result<Vec<Candidate>, GatewayError> {
        let tier = &self.req.tier;
        let mut candidates = tier.candidates(&self.excluded);
        for (slot, placing) in &self.fleet {
            let ahead = &placing.prefill;
            if ahead.tokens == 0 {
                continue;
            }
            if let Some(c) = candidates.iter_mut().find(|c| c.slot == *slot) {
                // Another gateway's prefill queues ahead as this one's own
                // would; with none here, it is the queue's head.
                if c.queued_tokens == 0 {
                    (c.head_ms, c.head_tokens) = (ahead.ms, ahead.tokens);
                }
                c.queued_tokens += ahead.tokens;
            }
        }
        if let Some(stored) = &self.req.stored {
            if stored.refused {
                return Err(GatewayError::response_not_found(&stored.id));
            }
            // Only the backend that stored the response it follows has it.
            let slot = stored.route.slot;
            candidates.retain(|c| c.slot == slot);
            if candidates.is_empty() {
                let why = match tier.backend_by_slot(slot) {
                    None => "the backend that stored it left the configuration".to_string(),
                    Some(b) if self.excluded.contains(&slot) => {
                        format!(
                            "backend `{}`, which stored it, refused the connection",
                            b.id
                        )
                    }
                    Some(b) => format!("backend `{}`, which stored it, is not healthy", b.id),
                };
                return Err(GatewayError::previous_response_not_found(&stored.id, &why));
            }
        }
        if let Some((class, tenant)) = who {
            let (read, claimed) = (&self.fleet, self.claimed);
            t.admission
                .mark(&mut candidates, class, tenant, read, claimed);
        }
        // New keyless conversations count as sessions, and what each
        // candidate holds of the prompt (`affinity.prefix`).
        t.prefix.fill_probation(&mut candidates);
        if let Some(prompt) = self.req.prompt.as_mut() {
            prompt.look_up(t.prefix, &mut candidates);
        }
        // What the engines' own events say each holds of the session.
        if let Some(key) = self.req.key.as_ref().map(|s| s.key) {
            self.kv_held = self.req.tier.kv_holdings(&mut candidates, key);
        }
        Ok(candidates)
    }

    /// The decision for a request that no binding routes: none when
    /// `candidates` is empty, the backend `x-agent-serve-backend-id` names,
    /// or for a request without a session the least busy backend. `None`:
    /// its session's binding routes it.
    fn unbound(&self, candidates: &[Candidate]) -> Option<Result<Decision, GatewayError>> {
        let tier = &self.req.tier;
        if let Some(target) = self.req.target.as_deref() {
            return Some(targeted(tier, candidates, target));
        }
        if candidates.is_empty() {
            return Some(Err(match self.excluded.is_empty() {
                true => GatewayError::no_healthy_backend(&tier.name),
                false => GatewayError::all_candidates_failed(&tier.name),
            }));
        }
        self.req.key.is_none().then(|| {
            let index = least_in_flight(tier, candidates);
            Ok(Decision {
                backend: backend_of(tier, candidates, index),
                affinity_hit: false,
                reason: Reason::NoSession,
                moved: None,
                lease: None,
                prefill: None,
                created: false,
                predicted: None,
            })
        })
    }

    /// The session to route, as the router weighs it (whether the prefix
    /// index or the engines' events were read for its prompt), and whether
    /// this request owns its pending placement (a retry of its first
    /// request).
    fn session(&self) -> (SessionRef, bool) {
        let mut session = self.req.key.clone().expect("a session key");
        session.indexed = self.req.prompt.is_some() || !self.kv_held.is_empty();
        let owner = self
            .decision
            .as_ref()
            .and_then(|d| d.lease.as_ref())
            .is_some_and(|l| l.owns_pending());
        (session, owner)
    }

    /// The session router's answer `sel` among `candidates`, counted.
    fn bound(
        &self,
        t: Tables<'_>,
        candidates: &[Candidate],
        sel: Result<Selection, WaitEnd>,
    ) -> Result<Decision, Refusal> {
        let tier = &self.req.tier;
        let sel = sel.map_err(|e| match e {
            // Only for empty candidates, which are ruled out before.
            WaitEnd::NoCandidate => GatewayError::no_healthy_backend(&tier.name).into(),
            WaitEnd::ClientGone => {
                Refusal::ClientGone("client left while waiting for its session's placement")
            }
        })?;
        match sel.reason {
            Reason::Broken => tier.metrics.broken.inc(),
            Reason::Moved => {
                let why = sel.moved.map_or("policy", |m| m.as_str());
                t.metrics
                    .affinity_moves
                    .with_label_values(&[&tier.name, why])
                    .inc();
            }
            _ => {}
        }
        Ok(Decision {
            backend: backend_of(tier, candidates, sel.index),
            affinity_hit: sel.affinity_hit,
            reason: sel.reason,
            moved: sel.moved,
            lease: sel.lease,
            prefill: sel.new_tokens,
            created: sel.created,
            predicted: None,
        })
    }

    /// The prompt went to `decision.backend`: the index learns it, and its
    /// prefill there is the prompt less what the index says is held
    /// (better than the session's last turn, which under KV pressure found
    /// its transcript evicted yet counts only its growth, or the body less
    /// the backend's usual shared prefix).
    fn routed(&mut self, t: Tables<'_>, decision: &mut Decision) {
        let slot = decision.backend.slot;
        let exact = self.kv_held.iter().find(|(s, _)| *s == slot);
        decision.predicted = exact.map(|&(_, tokens)| crate::kv::view::Prediction {
            exact: true,
            tokens,
            of: self.req.prompt_tokens,
        });
        let Some(prompt) = self.req.prompt.as_mut() else {
            return;
        };
        let bound = decision.lease.is_some();
        let held = prompt.routed(t.prefix, slot, bound);
        decision
            .predicted
            .get_or_insert(crate::kv::view::Prediction {
                exact: false,
                tokens: held,
                of: self.req.prompt_tokens,
            });
        // A fleet's other gateways find the conversation by this turn's end.
        if let (Some(store), Some((exact, id, continued))) = (&t.store, prompt.fleet_end()) {
            let ttl = t.affinity.ttl().map_or(0, |t| t.as_millis() as u64);
            crate::fleet::conversations::file(
                store,
                exact,
                id,
                &decision.backend.id,
                continued,
                ttl,
            );
        }
        let tier = &self.req.tier;
        match prompt.matched() {
            true => tier.metrics.prefix_matched.inc(),
            false => tier.metrics.prefix_none.inc(),
        }
        decision.prefill = Some(self.req.prompt_tokens.saturating_sub(held));
    }

    /// The `X-Session-ID` its request carries upstream: its session's key
    /// (see [`crate::kv`]).
    pub fn upstream_session_id(&self) -> Option<http::HeaderValue> {
        self.req
            .key
            .as_ref()
            .map(|s| crate::kv::session::upstream_session_id(s.key))
    }

    /// A subagent that names no class takes its parent session's; one that
    /// names its own is remembered for its own subagents. `named`: the
    /// class its request named, if it did.
    pub fn class_of_session(&self, t: Tables<'_>, named: Option<Class>) -> Option<Class> {
        let session = self.req.key.as_ref()?;
        let adm = &t.admission;
        match named {
            Some(class) => {
                adm.name_class(session.key, class);
                None
            }
            None => session.parent.and_then(|p| adm.named_class(p)),
        }
    }

    /// Whether the ids of the responses its answer stores are issued by the
    /// gateway (`affinity.response_ids: gateway`): they carry their route.
    pub fn issues_response_ids(&self) -> bool {
        self.req.responses_scope.is_some() && self.req.routing.config.affinity.gateway_response_ids
    }

    /// The id the client is given for the engine's response id `engine`,
    /// stored by the backend this request went to.
    pub fn issue_response_id(&self, engine: &str) -> Option<String> {
        stored::issue(&self.req, &self.decision.as_ref()?.backend, engine)
    }

    /// What the engine is asked for in place of `id`, a WebSocket turn's
    /// `previous_response_id`: the engine's own id of one the gateway
    /// issued in this request's scope; where tenants are kept apart, an id
    /// no engine holds for anything else (another tenant's engine id must
    /// not reach the replica that holds it); else `None`, sent as it is.
    pub fn engine_response_id(&self, id: &str) -> Option<String> {
        use crate::affinity::response_id::{read, Presented};
        let scope = self.req.responses_scope.as_deref()?;
        match read(&self.req.routing.hasher, scope, id) {
            Presented::Ours(i) => Some(i.engine),
            _ if self.req.routing.config.separates_tenants() => Some(NOT_ISSUED_HERE.to_string()),
            _ => None,
        }
    }

    /// The stored response it follows, as the engine names it and as the
    /// client did (an id the gateway issued), when they differ.
    pub fn followed_ids(&self) -> Option<(&str, &str)> {
        let s = self.req.stored.as_deref()?;
        Some((s.engine.as_deref()?, s.id.as_str()))
    }

    /// The backend stored the response `id`: its follow-ups go there.
    pub fn learn_response(&self, t: Tables<'_>, id: &str) {
        if let Some(d) = &self.decision {
            stored::learn(t, &self.req, &d.backend, id);
        }
    }

    /// Bad input never leaves a binding behind: drop the one this request
    /// made (a binding that existed before stays, and so does the fleet's
    /// that the store answered with instead), here and in the fleet's
    /// store, which it was written to when placed.
    pub fn forget_new_binding(&self, t: Tables<'_>) {
        if let (Some(session), Some(true)) =
            (&self.req.key, self.decision.as_ref().map(|d| d.created))
        {
            t.affinity.forget(session.key, &*self.req.tier);
        }
    }

    /// The request ended with `status`, its answer's `usage` (prompt and
    /// cached tokens) when it had one, `answered`: a 200 whose first byte
    /// came back. A last turn closes its binding; what the backend reports
    /// cached is remembered for the session (the soft policy's p_hit) and
    /// corrects the prefix index. Returns whether it did correct it.
    pub fn end(
        &self,
        t: Tables<'_>,
        status: u16,
        usage: Option<(u64, Option<u64>)>,
        answered: bool,
    ) -> bool {
        if let Some(session) = &self.req.key {
            if self.req.final_turn {
                t.affinity.forget(session.key, &*self.req.tier);
            } else if let (Some((prompt, cached)), true) = (usage, answered) {
                t.affinity.record_usage(session.key, prompt, cached);
            }
        }
        if let (Some(d), Some((prompt, Some(cached))), true) = (&self.decision, usage, answered) {
            if let Some(p) = d.predicted {
                let wrong = !p.right(prompt, cached);
                self.req.tier.metrics.predictions[p.exact as usize][wrong as usize].inc();
            }
        }
        // The backend answered: it holds the prompt now, and what it
        // reports cached corrects the index.
        self.req
            .prompt
            .as_deref()
            .is_some_and(|p| p.settle(t.prefix, status == 200, usage))
    }
}

/// The backend of `candidates[index]`.
fn backend_of(tier: &Tier, candidates: &[Candidate], index: usize) -> Arc<Backend> {
    Arc::clone(
        tier.backend_by_slot(candidates[index].slot)
            .expect("candidates come from this tier"),
    )
}

/// `x-agent-serve-backend-id` named the backend: it, if it may take the
/// request now.
fn targeted(tier: &Tier, candidates: &[Candidate], target: &str) -> Result<Decision, GatewayError> {
    let Some(b) = tier.backend_by_id(target) else {
        return Err(GatewayError::unknown_backend(target, &tier.name));
    };
    if !candidates.iter().any(|c| c.slot == b.slot) {
        return Err(GatewayError::backend_unavailable(target));
    }
    Ok(Decision {
        backend: Arc::clone(b),
        affinity_hit: false,
        reason: Reason::ExplicitTarget,
        moved: None,
        lease: None,
        prefill: None,
        created: false,
        predicted: None,
    })
}

/// The candidate with the fewest requests in flight (full ones, for
/// admission, last); ties in turn.
fn least_in_flight(tier: &Tier, candidates: &[Candidate]) -> usize {
    // One snapshot: in-flight counts move while we look, and deciding on
    // two different readings can leave no candidate at the minimum.
    let loads: Vec<u64> = candidates
        .iter()
        .map(|c| {
            let full = if c.full { u64::MAX / 2 } else { 0 };
            tier.backend_by_slot(c.slot)
                .map_or(u64::MAX, |b| b.in_flight().max(c.in_flight) + full)
        })
        .collect();
    let min = loads.iter().copied().min().unwrap_or(0);
    let tied: Vec<usize> = (0..loads.len()).filter(|&i| loads[i] == min).collect();
    let pick = TIEBREAK.fetch_add(1, Ordering::Relaxed);
    // Never empty for the non-empty candidates the caller passes.
    tied.get(pick % tied.len().max(1)).copied().unwrap_or(0)
}
