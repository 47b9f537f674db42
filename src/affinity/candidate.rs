//! One backend a request may go to, as placement and the policy weigh it:
//! its load, queue and learned costs, and the cost maths both share.

use super::hrw::Scored;

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
    /// `prefix_tokens` is what the engine's own KV events say it holds of
    /// this session (`kv_events`), not an inference: 0 then means evicted.
    pub prefix_exact: bool,
    /// New keyless conversations there on probation: sessions no binding
    /// counts yet (`affinity.prefix.probation_seconds`).
    pub probation: u64,
    /// Its last requests failed, enough in a row to eject it, but the
    /// ejection cap keeps it in: sessions leave it for a backend that works.
    pub failing: bool,
    /// Admission: it runs its `max_in_flight` already (or has requests
    /// waiting for it); new conversations go to a backend with room.
    pub full: bool,
    /// Admission: the requests waiting there that would be served before
    /// this one (by class and fair share). With no room anywhere, a new
    /// conversation goes where the fewest are.
    pub ahead: u64,
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
