//! One backend as admission holds it: its requests running and
//! prefilling, its limits (configured or learned), and the requests waiting
//! for a slot there, in order ([`super::queue`] keeps one for every backend
//! of the gateway, under one lock).

use super::class::Class;
use super::fair::Fair;
use super::fleet::{Held, Seen};
use super::learn::Learned;
use std::collections::BTreeMap;
use std::sync::Arc;
use tokio::sync::oneshot;

/// Where a waiting request stands in its backend's queue.
pub(super) type Place = (Class, u64, u64);

pub(super) struct Waiter {
    /// Sent how it starts.
    pub(super) wake: oneshot::Sender<Start>,
    /// Its virtual start tag.
    pub(super) start: u64,
    /// Its estimated prefill, tokens.
    pub(super) tokens: u64,
    /// Its answer is known not to stream.
    pub(super) json: bool,
}

#[derive(Default)]
pub(super) struct Backend {
    pub(super) running: u32,
    /// Of `running`, those whose first byte has not come back (prefilling,
    /// or queued for it inside the engine).
    pub(super) prefilling: u32,
    /// The estimated prefill tokens of those prefilling.
    pub(super) prefill_tokens: u64,
    /// Its limits, configured or learned.
    pub(super) learned: Learned,
    pub(super) waiting: BTreeMap<Place, Waiter>,
    /// Fair share among the tenants of its requests.
    pub(super) fair: Fair,
    /// How long its requests have held a slot, ms (a moving average; 0:
    /// none has finished yet).
    pub(super) hold_ms: f64,
    /// Prefill tokens that may be sent here and not yet answered, beyond
    /// one request (0: no limit): `admission.prefill_queue_ms` at this
    /// backend's learned cost, as of the last request admitted.
    pub(super) prefill_budget: u64,
    /// Under a learned cap of one, prefill tokens that may be prefilling
    /// beyond it all the same: what waits behind less than
    /// [`crate::upstream::cost::VOTE_MIN_AHEAD`] of work loses nothing to
    /// the engine's order (short prompts are not held back), as of the
    /// last request admitted.
    pub(super) prefill_slack: u64,
    /// Its id, once a request asked the fleet's queue for it.
    pub(super) fleet_id: Option<Arc<str>>,
    /// The fleet's counts here, as the store's last answer left them.
    pub(super) fleet_seen: Option<Seen>,
    /// Of `running` and `prefilling`, what is held from the fleet's queue.
    pub(super) fleet_held: Held,
}

/// How a request starts at its backend.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Start {
    /// Let by as a second prefill under a learned cap of one (its answer
    /// votes even when the work ahead of it was too little to tell).
    pub(super) probe: bool,
    /// It counts as prefilling until its first byte.
    pub(super) counted: bool,
    /// A cap is in force that it could hold others back from: an answer
    /// that does not stream needs its prefill clock
    /// ([`super::queue::Permit::prefill_within`]).
    pub(super) clock: bool,
    /// Under a learned cap, its prefill is shorter than the slack.
    pub(super) short: bool,
    /// The learned limit's window it started in ([`super::check`]): only
    /// a request that ran wholly under a limit tells what the engine
    /// completes at it.
    pub(super) era: u32,
}

/// A backend's room for prefills as of a request ([`super::queue::Admission::admit_within`]),
/// in tokens at its learned cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillRoom {
    /// `admission.prefill_queue_ms`: prefill that may be sent and not
    /// answered beyond one request (0: no limit).
    pub budget: u64,
    /// Under a learned cap of one, prefill that may be prefilling beyond it.
    pub slack: u64,
    /// The request's answer is known not to stream.
    pub json: bool,
}

/// Waiters counted ahead of a request at most ([`super::queue::Admission::mark`]).
pub(super) const AHEAD_COUNTED: usize = 1024;

/// The weight of the newest slot-hold time in the moving average.
pub(super) const HOLD_ALPHA: f64 = 0.1;
/// What a slot is taken to be held for before any request has finished.
pub(super) const HOLD_PRIOR_MS: f64 = 1_000.0;

impl Backend {
    /// Whether one more request, of `tokens` prefill, may start here now.
    /// Under a learned cap of one, a short one may go beside what is
    /// prefilling while the two together stay within the slack (a long one
    /// let in beside a short one would hold up whatever comes next).
    pub(super) fn has_room(&self, tokens: u64) -> bool {
        let l = &self.learned;
        let cap = l.max_prefilling();
        let learned = l.max_prefilling == 0;
        let prefill_room = cap == 0
            || self.prefilling < cap
            || (learned && self.prefill_tokens + tokens < self.prefill_slack);
        (l.limit == 0 || self.running < l.limit)
            && prefill_room
            && (self.prefill_budget == 0
                || self.prefilling == 0
                || self.prefill_tokens < self.prefill_budget)
    }

    /// How a request of `tokens` would start now (`json`: its answer is
    /// known not to stream). Under a learned cap, an answer that does not
    /// stream and whose prefill is shorter than the slack does not count as
    /// prefilling at all: nothing is worth holding back behind it, nor a
    /// clock to count it off by (a stream counts until its first token, so
    /// that what was let in after it does not overtake it in the engine).
    pub(super) fn next_start(&self, tokens: u64, json: bool) -> Start {
        let short = self.learned.prefill_learned() && tokens < self.prefill_slack;
        let counted = !(json && short);
        Start {
            era: self.learned.era(),
            probe: counted && self.learned.next_is_probe(self.prefilling),
            counted,
            clock: counted && (self.learned.max_prefilling() > 0 || self.prefill_budget > 0),
            short,
        }
    }

    pub(super) fn start(&mut self, tokens: u64, s: Start) {
        if s.probe {
            self.learned.probe_started();
        }
        self.running += 1;
        if s.counted {
            self.prefilling += 1;
            self.prefill_tokens += tokens;
        }
    }

    /// One request of `tokens` is no longer prefilling.
    pub(super) fn prefill_over(&mut self, tokens: u64) {
        self.prefilling = self.prefilling.saturating_sub(1);
        self.prefill_tokens = self.prefill_tokens.saturating_sub(tokens);
    }
}

/// Backends by slot (`upstream::Slots`: small, dense, process-wide).
#[derive(Default)]
pub(super) struct Backends(pub(super) Vec<Backend>);

impl Backends {
    pub(super) fn get(&self, slot: &u32) -> Option<&Backend> {
        self.0.get(*slot as usize)
    }
    pub(super) fn get_mut(&mut self, slot: &u32) -> Option<&mut Backend> {
        self.0.get_mut(*slot as usize)
    }
    pub(super) fn entry(&mut self, slot: u32) -> &mut Backend {
        let i = slot as usize;
        if i >= self.0.len() {
            self.0.resize_with(i + 1, Backend::default);
        }
        &mut self.0[i]
    }
}

#[derive(Default)]
pub(super) struct State {
    pub(super) backends: Backends,
    pub(super) seq: u64,
    pub(super) queued: usize,
}

/// Give the room `backend` has to its best waiters still there (one whose
/// ticket is gone meanwhile is skipped). Its virtual time moves to each
/// taker's start tag.
pub(super) fn fill(st: &mut State, backend: u32) {
    loop {
        let Some(b) = st.backends.get_mut(&backend) else {
            return;
        };
        match b.waiting.first_key_value() {
            Some((_, w)) if b.has_room(w.tokens) => {}
            _ => return,
        }
        let Some((_, w)) = b.waiting.pop_first() else {
            return;
        };
        st.queued -= 1;
        let s = b.next_start(w.tokens, w.json);
        if w.wake.send(s).is_ok() {
            b.start(w.tokens, s);
            b.fair.admitted(w.start);
        }
    }
}
