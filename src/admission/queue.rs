//! The queue of one gateway's requests for its backends' slots: each
//! backend runs at most its limit and caps its requests prefilling (both
//! configured, or learned: [`super::learn`]); the rest wait here, ordered by
//! class and then fair share ([`super::fair`]), and a freed slot goes
//! straight to the best waiter. In a fleet whose store answers, a request
//! waits in the fleet's queue instead ([`super::fleet`]): its ticket and
//! permit hold their place and slot there ([`FleetWait`], [`Hold`]).

use super::backlog::{
    fill, Place, PrefillRoom, Start, State, Waiter, AHEAD_COUNTED, HOLD_ALPHA, HOLD_PRIOR_MS,
};
use super::class::Class;
use super::fair::Fair;
use super::fleet::{CapSource, Caps, Ended, FleetAsk, FleetSlots, Handed, Held, Seat, Seen};
use super::learn::{Fleet, Here, Limit, LimitSource, Prefill};
use super::reserve::Unreachable;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// How a seat in the fleet's queue is told a slot was handed to it.
type Tell = tokio::sync::mpsc::UnboundedSender<()>;

/// Sessions whose class is remembered for their subagents at most; past
/// it the memory starts over (a subagent then takes its own default).
const MAX_CLASSES: usize = 100_000;

/// The admission state of a set of backends (one gateway's).
pub struct Admission {
    state: Mutex<State>,
    /// Requests that may wait at once, over all backends.
    max_queued: usize,
    /// The class each session's requests named last, by session key: what
    /// its subagents inherit when they name none.
    classes: Mutex<HashMap<u128, Class>>,
    /// This gateway is one of a fleet, whose other gateways send to the
    /// same engines: learned limits are the fleet's (its share of them while
    /// the fleet's queue cannot be reached).
    fleet: std::sync::atomic::AtomicBool,
    /// The fleet's queue ([`super::fleet`]), in a fleet.
    fleet_slots: parking_lot::RwLock<Option<Arc<dyn FleetSlots>>>,
    /// This gateway's requests waiting in the fleet's queue, by seat id:
    /// told when the store hands one a slot.
    fleet_waiters: Mutex<HashMap<u64, (u32, Tell)>>,
    fleet_seq: std::sync::atomic::AtomicU64,
    /// Calls to the fleet's queue under way, and begun so far ([`Op`]).
    fleet_ops: std::sync::atomic::AtomicU32,
    fleet_ops_begun: std::sync::atomic::AtomicU64,
    /// A call failed: the store's counts of this gateway's may be wrong
    /// until set again from its own.
    fleet_unsure: std::sync::atomic::AtomicBool,
}

/// A running request's slot at its backend; dropping it frees the slot for
/// the backend's best waiter.
pub struct Permit {
    admission: Arc<Admission>,
    backend: u32,
    /// When it started (`clock::now_ms`: the coarse clock, fine enough
    /// for the hold times `Retry-After` is estimated from, and cheaper
    /// than `Instant` twice a request).
    since_ms: u64,
    /// The learned limit's window it started in.
    era: u32,
    /// Its estimated prefill, tokens.
    tokens: u64,
    /// Let by as a second prefill under a learned cap of one: its answer
    /// votes even when the work ahead of it was too little to tell.
    pub probe: bool,
    /// A cap on prefills was in force when it started, which it counted
    /// against: an answer that does not stream needs its prefill clock.
    pub needs_clock: bool,
    /// Under a learned cap, its prefill is shorter than the slack: an
    /// answer found not to stream counts off at once, with no clock.
    short: bool,
    /// No longer prefilling: its first byte came back, or the time its
    /// prefill should take passed (see [`Permit::prefill_within`]): shared
    /// with that clock once it runs.
    prefilled: Option<Arc<std::sync::atomic::AtomicBool>>,
    /// Its prefill counted off here (the clock's flag says so once it runs).
    done: bool,
    /// Its slot is the fleet's, given back there too.
    fleet: Option<Hold>,
    /// A fleet slot: the prefill other gateways had under way at its
    /// backend when it was handed over (none otherwise).
    pub fleet_ahead: super::fleet::Ahead,
}

impl Permit {
    fn new(admission: &Arc<Admission>, backend: u32, tokens: u64, s: Start) -> Permit {
        Permit {
            admission: Arc::clone(admission),
            backend,
            since_ms: crate::clock::now_ms(),
            era: s.era,
            tokens,
            probe: s.probe,
            needs_clock: s.clock,
            short: s.short,
            prefilled: None,
            done: !s.counted,
            fleet: None,
            fleet_ahead: Default::default(),
        }
    }

    /// Its first byte came back: it no longer counts as prefilling.
    pub fn prefilled(&mut self) {
        let first = match &self.prefilled {
            Some(flag) => !flag.swap(true, std::sync::atomic::Ordering::AcqRel),
            None => !std::mem::replace(&mut self.done, true),
        };
        if first {
            prefill_over(
                &self.admission,
                self.backend,
                self.tokens,
                self.fleet.as_ref(),
            );
        }
    }

    /// It counts as prefilling for `within` at most: an answer that is not
    /// streamed sends its first byte only once it is whole, long after its
    /// prefill (counted until then, a backend with `max_prefilling: 1` ran
    /// one such request at a time).
    pub fn prefill_within(&mut self, within: std::time::Duration) {
        if self.done || self.prefilled.is_some() {
            return;
        }
        if self.short {
            return self.prefilled();
        }
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        self.prefilled = Some(Arc::clone(&flag));
        let admission = Arc::clone(&self.admission);
        let (backend, tokens, fleet) = (self.backend, self.tokens, self.fleet.clone());
        tokio::spawn(async move {
            tokio::time::sleep(within).await;
            if !flag.swap(true, std::sync::atomic::Ordering::AcqRel) {
                prefill_over(&admission, backend, tokens, fleet.as_ref());
            }
        });
    }
}

/// A request's prefill is over: its room goes to a waiter (the fleet's,
/// for a fleet slot).
fn prefill_over(admission: &Arc<Admission>, backend: u32, tokens: u64, fleet: Option<&Hold>) {
    let op = fleet.map(|_| admission.fleet_op());
    let mut st = admission.state.lock();
    if let Some(b) = st.backends.get_mut(&backend) {
        b.prefill_over(tokens);
        if fleet.is_some() {
            b.fleet_held.prefill_over(tokens);
        }
    }
    fill(&mut st, backend);
    drop(st);
    if let (Some(hold), Some(op)) = (fleet, op) {
        let ended = Ended {
            ran: false,
            prefilling: true,
            tokens,
            probe: false,
        };
        hold.release(op, backend, ended);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let op = self.fleet.as_ref().map(|_| self.admission.fleet_op());
        let held_ms = crate::clock::now_ms().saturating_sub(self.since_ms) as f64;
        let prefilled = match &self.prefilled {
            Some(flag) => flag.swap(true, std::sync::atomic::Ordering::AcqRel),
            None => self.done,
        };
        self.admission.release(
            self.backend,
            Some((held_ms, self.era)),
            (!prefilled).then_some(self.tokens),
            self.probe,
        );
        if let (Some(hold), Some(op)) = (&self.fleet, op) {
            self.admission
                .fleet_ended(self.backend, (!prefilled).then_some(self.tokens));
            let ended = Ended {
                ran: true,
                prefilling: !prefilled,
                tokens: self.tokens,
                probe: self.probe,
            };
            hold.release(op, self.backend, ended);
        }
    }
}

/// A request waiting for a slot: await [`Ticket::wait`] for its permit; drop
/// it (client gone, deadline past) to leave the queue at once.
pub struct Ticket {
    admission: Arc<Admission>,
    backend: u32,
    place: Place,
    tokens: u64,
    woken: Option<oneshot::Receiver<Start>>,
    /// It waits in the fleet's queue, not this gateway's.
    fleet: Option<FleetWait>,
}

impl Ticket {
    /// The permit, once a slot has been handed to this request; `None`: it
    /// waited in the fleet's queue and the store stopped answering (it is
    /// to be placed again).
    pub(super) async fn settle(mut self) -> Option<Permit> {
        if let Some(wait) = self.fleet.as_mut() {
            // The call that took the slot covers the permit's making.
            let (handed, _op) = wait.taken(&self.admission, self.backend).await.ok()?;
            let wait = self.fleet.take()?;
            let p = self
                .admission
                .fleet_taken(self.backend, self.tokens, &wait, handed);
            return Some(p);
        }
        Some(self.wait_here().await)
    }

    /// The permit, once a slot has been handed to this request (one waiting
    /// in this gateway's queue).
    #[cfg(test)]
    pub async fn wait(self) -> Permit {
        self.wait_here().await
    }

    async fn wait_here(mut self) -> Permit {
        // Awaited in place: if this wait is dropped (client gone, deadline
        // past), the ticket's drop still sees whether a slot came and
        // passes it on. The sender goes only after handing the slot over.
        let start = match self.woken.as_mut() {
            Some(woken) => woken.await.unwrap_or_default(),
            None => Start::default(),
        };
        self.woken = None;
        Permit::new(&self.admission, self.backend, self.tokens, start)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(mut wait) = self.fleet.take() {
            self.admission.fleet_queued(-1);
            return wait.leave(&self.admission, self.backend);
        }
        if let Some(mut woken) = self.woken.take() {
            let mut st = self.admission.state.lock();
            let left = st
                .backends
                .get_mut(&self.backend)
                .and_then(|b| b.waiting.remove(&self.place))
                .is_some();
            if left {
                st.queued -= 1;
            } else if let Ok(start) = woken.try_recv() {
                // Handed a slot, then gone before using it: pass it on.
                drop(st);
                let counted = start.counted.then_some(self.tokens);
                self.admission
                    .release(self.backend, None, counted, start.probe);
            }
        }
    }
}

/// What [`Admission::admit`] decided.
pub enum Admit {
    Now(Permit),
    Wait(Ticket),
    /// The queue is full: refuse (429).
    Full,
    /// Another gateway's prefill started at the backend since the
    /// placement read found none ([`super::fleet::Handed::Raced`]): place
    /// it again without that backend.
    Raced,
}

impl Admission {
    pub fn new(max_queued: usize) -> Arc<Admission> {
        Arc::new(Admission {
            state: Mutex::new(State::default()),
            max_queued,
            classes: Mutex::new(HashMap::new()),
            fleet: Default::default(),
            fleet_slots: Default::default(),
            fleet_waiters: Default::default(),
            fleet_seq: Default::default(),
            fleet_ops: Default::default(),
            fleet_ops_begun: Default::default(),
            fleet_unsure: Default::default(),
        })
    }

    /// Whether this gateway is one of a fleet sharing the engines (learned
    /// limits are then its share of each engine's batch).
    pub fn set_fleet(&self, fleet: bool) {
        self.fleet
            .store(fleet, std::sync::atomic::Ordering::Relaxed);
    }

    /// `session`'s requests named `class`: its subagents inherit it.
    pub fn name_class(&self, session: u128, class: Class) {
        let mut classes = self.classes.lock();
        if classes.len() >= MAX_CLASSES && !classes.contains_key(&session) {
            classes.clear();
        }
        classes.insert(session, class);
    }

    /// The class `session`'s requests named last, if they did.
    pub fn named_class(&self, session: u128) -> Option<Class> {
        self.classes.lock().get(&session).copied()
    }

    /// Set how many requests `backend` runs at once, and how many of them
    /// may be prefilling; raised limits take waiters in at once. A limit
    /// being learned keeps what was learned; the prefill votes are kept.
    pub fn set_limit(&self, backend: u32, limit: Limit, prefill: Prefill) {
        let mut st = self.state.lock();
        st.backends.entry(backend).learned.configure(limit, prefill);
        fill(&mut st, backend);
    }

    /// The first answer that taught what one prefill costs at `backend`
    /// came back: until then no probe could vote. A backend that has had
    /// no vote yet is probed at once (not at its next scrape: a burst of
    /// requests is waiting behind the cap it was given on trust).
    pub fn prefill_cost_known(&self, backend: u32) {
        let mut st = self.state.lock();
        let Some(b) = st.backends.get_mut(&backend) else {
            return;
        };
        if b.learned.cost_learned(crate::clock::now_ms()) {
            fill(&mut st, backend);
        }
    }

    /// An answer from `backend` that was sent behind others' prefill work
    /// (enough to tell from noise) waited for it (`Some(true)`) or ran
    /// beside it (`Some(false)`); `None`: a probe sent behind too little
    /// work to tell. Once waiting wins by two votes, a backend without a
    /// configured cap prefills one request at a time: one sent behind three
    /// prefills would wait for all three inside the engine, where no class
    /// or tenant counts. Where prefills run side by side, the cap would
    /// only hold back work the engine does at once, so it is never set
    /// without this evidence. While the engine's last scrape found requests
    /// waiting in its own queue, no answer votes: what they waited for there
    /// was a place in its batch (a limit configured above it), which a cap
    /// on prefills would not give back. Returns the cap's new state when the
    /// vote changed it (`true`: one at a time).
    ///
    /// In a fleet's queue the vote goes to the fleet's tally for the engine
    /// instead (one store call, off the request's path), which this
    /// gateway's cap then follows, as every gateway's does (the slot
    /// scripts apply the tally): the gateways pool their votes as one
    /// gateway pools its answers', so one gateway's stray vote flips no
    /// more than it would alone, and no gateway counts its prefills off a
    /// cap the others keep. Should the store not answer, the vote counts
    /// here.
    pub fn vote_prefill(self: &Arc<Self>, backend: u32, vote: Option<bool>) -> Option<bool> {
        let mut st = self.state.lock();
        let b = st.backends.get_mut(&backend)?;
        let queued = b.learned.counts_as(vote)?;
        if let Some((id, slots)) = b.fleet_id.clone().zip(self.fleet_slots()) {
            let adm = Arc::clone(self);
            tokio::spawn(async move {
                match slots.vote(&id, queued).await {
                    Ok(tally) => adm.follow_tally(backend, Some(tally), queued),
                    Err(_) => adm.follow_tally(backend, None, queued),
                }
            });
            return None;
        }
        let (before, after) = b.learned.count(queued);
        if before && !after {
            fill(&mut st, backend);
        }
        (before != after).then_some(after)
    }

    /// The fleet's tally of votes on prefills at `backend` (see
    /// [`Admission::vote_prefill`]); `None`: the store did not answer, and
    /// the vote (`queued`) counts here.
    fn follow_tally(&self, backend: u32, tally: Option<i8>, queued: bool) {
        let mut st = self.state.lock();
        let Some(b) = st.backends.get_mut(&backend) else {
            return;
        };
        let (before, after) = match tally {
            Some(t) => b.learned.fleet_tally(t),
            None => b.learned.count(queued),
        };
        if before != after {
            log::info!(
                "backend slot {backend}: the fleet's votes say prefills {}",
                match after {
                    true => "queue behind each other; one at a time",
                    false => "run side by side; no cap on them",
                }
            );
        }
        if before && !after {
            fill(&mut st, backend);
        }
    }

    /// The engine behind `backend` reported `running` requests and
    /// `waiting` ones in its own queue (a scrape, at `now_ms`). A learned
    /// limit is what the engine runs once it queues this gateway's requests
    /// (alone: it runs fewer than this gateway has there; in a fleet, any
    /// queue, and the limit is this gateway's share): two scrapes in a row
    /// that find them waiting inside it set the limit to the larger
    /// running count of the two (one alone may catch a request the engine
    /// has not scheduled yet; in slow start, at the limit, one does), never
    /// above what it was. Until the engine
    /// first queues, the limit starts at `SLOW_START` with the first
    /// gauges read and, at each scrape that finds it reached with requests
    /// waiting here and none of its own inside the engine, goes one over, then (the
    /// engine running that one too) doubles (an engine whose gauges cannot
    /// be read is never limited; one that queues only others' requests, or
    /// says it does whatever runs, is not limited for it). After that, it is raised
    /// by one at most every `PROBE_MS`, on the same condition.
    pub fn observe(&self, backend: u32, running: u64, waiting: u64, now_ms: u64) {
        let mut st = self.state.lock();
        let Some(b) = st.backends.get_mut(&backend) else {
            return;
        };
        if b.learned.gauged(waiting, now_ms) {
            fill(&mut st, backend);
        }
        let Some(b) = st.backends.get_mut(&backend) else {
            return;
        };
        let here = match (self.fleet_live(), b.fleet_seen) {
            (true, Some(seen)) => Here {
                running: seen.running,
                waiting: seen.waiting > 0,
                fleet: Fleet::Queue,
            },
            _ => Here {
                running: b.running,
                waiting: !b.waiting.is_empty(),
                fleet: match self.fleet.load(std::sync::atomic::Ordering::Relaxed) {
                    true => Fleet::Share,
                    false => Fleet::Alone,
                },
            },
        };
        if b.learned.limit_gauged(running, waiting, now_ms, here) {
            fill(&mut st, backend);
        }
    }

    /// [`Admission::admit_within`] with no prefill budget (the tests' way in).
    #[cfg(test)]
    pub fn admit(
        self: &Arc<Self>,
        backend: u32,
        class: Class,
        tenant: u64,
        weight: u32,
        tokens: u64,
    ) -> Admit {
        self.admit_within(
            backend,
            class,
            tenant,
            weight,
            tokens,
            PrefillRoom::default(),
        )
    }

    /// A request of `tenant` (an id: fair-share `weight`, at least 1),
    /// estimated at `tokens`, in `class`, for `backend`, whose room for
    /// prefills is now `room`.
    pub fn admit_within(
        self: &Arc<Self>,
        backend: u32,
        class: Class,
        tenant: u64,
        weight: u32,
        tokens: u64,
        room: PrefillRoom,
    ) -> Admit {
        let mut st = self.state.lock();
        let queued = st.queued;
        let b = st.backends.entry(backend);
        (b.prefill_budget, b.prefill_slack) = (room.budget, room.slack);
        let start = b.fair.start_tag(tenant);
        let finish = Fair::finish_tag(start, tokens, weight);
        if b.has_room(tokens) && b.waiting.is_empty() {
            let s = b.next_start(tokens, room.json);
            b.start(tokens, s);
            b.fair.admitted(start);
            b.fair.remember(tenant, finish);
            return Admit::Now(Permit::new(self, backend, tokens, s));
        }
        if queued >= self.max_queued {
            return Admit::Full;
        }
        b.fair.remember(tenant, finish);
        st.seq += 1;
        let place = (class, finish, st.seq);
        let (wake, woken) = oneshot::channel();
        st.backends.entry(backend).waiting.insert(
            place,
            Waiter {
                wake,
                start,
                tokens,
                json: room.json,
            },
        );
        st.queued += 1;
        Admit::Wait(Ticket {
            admission: Arc::clone(self),
            backend,
            place,
            tokens,
            woken: Some(woken),
            fleet: None,
        })
    }

    /// A slot of `backend` is free (after `held` ms in use, when it was,
    /// and the learned limit's window it started in; `prefilling`: the
    /// tokens of a request whose prefill was not over): hand it on to the
    /// best waiters there is room for.
    fn release(
        &self,
        backend: u32,
        held: Option<(f64, u32)>,
        prefilling: Option<u64>,
        probe: bool,
    ) {
        let mut st = self.state.lock();
        if let Some(b) = st.backends.get_mut(&backend) {
            b.learned.ended(probe, held.map(|(_, era)| era));
            if let Some((ms, _)) = held {
                b.hold_ms = match b.hold_ms {
                    0.0 => ms,
                    avg => avg + HOLD_ALPHA * (ms - avg),
                };
            }
            b.running = b.running.saturating_sub(1);
            if let Some(tokens) = prefilling {
                b.prefill_over(tokens);
            }
        }
        fill(&mut st, backend);
    }

    /// An honest `Retry-After` for a request refused a slot at `backend`,
    /// in whole seconds (at least 1): the time its queue takes to drain
    /// through its slots at the slot-hold time seen so far.
    pub fn retry_after_s(&self, backend: u32) -> u64 {
        let st = self.state.lock();
        let Some(b) = st.backends.get(&backend) else {
            return 1;
        };
        let hold = if b.hold_ms > 0.0 {
            b.hold_ms
        } else {
            HOLD_PRIOR_MS
        };
        let waiting = match b.fleet_seen {
            Some(seen) if self.fleet.load(std::sync::atomic::Ordering::Relaxed) => {
                seen.waiting as usize
            }
            _ => b.waiting.len(),
        };
        let rounds = (waiting + 1) as f64 / b.learned.limit.max(1) as f64;
        ((rounds * hold / 1000.0).ceil() as u64).clamp(1, 3600)
    }

    /// Mark the candidates whose slots are all taken (`full`: new
    /// conversations go where there is room), count the requests waiting
    /// for each as in flight there (they will be), and of those, the ones
    /// a request of `class` from `tenant` would wait behind (`ahead`: those
    /// of a higher class, or of its own whose finish tag is no later than
    /// where its own would start; at most [`AHEAD_COUNTED`]). In a fleet's
    /// queue, the fleet's counts: as `placing` read them for this request
    /// (slot, what it found), else as the store last answered this gateway
    /// at that backend, every waiter counted as ahead. A backend the read
    /// `claimed` is the one open to it ([`super::fleet::Placed`]).
    pub fn mark(
        &self,
        candidates: &mut [crate::affinity::Candidate],
        class: Class,
        tenant: u64,
        placing: &[(u32, super::fleet::Placing)],
        claimed: Option<u32>,
    ) {
        let fleet = self.fleet_live();
        let st = self.state.lock();
        // A limit still to be learned (no gauges read yet) is no limit, which
        // says nothing of room: while any candidate's is, none is marked, or
        // that one alone would be open to every new conversation of a burst
        // while the others are full (sessions are sticky).
        let unknown = candidates.iter().any(|c| {
            st.backends
                .get(&c.slot)
                .is_some_and(|b| b.learned.source == LimitSource::Learned && b.learned.limit == 0)
        });
        if unknown {
            return;
        }
        for c in candidates.iter_mut() {
            if let Some(b) = st.backends.get(&c.slot) {
                let read = placing.iter().find(|(slot, _)| *slot == c.slot);
                if let Some((_, p)) = read.filter(|_| fleet) {
                    c.full = p.full;
                    c.in_flight += (p.seen.waiting + p.claims) as u64;
                    c.ahead = p.ahead.min(AHEAD_COUNTED as u32) as u64;
                    continue;
                }
                if let Some(seen) = b.fleet_seen.filter(|_| fleet) {
                    // The fleet's counts as the store last answered here.
                    let limit = b.learned.limit;
                    c.full = (limit > 0 && seen.running >= limit) || seen.waiting > 0;
                    c.in_flight += seen.waiting as u64;
                    c.ahead = seen.waiting.min(AHEAD_COUNTED as u32) as u64;
                    continue;
                }
                c.full = !b.has_room(0) || !b.waiting.is_empty();
                c.in_flight += b.waiting.len() as u64;
                // Only read when no candidate has room.
                if c.full {
                    let ahead = b.waiting.range(..(class, b.fair.start_tag(tenant) + 1, 0));
                    c.ahead = ahead.take(AHEAD_COUNTED).count() as u64;
                }
            }
        }
        let Some(mine) = claimed.filter(|_| fleet) else {
            return;
        };
        let Some(ahead) = candidates.iter().find(|c| c.slot == mine).map(|c| c.ahead) else {
            return;
        };
        for c in candidates.iter_mut().filter(|c| c.slot != mine) {
            c.full = true;
            c.ahead = c.ahead.max(ahead + 1);
        }
    }

    /// Requests waiting, over all backends.
    pub fn queued(&self) -> usize {
        self.state.lock().queued
    }

    /// Each backend's slots, for the admin view and the gauges.
    pub fn snapshot(&self) -> Vec<Slots> {
        let fleet = self.fleet_live();
        let st = self.state.lock();
        st.backends
            .0
            .iter()
            .enumerate()
            .map(|(slot, b)| Slots {
                slot: slot as u32,
                waiting: b.waiting.len(),
                running: b.running,
                limit: b.learned.limit,
                source: b.learned.source,
                max_prefilling: b.learned.max_prefilling(),
                prefill_source: b.learned.prefill_source(),
                prefill_votes: b.learned.prefill_votes,
                prefilling: b.prefilling,
                prefill_tokens: b.prefill_tokens,
                prefill_budget: b.prefill_budget,
                fleet: b.fleet_seen.filter(|_| fleet),
            })
            .collect()
    }

    /// Whether `backend`'s learned limit is being tried (see
    /// [`Learned::learning`]): the scraper reads it again sooner.
    pub fn learning(&self, backend: u32) -> bool {
        let fleet = self.fleet_live();
        let st = self.state.lock();
        st.backends
            .get(&backend)
            .is_some_and(|b| match b.fleet_seen {
                Some(seen) if fleet => b.learned.learning(seen.running, seen.waiting > 0),
                _ => b.learned.learning(b.running, !b.waiting.is_empty()),
            })
    }

    /// Requests waiting for `backend`, and running there.
    pub fn depth(&self, backend: u32) -> (usize, u32) {
        let st = self.state.lock();
        st.backends
            .get(&backend)
            .map_or((0, 0), |b| (b.waiting.len(), b.running))
    }
}

/// The fleet's queue, as admission uses it ([`super::fleet`]).
impl Admission {
    /// This gateway's fleet keeps its queue in `slots`.
    pub fn set_fleet_slots(&self, slots: Arc<dyn FleetSlots>) {
        *self.fleet_slots.write() = Some(slots);
    }

    /// The fleet's queue, when this gateway is one of a fleet and its store
    /// answers.
    pub(super) fn fleet_slots(&self) -> Option<Arc<dyn FleetSlots>> {
        if !self.fleet.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        self.fleet_slots.read().clone().filter(|s| s.healthy())
    }

    fn fleet_live(&self) -> bool {
        self.fleet.load(std::sync::atomic::Ordering::Relaxed)
            && self
                .fleet_slots
                .read()
                .as_ref()
                .is_some_and(|s| s.healthy())
    }

    /// A seat in the fleet's queue for `ask`, told of a slot by the
    /// receiver; `None` for a backend admission does not limit.
    pub(super) fn fleet_seat(
        &self,
        ask: &FleetAsk<'_>,
    ) -> Option<(Seat, tokio::sync::mpsc::UnboundedReceiver<()>)> {
        let mut st = self.state.lock();
        let b = st.backends.entry(ask.backend);
        if b.learned.source == LimitSource::None {
            return None;
        }
        let backend = match &b.fleet_id {
            Some(id) if **id == *ask.backend_id => Arc::clone(id),
            _ => {
                let id: Arc<str> = ask.backend_id.into();
                b.fleet_id = Some(Arc::clone(&id));
                id
            }
        };
        let counted = b.next_start(ask.tokens, ask.json).counted;
        drop(st);
        let id = ask.seat.unwrap_or_else(|| {
            self.fleet_seq
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        });
        let (tell, told) = tokio::sync::mpsc::unbounded_channel();
        self.fleet_waiters.lock().insert(id, (ask.backend, tell));
        let seat = Seat {
            backend,
            id,
            tenant: ask.tenant,
            weight: ask.weight,
            class: ask.class,
            counted,
            tokens: ask.tokens,
            idle_elsewhere: ask.idle_elsewhere.to_vec(),
        };
        Some((seat, told))
    }

    /// The seat `id` no longer waits.
    pub(super) fn fleet_forget(&self, id: u64) {
        self.fleet_waiters.lock().remove(&id);
    }

    /// The store handed seat `id` a slot: whether the seat still waits
    /// here (it then takes it).
    pub fn fleet_woken(&self, id: u64) -> bool {
        match self.fleet_waiters.lock().get(&id) {
            Some((_, tell)) => tell.send(()).is_ok(),
            None => false,
        }
    }

    /// The seats of this gateway waiting in the fleet's queue for `backend`.
    pub fn fleet_waiting(&self, backend: u32) -> Vec<u64> {
        let w = self.fleet_waiters.lock();
        w.iter()
            .filter(|(_, (b, _))| *b == backend)
            .map(|(id, _)| *id)
            .collect()
    }

    /// `backend`'s limits as the fleet's queue applies them: its limit,
    /// and its cap on prefills (one where learned; no probe: the queue
    /// lets none by).
    pub fn fleet_caps(&self, backend: u32) -> Caps {
        let st = self.state.lock();
        st.backends.get(&backend).map_or(Caps::default(), |b| Caps {
            limit: b.learned.limit,
            prefilling: b.learned.fleet_cap(),
            cap_source: match (b.learned.prefill_learned(), b.learned.voted()) {
                (false, _) => CapSource::Configured,
                (true, true) => CapSource::Voted,
                (true, false) => CapSource::Unvoted,
            },
        })
    }

    /// Whether this gateway waits in a fleet's queue now (one of a fleet
    /// whose store answers).
    pub fn in_fleet(&self) -> bool {
        self.fleet_slots().is_some()
    }

    /// Each of `backends` (slot, id; in order) as a request of `asker`
    /// placed now would find it in the fleet's queue, when this gateway is
    /// one of a fleet whose store answers: one store round trip. The read
    /// claims the backend it decides ([`Placed`]) for a seat of this
    /// gateway, returned with it: the request asks for its slot with that
    /// seat. No claim while a limit is still to be learned (no backend is
    /// full then, [`Admission::mark`]).
    pub async fn fleet_placing(
        &self,
        backends: &[(u32, &str)],
        asker: &super::fleet::Asker,
    ) -> Option<(super::fleet::Placed, Option<u64>)> {
        let slots = self.fleet_slots()?;
        let (limits, unknown) = {
            let st = self.state.lock();
            let limit = |slot| st.backends.get(&slot).map(|b| &b.learned);
            let unknown = backends.iter().any(|(slot, _)| {
                limit(*slot).is_some_and(|l| l.source == LimitSource::Learned && l.limit == 0)
            });
            let limits: Vec<(&str, u32)> = backends
                .iter()
                .map(|(slot, id)| (*id, limit(*slot).map_or(0, |l| l.limit)))
                .collect();
            (limits, unknown)
        };
        let seat = (!unknown).then(|| {
            self.fleet_seq
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        });
        let placed = slots.placing(&limits, asker, seat).await.ok()?;
        let seat = seat.filter(|_| placed.claimed.is_some());
        Some((placed, seat))
    }

    /// The fleet's counts at `backend` as the store last answered.
    pub fn fleet_seen(&self, backend: u32, seen: Seen) {
        if let Some(b) = self.state.lock().backends.get_mut(&backend) {
            b.fleet_seen = Some(seen);
        }
    }

    /// Backends that asked the fleet's queue: slot, id, slots held from it
    /// here, and of those, prefilling.
    pub fn fleet_backends(&self) -> Vec<(u32, Arc<str>, Held)> {
        let st = self.state.lock();
        let with_id = st.backends.0.iter().enumerate();
        with_id
            .filter_map(|(slot, b)| Some((slot as u32, b.fleet_id.clone()?, b.fleet_held)))
            .collect()
    }

    /// A call to the fleet's queue begins.
    pub(super) fn fleet_op(self: &Arc<Self>) -> Op {
        use std::sync::atomic::Ordering::SeqCst;
        self.fleet_ops.fetch_add(1, SeqCst);
        self.fleet_ops_begun.fetch_add(1, SeqCst);
        Op(Arc::clone(self))
    }

    pub(super) fn fleet_op_over(&self) {
        self.fleet_ops
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// A call to the fleet's queue failed (or could not be made).
    pub fn fleet_dirty(&self) {
        self.fleet_unsure
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether this gateway's counts in the store are to be set again from
    /// its own now (a call failed, and none is under way): the calls begun
    /// so far, for [`Admission::fleet_reconciled`].
    pub fn fleet_reconcile_due(&self) -> Option<u64> {
        use std::sync::atomic::Ordering::SeqCst;
        let due = self.fleet_unsure.load(SeqCst) && self.fleet_ops.load(SeqCst) == 0;
        due.then(|| self.fleet_ops_begun.load(SeqCst))
    }

    /// The counts were set again (`clean`: at every backend) from what
    /// this gateway held when `begun` calls had begun: sure again unless
    /// another began meanwhile (the store may have counted it before them).
    pub fn fleet_reconciled(&self, begun: u64, clean: bool) {
        use std::sync::atomic::Ordering::SeqCst;
        if clean && self.fleet_ops_begun.load(SeqCst) == begun {
            self.fleet_unsure.store(false, SeqCst);
        }
    }

    /// Every seat waiting here asks whether a slot was handed to it (grants
    /// may have been missed).
    pub fn fleet_wake_all(&self) {
        for (_, tell) in self.fleet_waiters.lock().values() {
            let _ = tell.send(());
        }
    }

    /// A fleet slot for a request of `tokens` at `backend` (whether it
    /// counts as prefilling, whether it went as a probe): counted here too
    /// (the learning and the admin view read it).
    pub(super) fn fleet_permit(
        self: &Arc<Self>,
        backend: u32,
        tokens: u64,
        (counted, handed): (bool, Handed),
        hold: Hold,
    ) -> Permit {
        let (probe, ahead) = match handed {
            Handed::Probe { ahead } => (true, ahead),
            Handed::Slot { ahead } => (false, ahead),
            Handed::None | Handed::Raced { .. } | Handed::Lost => (false, Default::default()),
        };
        let mut st = self.state.lock();
        let b = st.backends.entry(backend);
        let mut s = b.next_start(tokens, false);
        (s.probe, s.counted) = (probe, counted);
        s.clock &= counted;
        b.start(tokens, s);
        b.fleet_held.running += 1;
        if counted {
            b.fleet_held.prefilling += 1;
            b.fleet_held.prefill_tokens += tokens;
        }
        drop(st);
        let mut p = Permit::new(self, backend, tokens, s);
        p.fleet = Some(hold);
        p.fleet_ahead = ahead;
        p
    }

    /// A fleet slot held here was given back (`prefilling`: the tokens it
    /// still counted as prefilling).
    pub(super) fn fleet_ended(&self, backend: u32, prefilling: Option<u64>) {
        if let Some(b) = self.state.lock().backends.get_mut(&backend) {
            b.fleet_held.running = b.fleet_held.running.saturating_sub(1);
            if let Some(tokens) = prefilling {
                b.fleet_held.prefill_over(tokens);
            }
        }
    }

    /// Requests waiting here in the fleet's queue: `by` more (or fewer).
    pub(super) fn fleet_queued(&self, by: isize) {
        let mut st = self.state.lock();
        st.queued = st.queued.saturating_add_signed(by);
    }

    /// Whether one more request may wait here (`max_queued`).
    pub(super) fn room_to_queue(&self) -> bool {
        self.state.lock().queued < self.max_queued
    }

    /// The ticket of a request waiting in the fleet's queue.
    pub(super) fn fleet_ticket(
        self: &Arc<Self>,
        backend: u32,
        tokens: u64,
        wait: FleetWait,
    ) -> Ticket {
        self.fleet_queued(1);
        Ticket {
            admission: Arc::clone(self),
            backend,
            place: (Class::Normal, 0, 0),
            tokens,
            woken: None,
            fleet: Some(wait),
        }
    }
}

/// A request's hold on a fleet slot, kept by its permit.
#[derive(Clone)]
pub(super) struct Hold {
    pub(super) slots: Arc<dyn FleetSlots>,
    pub(super) backend: Arc<str>,
    pub(super) tenant: u64,
}

impl Hold {
    /// Give back what the request held (in the background: it is
    /// dropping), the call counted by `op` (begun before this gateway's own
    /// counts changed).
    pub(super) fn release(&self, op: Op, slot: u32, ended: Ended) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return op.0.fleet_dirty();
        };
        let hold = self.clone();
        rt.spawn(async move {
            let admission = &op.0;
            let caps = admission.fleet_caps(slot);
            let released = hold.slots.release(&hold.backend, hold.tenant, ended, caps);
            match released.await {
                Ok(seen) => admission.fleet_seen(slot, seen),
                Err(Unreachable) => admission.fleet_dirty(),
            }
            drop(op);
        });
    }
}

/// A call to the fleet's queue under way, with the change to this
/// gateway's own counts it brings: while one is, the counts are not set
/// again from this gateway's (they would miss it).
pub(super) struct Op(pub(super) Arc<Admission>);

impl Drop for Op {
    fn drop(&mut self) {
        self.0.fleet_op_over();
    }
}

/// How often a waiter asks the store whether a slot was handed to it (its
/// message may have been lost).
const ASK_EVERY: Duration = Duration::from_secs(1);

/// A request waiting in the fleet's queue.
pub(super) struct FleetWait {
    pub(super) slots: Arc<dyn FleetSlots>,
    pub(super) seat: Seat,
    /// Told when the store says a slot was handed to it.
    pub(super) woken: tokio::sync::mpsc::UnboundedReceiver<()>,
    /// Its wait is over (a slot taken, or the queue left): nothing to
    /// leave when it drops.
    pub(super) over: bool,
    /// A take is under way: one dropped meanwhile may have taken a slot
    /// it never uses.
    pub(super) taking: bool,
}

impl FleetWait {
    /// Until a slot is handed over to it at `slot` and taken (whether as
    /// a probe); `Unreachable` when the store stopped answering (it is to
    /// be placed again, here; its seat is left to setting the counts
    /// again). Taken: with the call that took it, still under way until
    /// the caller has counted the slot here. Only each call is one: while
    /// the seat only waits, this gateway's counts may be set again (its
    /// seat is kept), so that one missed call does not leave the fleet's
    /// counts wrong for as long as requests keep waiting. A seat the store
    /// lost (its data gone) takes its place again.
    pub(super) async fn taken(
        &mut self,
        admission: &Arc<Admission>,
        slot: u32,
    ) -> Result<(Handed, Op), Unreachable> {
        let mut ask = tokio::time::interval(ASK_EVERY);
        ask.tick().await;
        loop {
            tokio::select! {
                _ = self.woken.recv() => {}
                _ = ask.tick() => {}
            }
            self.taking = true;
            let op = admission.fleet_op();
            let caps = admission.fleet_caps(slot);
            let mut taken = self.slots.take(&self.seat, caps).await;
            if let Ok((Handed::Lost, _)) = taken {
                // The store lost its data: the seat takes its place again,
                // and this gateway's counts are set again there.
                admission.fleet_dirty();
                self.seat.idle_elsewhere.clear();
                taken = self.slots.acquire(&self.seat, caps).await;
            }
            self.taking = false;
            let (handed, seen) = taken?;
            admission.fleet_seen(slot, seen);
            if matches!(handed, Handed::Slot { .. } | Handed::Probe { .. }) {
                self.over = true;
                return Ok((handed, op));
            }
        }
    }

    /// Leave the queue (in the background when `admission` drops it).
    pub(super) fn leave(&mut self, admission: &Arc<Admission>, slot: u32) {
        if std::mem::replace(&mut self.over, true) {
            return;
        }
        admission.fleet_forget(self.seat.id);
        if self.taking {
            admission.fleet_dirty();
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return admission.fleet_dirty();
        };
        let (slots, seat, op) = (
            Arc::clone(&self.slots),
            self.seat.clone(),
            admission.fleet_op(),
        );
        rt.spawn(async move {
            let admission = &op.0;
            let caps = admission.fleet_caps(slot);
            match slots.leave(&seat, caps).await {
                Ok(seen) => admission.fleet_seen(slot, seen),
                Err(Unreachable) => admission.fleet_dirty(),
            }
            drop(op);
        });
    }
}

impl Admission {
    /// The permit for the slot the fleet's queue `handed` to `wait`.
    pub(super) fn fleet_taken(
        self: &Arc<Self>,
        slot: u32,
        tokens: u64,
        wait: &FleetWait,
        handed: Handed,
    ) -> Permit {
        self.fleet_queued(-1);
        self.fleet_forget(wait.seat.id);
        let hold = Hold {
            slots: Arc::clone(&wait.slots),
            backend: Arc::clone(&wait.seat.backend),
            tenant: wait.seat.tenant,
        };
        self.fleet_permit(slot, tokens, (wait.seat.counted, handed), hold)
    }
}

/// One backend's slots as they stand.
#[derive(Clone, Copy, Debug, Default)]
pub struct Slots {
    pub slot: u32,
    pub waiting: usize,
    pub running: u32,
    /// 0: none (or none learned yet).
    pub limit: u32,
    pub source: LimitSource,
    /// The cap on requests prefilling in force (0: none).
    pub max_prefilling: u32,
    /// Where it comes from (learned: one while the answers' votes say the
    /// engine's prefills queue, else none).
    pub prefill_source: LimitSource,
    /// Those votes: positive, prefills queued behind each other.
    pub prefill_votes: i8,
    /// Requests prefilling, and their estimated tokens.
    pub prefilling: u32,
    pub prefill_tokens: u64,
    /// Prefill tokens it may have sent and not answered beyond one request
    /// (`admission.prefill_queue_ms` at its learned cost; 0: none).
    pub prefill_budget: u64,
    /// In a fleet whose queue is in its store: the fleet's requests running
    /// there and waiting for it, as the store last answered.
    pub fleet: Option<Seen>,
}

#[cfg(test)]
mod tests {
    use super::super::learn::*;
    use super::*;

    /// A tenant's id, from a name.
    fn t(name: &str) -> u64 {
        xxhash_rust::xxh3::xxh3_64(name.as_bytes())
    }

    fn now(a: Admit) -> Permit {
        match a {
            Admit::Now(p) => p,
            _ => panic!("expected to run at once"),
        }
    }

    fn waits(a: Admit) -> Ticket {
        match a {
            Admit::Wait(t) => t,
            _ => panic!("expected to wait"),
        }
    }

    /// The order in which `tickets` get their slot as one slot is freed
    /// again and again.
    async fn order(first: Permit, tickets: Vec<(&'static str, Ticket)>) -> Vec<&'static str> {
        let mut pending: Vec<(&str, tokio::task::JoinHandle<Permit>)> = tickets
            .into_iter()
            .map(|(name, t)| (name, tokio::spawn(t.wait())))
            .collect();
        let mut served = Vec::new();
        let mut slot = first;
        while !pending.is_empty() {
            drop(slot);
            tokio::task::yield_now().await;
            let i = loop {
                if let Some(i) = pending.iter().position(|(_, h)| h.is_finished()) {
                    break i;
                }
                tokio::task::yield_now().await;
            };
            let (name, h) = pending.remove(i);
            slot = h.await.unwrap();
            served.push(name);
        }
        served
    }

    #[tokio::test]
    async fn a_backend_runs_its_limit_and_hands_a_freed_slot_to_a_waiter() {
        let a = Admission::new(100);
        a.set_limit(0, Limit::Fixed(2), Prefill::None);
        let p1 = now(a.admit(0, Class::Normal, t("t"), 1, 100));
        let _p2 = now(a.admit(0, Class::Normal, t("t"), 1, 100));
        let ticket = waits(a.admit(0, Class::Normal, t("t"), 1, 100));
        assert_eq!(a.depth(0), (1, 2));
        drop(p1);
        let _p3 = ticket.wait().await;
        assert_eq!(a.depth(0), (0, 2), "the slot was handed over, not freed");
        // Another backend is not held up by this one.
        let _q = now(a.admit(1, Class::Normal, t("t"), 1, 100));
    }

    #[tokio::test]
    async fn interactive_turns_go_before_normal_and_batch_whenever_they_came() {
        let a = Admission::new(100);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        let first = now(a.admit(0, Class::Batch, t("t"), 1, 10));
        let tickets = vec![
            ("batch", waits(a.admit(0, Class::Batch, t("t"), 1, 10))),
            ("normal", waits(a.admit(0, Class::Normal, t("t"), 1, 10))),
            (
                "interactive",
                waits(a.admit(0, Class::Interactive, t("t"), 1, 10)),
            ),
        ];
        assert_eq!(
            order(first, tickets).await,
            ["interactive", "normal", "batch"]
        );
    }

    #[tokio::test]
    async fn one_tenants_long_prompts_do_not_starve_anothers_short_ones() {
        let a = Admission::new(100);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        let first = now(a.admit(0, Class::Normal, t("noisy"), 1, 8_000));
        // The noisy tenant queues four long prompts, then the quiet one two
        // short ones: the quiet tenant's come next, not after all of noisy's.
        let mut tickets = Vec::new();
        for _ in 0..4 {
            tickets.push((
                "noisy",
                waits(a.admit(0, Class::Normal, t("noisy"), 1, 8_000)),
            ));
        }
        for _ in 0..2 {
            tickets.push((
                "quiet",
                waits(a.admit(0, Class::Normal, t("quiet"), 1, 500)),
            ));
        }
        let served = order(first, tickets).await;
        assert_eq!(served[..2], ["quiet", "quiet"], "{served:?}");
    }

    #[tokio::test]
    async fn a_backend_whose_queue_ran_ahead_does_not_push_back_anothers_newcomer() {
        let a = Admission::new(100);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        a.set_limit(1, Limit::Fixed(1), Prefill::None);
        let first = now(a.admit(0, Class::Normal, t("noisy"), 1, 1_000));
        let busy = now(a.admit(1, Class::Normal, t("noisy"), 1, 1_000));
        let mut here = Vec::new();
        let mut there = Vec::new();
        for _ in 0..4 {
            here.push((
                "noisy",
                waits(a.admit(0, Class::Normal, t("noisy"), 1, 1_000)),
            ));
            there.push(waits(a.admit(1, Class::Normal, t("noisy"), 1, 1_000)));
        }
        // Backend 1 serves its whole queue; backend 0 none of its own yet.
        drop(busy);
        for ticket in there {
            drop(ticket.wait().await);
        }
        here.push((
            "quiet",
            waits(a.admit(0, Class::Normal, t("quiet"), 1, 1_000)),
        ));
        let served = order(first, here).await;
        assert_eq!(served[0], "quiet", "{served:?}");
    }

    #[tokio::test]
    async fn a_heavier_weight_gets_a_larger_share() {
        let a = Admission::new(100);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        let first = now(a.admit(0, Class::Normal, t("x"), 1, 1));
        let mut tickets = Vec::new();
        for _ in 0..4 {
            tickets.push((
                "light",
                waits(a.admit(0, Class::Normal, t("light"), 1, 1_000)),
            ));
            tickets.push((
                "heavy",
                waits(a.admit(0, Class::Normal, t("heavy"), 3, 1_000)),
            ));
        }
        let served = order(first, tickets).await;
        let heavy_first_half = served[..4].iter().filter(|n| **n == "heavy").count();
        assert_eq!(heavy_first_half, 3, "{served:?}");
    }

    #[tokio::test]
    async fn a_request_that_leaves_the_queue_is_gone_at_once_and_skipped() {
        let a = Admission::new(2);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        let p = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        let gone = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        let stays = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        assert!(matches!(
            a.admit(0, Class::Normal, t("t"), 1, 10),
            Admit::Full
        ));
        drop(gone); // its client disconnected
        assert_eq!(a.depth(0), (1, 1));
        drop(p);
        let _next = stays.wait().await;
        assert_eq!(a.depth(0), (0, 1));
    }

    #[tokio::test]
    async fn a_slot_handed_to_a_request_gone_meanwhile_is_passed_on() {
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        let p = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        let gone = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        let next = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        drop(p); // handed to `gone`...
        drop(gone); // ...which left before taking it
        let _p = next.wait().await;
        assert_eq!(a.depth(0), (0, 1));
    }

    #[tokio::test]
    async fn a_wait_abandoned_after_its_slot_came_passes_the_slot_on() {
        use futures_util::FutureExt;
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        let p = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        let mut waiting = Box::pin(waits(a.admit(0, Class::Normal, t("t"), 1, 10)).wait());
        let next = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        assert!((&mut waiting).now_or_never().is_none(), "parked");
        drop(p); // the slot goes to the parked wait...
        drop(waiting); // ...whose client leaves before it runs
        let passed = next.wait().now_or_never();
        assert!(passed.is_some(), "the slot was passed on");
        assert_eq!(a.depth(0), (0, 1));
    }

    #[tokio::test]
    async fn a_raised_limit_takes_waiters_in_at_once() {
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        let _p = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        let ticket = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        a.set_limit(0, Limit::Fixed(2), Prefill::None);
        use futures_util::FutureExt;
        let in_now = ticket.wait().now_or_never();
        assert!(in_now.is_some());
        assert_eq!(a.depth(0), (0, 2));
    }

    fn limit_of(a: &Admission, backend: u32) -> (u32, LimitSource) {
        let s = a.snapshot()[backend as usize];
        (s.limit, s.source)
    }

    /// Two gateways in front of one engine that runs 8: each learns its
    /// part of the batch, in proportion to what it has there, not the whole
    /// Alone, a queue inside the engine that holds none of this gateway's
    /// requests (another client's, or a gauge that reports 100,000 waiting
    /// whatever runs) does not hold this gateway's back: every request it
    /// sends runs, so the limit grows as it would with no queue there.
    #[tokio::test]
    async fn alone_a_queue_of_others_requests_does_not_lower_the_limit() {
        let a = Admission::new(100);
        a.set_limit(0, Limit::Learn, Prefill::None);
        a.observe(0, 0, 100_000, 1_000);
        assert_eq!(limit_of(&a, 0).0, SLOW_START);
        let running: Vec<Permit> = (0..SLOW_START)
            .map(|_| now(a.admit(0, Class::Normal, t("t"), 1, 10)))
            .collect();
        // (Waiters let in by a raised limit count as running here at once.)
        let _waiters: Vec<Ticket> = (0..40)
            .map(|_| waits(a.admit(0, Class::Normal, t("t"), 1, 10)))
            .collect();
        assert!(a.learning(0), "held at its limit in slow start: read soon");
        // The engine runs every one of them (and says 100,000 wait): one
        // over is tried, then the limit doubles.
        a.observe(0, 4, 100_000, 1_100);
        assert_eq!(limit_of(&a, 0).0, SLOW_START + 1);
        a.observe(0, 5, 100_000, 1_200);
        assert_eq!(limit_of(&a, 0), (2 * SLOW_START, LimitSource::Learned));
        // Once it runs fewer than this gateway has there, the requests
        // waiting inside it are this gateway's own: the limit is what it runs.
        a.observe(0, 6, 100_000, 1_300);
        assert_eq!(limit_of(&a, 0).0, 6);
        drop(running);
    }

    /// A gauge that reads 0 running whatever runs, and nothing waiting:
    /// the one over cannot be seen running, and the engine's empty queue
    /// is evidence enough to double (not a second's wait at each step).
    #[tokio::test]
    async fn a_gauge_that_counts_none_of_its_requests_does_not_hold_slow_start_back() {
        let a = Admission::new(100);
        a.set_limit(0, Limit::Learn, Prefill::None);
        a.observe(0, 0, 0, 1_000);
        let _running: Vec<Permit> = (0..SLOW_START)
            .map(|_| now(a.admit(0, Class::Normal, t("t"), 1, 10)))
            .collect();
        let _waiters: Vec<Ticket> = (0..40)
            .map(|_| waits(a.admit(0, Class::Normal, t("t"), 1, 10)))
            .collect();
        a.observe(0, 0, 0, 1_100);
        assert_eq!(limit_of(&a, 0).0, SLOW_START + 1);
        a.observe(0, 0, 0, 1_200);
        assert_eq!(limit_of(&a, 0).0, 2 * SLOW_START);
        // (One that counts them, and not the one over yet, is waited for:
        // see `a_learned_limit_is_what_the_engine_runs_once_it_queues`.)
    }

    /// batch each (which queued as much again inside the engine).
    #[tokio::test]
    async fn beside_another_gateway_a_learned_limit_is_its_share_of_the_batch() {
        let a = Admission::new(100);
        a.set_fleet(true);
        a.set_limit(0, Limit::Learn, Prefill::None);
        a.observe(0, 0, 0, 1_000);
        let _running: Vec<Permit> = (0..SLOW_START)
            .map(|_| now(a.admit(0, Class::Normal, t("t"), 1, 10)))
            .collect();
        // The engine runs 8 and queues 4: this gateway's 4, and the other's
        // 8, of which 4 run. Twice in a row is evidence.
        a.observe(0, 8, 4, 2_000);
        a.observe(0, 8, 4, 3_000);
        assert_eq!(limit_of(&a, 0).0, 8 * 4 / 12);
        // (Alone, other clients' requests beside its own are not its to make
        // room for: see `a_learned_limit_is_what_the_engine_runs_once_it_queues`.)
    }

    #[tokio::test]
    async fn a_learned_limit_is_what_the_engine_runs_once_it_queues() {
        use futures_util::FutureExt;
        let a = Admission::new(100);
        a.set_limit(0, Limit::Learn, Prefill::None);
        // Nothing read from the engine yet: every request goes straight on.
        let mut running: Vec<Permit> = (0..3)
            .map(|_| now(a.admit(0, Class::Normal, t("t"), 1, 10)))
            .collect();
        assert_eq!(limit_of(&a, 0), (0, LimitSource::Learned));
        // Its first gauges: a slow start.
        a.observe(0, 3, 0, 1_000);
        assert_eq!(limit_of(&a, 0).0, SLOW_START);
        running.push(now(a.admit(0, Class::Normal, t("t"), 1, 10)));
        let ticket = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        // Reached, with a waiter here and none inside the engine: one more
        // is tried, and the waiter goes in.
        a.observe(0, 4, 0, 2_000);
        assert_eq!(limit_of(&a, 0).0, SLOW_START + 1);
        running.push(ticket.wait().now_or_never().expect("let in"));
        assert!(a.learning(0), "tried: read again soon");
        let ticket = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        // Not running inside the engine yet (on its way): no evidence.
        a.observe(0, 4, 0, 2_100);
        assert_eq!(limit_of(&a, 0).0, SLOW_START + 1);
        assert!(a.learning(0), "still tried");
        // The engine runs it too: room to double into.
        a.observe(0, 5, 0, 2_500);
        assert_eq!(limit_of(&a, 0).0, 2 * SLOW_START);
        assert!(!a.learning(0));
        running.push(ticket.wait().now_or_never().expect("let in"));
        running.extend((0..2).map(|_| now(a.admit(0, Class::Normal, t("t"), 1, 10))));
        // In slow start, at the limit, one scrape that finds requests
        // waiting inside the engine ends it: the engine runs 6 at most.
        a.observe(0, 6, 2, 3_000);
        assert_eq!(limit_of(&a, 0), (6, LimitSource::Learned));
        running.truncate(6);
        let ticket = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        // After it, one scrape may have caught a request the engine had not
        // scheduled yet: no change; and a queue at a higher count (another
        // client's: the engine runs all this gateway has there) neither
        // raises nor lowers it.
        a.observe(0, 5, 1, 4_000);
        assert_eq!(limit_of(&a, 0).0, 6);
        a.observe(0, 7, 0, 5_000);
        a.observe(0, 7, 1, 5_500);
        a.observe(0, 7, 1, 6_000);
        assert_eq!(limit_of(&a, 0).0, 6);
        // At the limit with a waiter here and none of its own inside the
        // engine: PROBE_MS after the last change it tries one more, and the
        // waiter goes in.
        a.observe(0, 6, 0, 4_000 + PROBE_MS - 1);
        assert_eq!(limit_of(&a, 0).0, 6);
        a.observe(0, 6, 0, 6_000 + PROBE_MS);
        assert_eq!(limit_of(&a, 0).0, 7);
        running.push(ticket.wait().now_or_never().expect("let in"));
        assert!(a.learning(0), "tried: read again soon");
        // The engine queues it: the next reading confirms, and the limit
        // is what it runs again.
        a.observe(0, 6, 1, 6_100 + PROBE_MS);
        assert!(a.learning(0), "to be confirmed soon");
        a.observe(0, 6, 1, 6_200 + PROBE_MS);
        assert_eq!(limit_of(&a, 0).0, 6);
        assert!(!a.learning(0), "decided");
        // Queueing at its limit (another client's requests beside these)
        // changes nothing and is not read sooner.
        a.observe(0, 6, 3, 6_300 + PROBE_MS);
        assert!(!a.learning(0));
        // Raised again later, the engine runs the one more: kept.
        running.truncate(5);
        a.observe(0, 6, 0, 6_400 + PROBE_MS);
        running.push(now(a.admit(0, Class::Normal, t("t"), 1, 10)));
        let ticket = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        a.observe(0, 6, 0, 7_000 + 2 * PROBE_MS);
        assert_eq!(limit_of(&a, 0).0, 7);
        running.push(ticket.wait().now_or_never().expect("let in"));
        a.observe(0, 7, 0, 7_100 + 2 * PROBE_MS);
        assert_eq!(limit_of(&a, 0).0, 7);
        assert!(!a.learning(0), "kept");
        drop(running);
        // A reload that still learns keeps what was learned; a configured
        // limit is never touched by what the engine says.
        a.set_limit(0, Limit::Learn, Prefill::None);
        assert_eq!(limit_of(&a, 0), (7, LimitSource::Learned));
        a.set_limit(0, Limit::Fixed(8), Prefill::None);
        a.observe(0, 2, 5, 10_000_000);
        a.observe(0, 2, 5, 10_001_000);
        assert_eq!(limit_of(&a, 0), (8, LimitSource::Configured));
    }

    #[tokio::test]
    async fn a_prefill_budget_holds_requests_back_while_the_work_sent_is_over_it() {
        let budget = |budget| PrefillRoom {
            budget,
            ..Default::default()
        };
        use futures_util::FutureExt;
        let a = Admission::new(100);
        a.set_limit(0, Limit::Fixed(8), Prefill::None);
        // The first always goes, however large; the next waits while the
        // prefill sent and not answered is over the budget.
        let mut big = now(a.admit_within(0, Class::Normal, t("a"), 1, 5_000, budget(1_000)));
        let ticket = waits(a.admit_within(0, Class::Normal, t("b"), 1, 100, budget(1_000)));
        big.prefilled();
        let small = ticket
            .wait()
            .now_or_never()
            .expect("let in at the first byte");
        // Under the budget, more go side by side.
        let more = now(a.admit_within(0, Class::Normal, t("c"), 1, 100, budget(1_000)));
        // Without one (0), only the slots count.
        let free = now(a.admit_within(0, Class::Normal, t("d"), 1, 50_000, budget(0)));
        drop((big, small, more, free));
    }

    #[tokio::test]
    async fn retry_after_grows_with_the_queue_and_the_slot_hold_time() {
        let a = Admission::new(100);
        a.set_limit(0, Limit::Fixed(2), Prefill::None);
        // Before any request has finished, a slot is taken to be held 1 s.
        let p = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        let _q = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        assert_eq!(a.retry_after_s(0), 1);
        let waiting: Vec<Ticket> = (0..5)
            .map(|_| waits(a.admit(0, Class::Normal, t("t"), 1, 10)))
            .collect();
        // Six to get through two slots, a second each.
        assert_eq!(a.retry_after_s(0), 3);
        drop(waiting);
        drop(p);
        assert_eq!(a.retry_after_s(0), 1);
    }

    #[test]
    fn full_backends_are_marked_and_their_queues_count_as_load() {
        use crate::affinity::Candidate;
        let a = Admission::new(100);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        a.set_limit(1, Limit::Fixed(1), Prefill::None);
        let _p = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        let _w = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        let mut c = [
            Candidate {
                slot: 0,
                in_flight: 1,
                ..Default::default()
            },
            Candidate {
                slot: 1,
                ..Default::default()
            },
            Candidate {
                slot: 2,
                ..Default::default()
            },
        ];
        a.mark(&mut c, Class::Normal, t("t"), &[], None);
        assert!(c[0].full && !c[1].full && !c[2].full);
        assert_eq!(c[0].in_flight, 2);
    }

    #[test]
    fn no_backend_is_marked_full_while_a_limit_is_still_to_be_learned() {
        use crate::affinity::Candidate;
        let a = Admission::new(100);
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        a.set_limit(1, Limit::Learn, Prefill::None);
        let _p = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        let _w = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        let mut c = [0, 1].map(|slot| Candidate {
            slot,
            ..Default::default()
        });
        // Backend 1's room is not known yet: backend 0 being full is no
        // reason to send it every new conversation meanwhile.
        a.mark(&mut c, Class::Normal, t("t"), &[], None);
        assert!(!c[0].full && !c[1].full);
        a.set_limit(1, Limit::Fixed(4), Prefill::None);
        a.mark(&mut c, Class::Normal, t("t"), &[], None);
        assert!(c[0].full && !c[1].full);
    }

    #[test]
    fn a_request_counts_ahead_only_the_waiters_served_before_it() {
        use crate::affinity::Candidate;
        let a = Admission::new(100);
        let mut held = Vec::new();
        let mut queued = Vec::new();
        for b in 0..2 {
            a.set_limit(b, Limit::Fixed(1), Prefill::None);
            held.push(now(a.admit(b, Class::Normal, t("noisy"), 1, 1000)));
            for _ in 0..5 {
                queued.push(waits(a.admit(b, Class::Normal, t("noisy"), 1, 1000)));
            }
        }
        // The quiet tenant's first new conversation waits on backend 0.
        queued.push(waits(a.admit(0, Class::Normal, t("quiet"), 1, 1000)));
        let mut c = [0, 1].map(|slot| Candidate {
            slot,
            ..Default::default()
        });
        a.mark(&mut c, Class::Normal, t("quiet"), &[], None);
        // Its second waits behind its first on 0, behind nobody on 1.
        assert_eq!((c[0].ahead, c[1].ahead), (1, 0));
        a.mark(&mut c, Class::Normal, t("noisy"), &[], None);
        assert_eq!((c[0].ahead, c[1].ahead), (6, 5));
        a.mark(&mut c, Class::Interactive, t("noisy"), &[], None);
        assert_eq!((c[0].ahead, c[1].ahead), (0, 0));
    }

    #[tokio::test]
    async fn a_backend_prefills_at_most_its_max_prefilling_at_once() {
        use futures_util::FutureExt;
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(4), Prefill::Fixed(1));
        let mut first = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        // Three slots are free, but one request is prefilling: the next waits.
        let next = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        first.prefilled();
        let second = next
            .wait()
            .now_or_never()
            .expect("in once the first has prefilled");
        assert_eq!(a.depth(0), (0, 2));
        // Finishing before its first byte frees its prefill too.
        let third = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        drop(second);
        let _third = third
            .wait()
            .now_or_never()
            .expect("in once the second ended");
    }

    #[tokio::test]
    async fn prefills_are_capped_at_one_once_answers_show_they_queue_and_probed_again() {
        use futures_util::FutureExt;
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(4), Prefill::Learn);
        a.prefill_cost_known(0);
        // No gauges read, no evidence yet: prefills go side by side.
        let mut p1 = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        let p2 = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        assert_eq!(a.snapshot()[0].max_prefilling, 0);
        // The first vote starts from the trust a cap of one is given: one
        // answer that waited for the work ahead caps it.
        assert_eq!(a.vote_prefill(0, Some(true)), Some(true));
        let s = a.snapshot()[0];
        assert_eq!(
            (s.max_prefilling, s.prefill_source),
            (1, LimitSource::Learned)
        );
        drop(p2);
        let next = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        p1.prefilled();
        let mut p3 = next
            .wait()
            .now_or_never()
            .expect("in once the first prefilled");
        // A probe lets one more by as a second prefill, once.
        let held = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        a.observe(0, 2, 0, PREFILL_PROBE_MS + 1);
        let _probe = held
            .wait()
            .now_or_never()
            .expect("the probe goes as a second prefill");
        let after = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        a.observe(0, 3, 0, PREFILL_PROBE_MS + 2);
        p3.prefilled();
        let after = after.wait();
        tokio::pin!(after);
        assert!(
            (&mut after).now_or_never().is_none(),
            "one probe per period"
        );
        // Answers that ran beside the work ahead undo the cap.
        for _ in 0..VOTES_MAX {
            a.vote_prefill(0, Some(false));
        }
        assert_eq!(a.snapshot()[0].max_prefilling, 0);
        let _in = after
            .now_or_never()
            .expect("no cap once prefills run side by side");
    }

    #[tokio::test]
    async fn an_engine_whose_gauges_were_read_is_capped_until_a_probe_votes_otherwise() {
        use futures_util::FutureExt;
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(4), Prefill::Learn);
        a.observe(0, 0, 0, 1);
        assert_eq!(a.snapshot()[0].max_prefilling, 1, "taken on trust");
        let _first = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        let second = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        // No probe before an answer taught what one prefill costs...
        a.observe(0, 1, 0, 2);
        let second = second.wait();
        tokio::pin!(second);
        assert!((&mut second).now_or_never().is_none());
        // ...and one at once after.
        a.prefill_cost_known(0);
        let probe = second.now_or_never().expect("a probe goes at once");
        assert!(probe.probe);
        // It ran beside the first: no cap.
        assert_eq!(a.vote_prefill(0, Some(false)), Some(false));
        assert_eq!(a.snapshot()[0].max_prefilling, 0);
    }

    #[test]
    fn answers_that_waited_in_the_engines_own_queue_do_not_vote() {
        // A limit configured above the engine's batch: it queues requests
        // itself, and each one sent waits there whatever its prefill does.
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(16), Prefill::Learn);
        a.observe(0, 4, 12, 1);
        for _ in 0..VOTES_MAX {
            assert_eq!(a.vote_prefill(0, Some(true)), None);
        }
        assert_eq!(a.snapshot()[0].prefill_votes, 0, "none counted");
        // Its queue drained, answers vote again.
        a.observe(0, 4, 0, 2);
        a.vote_prefill(0, Some(false));
        assert_eq!(a.snapshot()[0].prefill_votes, SERIAL_VOTES - 1);
    }

    #[test]
    fn under_a_learned_cap_only_short_prefills_go_beside_one_another() {
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(8), Prefill::Learn);
        a.observe(0, 0, 0, 1);
        let room = PrefillRoom {
            slack: 200,
            ..Default::default()
        };
        let admit = |tokens| a.admit_within(0, Class::Normal, t("t"), 1, tokens, room);
        let _short = now(admit(50));
        let _beside = now(admit(100));
        // A long one would hold up whatever comes next: it waits.
        let _long = waits(admit(2_000));
    }

    #[test]
    fn unclear_probes_count_against_a_cap_only_three_in_a_row() {
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(4), Prefill::Learn);
        a.observe(0, 0, 0, 1);
        assert_eq!(a.vote_prefill(0, Some(true)), None);
        assert_eq!(a.vote_prefill(0, None), None);
        assert_eq!(a.vote_prefill(0, None), None);
        assert_eq!(a.vote_prefill(0, Some(true)), None);
        for _ in 0..2 {
            assert_eq!(a.vote_prefill(0, None), None);
        }
        assert_eq!(a.snapshot()[0].prefill_votes, 4);
        a.vote_prefill(0, None);
        assert_eq!(a.snapshot()[0].prefill_votes, 3);
    }

    #[test]
    fn a_configured_cap_or_admission_off_learns_none() {
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(4), Prefill::Fixed(3));
        a.set_limit(1, Limit::None, Prefill::Learn);
        for _ in 0..VOTES_MAX {
            a.vote_prefill(0, Some(true));
            a.vote_prefill(1, Some(true));
        }
        let s = a.snapshot();
        assert_eq!(
            (s[0].max_prefilling, s[0].prefill_source),
            (3, LimitSource::Configured)
        );
        assert_eq!(
            (s[1].max_prefilling, s[1].prefill_source),
            (0, LimitSource::None)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_that_does_not_stream_stops_counting_as_prefilling_by_the_clock() {
        use futures_util::FutureExt;
        let a = Admission::new(10);
        a.set_limit(0, Limit::Fixed(4), Prefill::Fixed(1));
        let mut json = now(a.admit(0, Class::Normal, t("t"), 1, 10));
        json.prefill_within(std::time::Duration::from_millis(50));
        let next = waits(a.admit(0, Class::Normal, t("t"), 1, 10));
        let next = next.wait();
        tokio::pin!(next);
        assert!((&mut next).now_or_never().is_none());
        tokio::time::sleep(std::time::Duration::from_millis(51)).await;
        let _second = next.await;
        // Its slot is still its own until it ends; dropping it then does
        // not count its prefill off twice.
        assert_eq!(a.depth(0), (0, 2));
        drop(json);
        let s = a.snapshot()[0];
        assert_eq!((s.running, a.state.lock().backends.0[0].prefilling), (1, 1));
    }
}
