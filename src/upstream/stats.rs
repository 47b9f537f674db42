//! A backend's live state, which outlives any one configuration
//! ([`BackendStats`]), and a request counted against it while it is in
//! flight ([`InFlight`]): its in-flight total, and its place in the
//! backend's queued prefill work (what the cost model learns the backend's
//! speed from).

use super::{cost, load, outlier};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Reuses of a backend's pooled connections peeked at before the backend
/// counts as one that keeps its keep-alive promise (`proxy/upstream_conn.rs`).
pub const REUSES_ON_PROBATION: u32 = 1000;

/// Live, per-backend state that outlives any one config snapshot.
#[derive(Debug)]
pub struct BackendStats {
    pub id: String,
    pub in_flight: AtomicU64,
    /// Set by the admin API or config: no new bindings go here.
    pub draining: AtomicBool,
    /// With `draining`: the backend's sessions move on their next turn.
    pub move_on_drain: AtomicBool,
    /// False for a backend added by a reload until a health check passes.
    pub admitted: AtomicBool,
    /// Until then (ms on the gateway's clock), requests to this backend ask
    /// for a fresh connection: it closed a reused one under a request.
    pub fresh_connections_until_ms: AtomicU64,
    /// Reuses of its pooled connections still peeked at before use, and
    /// whether it has closed one under the gateway (then all are, for good):
    /// see `proxy/upstream_conn.rs`.
    pub reuse_probation: AtomicU32,
    pub closes_pooled: AtomicBool,
    /// What the engine last reported about its own load (see load.rs).
    pub engine: load::EngineLoad,
    /// Prefill cost and queueing learned from its responses.
    pub cost: cost::CostEstimate,
    /// Passive health: ejected after consecutive failed requests.
    pub outlier: outlier::OutlierState,
    /// Whether it still answers at all: see [`super::stall`].
    pub progress: super::stall::Progress,
    /// What its engine's KV-cache events say it holds (`kv_events`).
    pub kv: Arc<crate::kv::view::KvView>,
}

impl BackendStats {
    pub fn new(id: &str) -> BackendStats {
        BackendStats {
            id: id.to_string(),
            in_flight: AtomicU64::new(0),
            draining: AtomicBool::new(false),
            move_on_drain: AtomicBool::new(false),
            admitted: AtomicBool::new(true),
            fresh_connections_until_ms: AtomicU64::new(0),
            reuse_probation: AtomicU32::new(REUSES_ON_PROBATION),
            closes_pooled: AtomicBool::new(false),
            engine: Default::default(),
            cost: Default::default(),
            outlier: Default::default(),
            progress: Default::default(),
            kv: Default::default(),
        }
    }
}

/// Counts a request against its backend's in-flight total until dropped.
pub struct InFlight {
    stats: Arc<BackendStats>,
    /// No other request of this gateway was in flight at the backend when
    /// this one was sent: its TTFB is the backend's speed, not its queue.
    alone: bool,
    /// Its place in the backend's queued prefill work, where its estimated
    /// tokens count until its first byte comes back (ticket 0 once it has),
    /// and the queued tokens it was sent behind.
    queued: super::cost::Enqueued,
    /// The backend answered it out of the order it was sent in (it overtook
    /// a request sent before it, or one sent after overtook it): its time to
    /// first byte explains neither its own prefill nor the queue's.
    out_of_order: bool,
    /// The share of its prompt it was expected to find uncached there.
    pub uncached_share: f64,
    /// When it was sent on (after any wait for a slot): its time to first
    /// byte, as the backend's speed explains it, starts here.
    pub sent: Instant,
    /// Its estimated uncached tokens.
    pub tokens: u64,
    /// Sent, no first byte back yet (counted in [`BackendStats::progress`]).
    awaiting: bool,
    /// Its upstream socket, held while it waits for its first byte so that
    /// an ejection as hung can end it ([`super::stall`]).
    held: Option<super::stall::Held>,
}

impl InFlight {
    /// `tokens` of the `prompt` tokens (estimates) are expected uncached.
    pub fn new(stats: &Arc<BackendStats>, tokens: u64, prompt: u64) -> Self {
        Self::behind(stats, tokens, prompt, Default::default())
    }

    /// Sent behind prefill there that this gateway did not send (the
    /// fleet's other gateways', as its queue said).
    pub fn behind(
        stats: &Arc<BackendStats>,
        tokens: u64,
        prompt: u64,
        elsewhere: crate::admission::fleet::Ahead,
    ) -> Self {
        let before = stats.in_flight.fetch_add(1, Ordering::Relaxed);
        stats.progress.sent(crate::clock::now_ms());
        let queued = stats.cost.enqueue(tokens);
        let none_elsewhere = elsewhere.tokens == 0;
        InFlight {
            stats: Arc::clone(stats),
            alone: before == 0 && stats.engine.requests_if_fresh() == 0 && none_elsewhere,
            queued: stats
                .cost
                .behind_elsewhere(queued, elsewhere.tokens, elsewhere.ms),
            out_of_order: false,
            uncached_share: match prompt {
                0 => 1.0,
                p => (tokens as f64 / p as f64).min(1.0),
            },
            sent: Instant::now(),
            tokens,
            awaiting: true,
            held: None,
        }
    }

    /// Its connection is `fd`, from `local`: noted until its first byte,
    /// so that an ejection of its backend as hung ends it.
    pub fn hold_socket(&mut self, fd: std::os::fd::RawFd, local: std::net::SocketAddr) {
        self.let_go();
        if self.awaiting {
            self.held = Some(self.stats.progress.hold(fd, local));
        }
    }

    /// Whether its backend was ejected as hung while it waited there for
    /// its first byte, its connection cut (asked once: the answer is
    /// taken).
    pub fn cut_as_hung(&mut self) -> bool {
        self.held
            .take()
            .is_some_and(|h| !self.stats.progress.release(h))
    }

    fn let_go(&mut self) {
        if let Some(h) = self.held.take() {
            self.stats.progress.release(h);
        }
    }

    /// The first byte came back: its prefill no longer waits ahead of others.
    pub fn prefilled(&mut self) {
        self.let_go();
        if std::mem::take(&mut self.awaiting) {
            let now_ms = crate::clock::now_ms();
            let took_ms = self.sent.elapsed().as_millis() as u64;
            self.stats.progress.answered(now_ms, took_ms);
        }
        let ticket = std::mem::take(&mut self.queued.ticket);
        if ticket != 0 {
            self.out_of_order = !self.stats.cost.dequeue(ticket);
        }
    }

    /// The prefill work it was sent behind, if any and known, in whatever
    /// order it was answered: what [`Admission::vote_prefill`] asks of it.
    ///
    /// [`Admission::vote_prefill`]: crate::admission::Admission::vote_prefill
    pub fn sent_behind(&self) -> Option<std::time::Duration> {
        let ns = self.queued.work_ahead_ns;
        (self.queued.behind && ns > 0).then_some(std::time::Duration::from_nanos(ns))
    }

    /// Sent with no other prefill queued, and answered in order: its time to
    /// first byte is its own prefill's.
    pub fn on_its_own(&self) -> bool {
        !self.queued.behind && !self.out_of_order
    }

    /// What its answer may teach about the backend's speed, as
    /// [`super::cost::CostEstimate::observe`] takes it: whether it
    /// was served alone, and the queue it was served behind.
    pub fn explains(&self) -> (bool, Option<u64>) {
        match self.out_of_order {
            true => (false, None),
            false => (self.alone, self.queued.behind()),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.let_go();
        // Still queued: it ended without a first byte.
        if self.awaiting {
            self.stats.progress.abandoned();
        }
        self.stats
            .cost
            .abandon(std::mem::take(&mut self.queued.ticket));
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_that_overtook_a_long_prefill_teaches_no_cost() {
        let stats = Arc::new(BackendStats::new("b"));
        // A 7,000-token prefill is sent alone, a 300-token prompt behind it;
        // the engine answers the short one first (it reached the engine
        // first, or was batched ahead).
        let mut long = InFlight::new(&stats, 7_000, 7_000);
        let mut short = InFlight::new(&stats, 300, 300);
        assert_eq!(long.explains(), (true, None));
        assert_eq!(short.explains(), (false, Some(7_000)));
        short.prefilled();
        long.prefilled();
        // Its 30 ms would read as 30 ms for 7,300 tokens (4 µs a token)
        // were it taken as served behind the long one; neither is taken.
        assert_eq!(short.explains(), (false, None));
        assert_eq!(long.explains(), (false, None));
        drop((long, short));
        // Served in order, each explains what it was sent behind.
        let mut first = InFlight::new(&stats, 1_000, 1_000);
        let mut second = InFlight::new(&stats, 1_000, 1_000);
        first.prefilled();
        second.prefilled();
        assert_eq!(first.explains(), (true, None));
        assert_eq!(second.explains(), (false, Some(1_000)));
    }
}
