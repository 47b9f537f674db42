//! What admission knows of each backend's engine ([`Learned`]): how many
//! requests it runs at once and how many may prefill at once, as the
//! config sets them ([`Limit`], [`Prefill`]) or as they are learned — the
//! first from the engine's own gauges (slow start, then where the engine
//! starts to queue), the second from the answers' votes on whether the
//! engine's prefills queue behind each other, kept honest by probes.

/// Where a backend's limit comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LimitSource {
    /// None: every request goes straight on.
    #[default]
    None,
    /// `max_in_flight` in the config.
    Configured,
    /// Learned from the engine's own gauges (0 until it first queues).
    Learned,
}

impl LimitSource {
    pub fn as_str(self) -> &'static str {
        match self {
            LimitSource::None => "none",
            LimitSource::Configured => "configured",
            LimitSource::Learned => "learned",
        }
    }
}

/// A backend's cap on requests prefilling at once, as the config sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefill {
    /// No cap.
    None,
    Fixed(u32),
    /// One at a time where the answers show prefills queue behind each
    /// other, else none: see [`super::queue::Admission::vote_prefill`].
    Learn,
}

/// A backend's limit as the config sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// No limit (admission off).
    None,
    Fixed(u32),
    /// Learned from the engine's gauges: see
    /// [`super::queue::Admission::observe`].
    Learn,
}

/// Net votes at which prefills are taken to queue behind each other, and
/// the most they count up to either way (a change of engine undoes at most
/// that many).
pub const SERIAL_VOTES: i8 = 2;
pub const VOTES_MAX: i8 = 4;

/// How long a cap of one is kept on trust with no vote: an engine whose
/// answers never teach what one prefill costs (prompts under 64 uncached
/// tokens) or never wait behind enough work to tell is not capped for good.
pub(super) const TRUST_MS: u64 = 30_000;

/// Probes in a row that could not tell before they count as one vote
/// against a cap (see `Learned::unclear`).
pub(super) const UNCLEAR_PROBES: u8 = 3;

/// A learned cap of one lets one request by as a second prefill at most
/// this often, so that the engine keeps voting.
pub(super) const PREFILL_PROBE_MS: u64 = 10_000;

/// A learned limit is raised by one (to find room an engine gained) after
/// this long at the limit with requests waiting here and none inside it.
pub(super) const PROBE_MS: u64 = 30_000;

/// A learned limit starts here once the engine's gauges are first read.
pub(super) const SLOW_START: u32 = 4;

/// How soon a backend whose learned limit is being tried is scraped again
/// (at most; `load.interval_ms` if shorter): see [`Learned::learning`].
pub const LEARN_SCRAPE_MS: u64 = 100;

/// One backend's limits, configured or as learned so far.
#[derive(Default)]
pub(super) struct Learned {
    /// Requests it runs at once (0: no limit, or none learned yet).
    pub(super) limit: u32,
    /// Where `limit` comes from.
    pub(super) source: LimitSource,
    /// How many may be prefilling at once (0: no limit, or learned).
    pub(super) max_prefilling: u32,
    /// With no `max_prefilling`: one at a time once the engine's answers
    /// show its prefills queue behind each other.
    pub(super) learn_prefill: bool,
    /// The answers' votes: each sent behind others' prefill that waited
    /// for it +1, each that ran beside it -1, within ±[`VOTES_MAX`]. Before
    /// the first, once the engine's gauges were read, prefills are taken to
    /// queue (a GPU's prefill is compute-bound; a burst sent before any
    /// answer came back would all queue inside the engine), and probes come
    /// at every scrape until an answer votes.
    pub(super) prefill_votes: i8,
    voted: bool,
    /// The engine's gauges were read (the scraper runs for it) and no
    /// vote came within [`TRUST_MS`] of the first reading: until then the
    /// cap is one on trust.
    trusted: bool,
    /// When the gauges were first read (process clock, ms; 0: never).
    gauged_ms: u64,
    /// An answer taught what one prefill costs there: only a probe sent
    /// since then can vote.
    cost_known: bool,
    /// The learned cap is one: one request may still start as a second
    /// prefill, whose answer votes again (an engine that stopped queueing
    /// prefills shows it). Set at most every [`PREFILL_PROBE_MS`].
    prefill_probe: bool,
    /// When the last probe was allowed (process clock, ms).
    probed_ms: u64,
    /// A probe started and has not ended: no other is allowed until it has
    /// (and voted, if it could).
    probe_out: bool,
    /// The engine's last scrape found requests waiting in its own queue
    /// (for a place in its batch, not for prefill): an answer's wait then
    /// says nothing of how its prefills share, and does not vote.
    engine_queues: bool,
    /// Probes in a row sent behind too little work to tell: at
    /// [`UNCLEAR_PROBES`], a vote that prefills run side by side (whatever
    /// they do, ones this short gain little from a cap).
    unclear: u8,
    /// Learning: the engine's running count at the last scrape that found
    /// requests waiting inside it (0: the last scrape found none).
    queued_at: u32,
    /// When the learned limit last changed (process clock, ms).
    changed_ms: u64,
    /// Learning, the engine not seen queueing yet: the limit doubles.
    slow_start: bool,
    /// One request over the limit is being tried (in slow start, an engine
    /// that runs it has room to double into).
    probing: bool,
    /// What the engine completes, against which a limit its gauges lowered
    /// is kept or undone.
    check: super::check::Check,
}

/// What this gateway (or its fleet) runs at a backend and keeps waiting
/// for it, as the learning of its limit reads them.
pub(super) struct Here {
    pub(super) running: u32,
    pub(super) waiting: bool,
    pub(super) fleet: Fleet,
}

/// Whose requests [`Here`] counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fleet {
    /// This gateway's, the only one sending to the engine through a gateway.
    Alone,
    /// This gateway's, one of a fleet whose queue cannot be reached: its
    /// limit is its share of the engine's batch.
    Share,
    /// The fleet's (its one queue, in the store): the limit is the engine's.
    Queue,
}

impl Learned {
    /// The config's `limit` and `prefill`. A limit being learned keeps
    /// what was learned; the prefill votes are kept.
    pub(super) fn configure(&mut self, limit: Limit, prefill: Prefill) {
        match limit {
            Limit::None => (self.limit, self.source) = (0, LimitSource::None),
            Limit::Fixed(n) => (self.limit, self.source) = (n, LimitSource::Configured),
            Limit::Learn if self.source == LimitSource::Learned => {}
            Limit::Learn => {
                (self.limit, self.source, self.queued_at) = (0, LimitSource::Learned, 0);
            }
        }
        (self.max_prefilling, self.learn_prefill) = match prefill {
            _ if limit == Limit::None => (0, false),
            Prefill::None => (0, false),
            Prefill::Fixed(n) => (n, false),
            Prefill::Learn => (0, true),
        };
    }

    /// The cap on requests prefilling at once in force (0: none):
    /// configured, or learned (one, and a probe's second).
    pub(super) fn max_prefilling(&self) -> u32 {
        match self.max_prefilling {
            0 if self.prefills_queue() => 1 + self.prefill_probe as u32,
            n => n,
        }
    }

    /// The cap on prefills the fleet's queue applies (0: none):
    /// configured, or learned (one; it lets no probe by).
    pub(super) fn fleet_cap(&self) -> u32 {
        match self.max_prefilling {
            0 if self.prefills_queue() => 1,
            n => n,
        }
    }

    /// An answer voted on the cap on prefills.
    pub(super) fn voted(&self) -> bool {
        self.voted
    }

    /// The cap on prefills is learned (none is configured).
    pub(super) fn prefill_learned(&self) -> bool {
        self.learn_prefill && self.max_prefilling == 0
    }

    /// Where the cap on prefills comes from.
    pub(super) fn prefill_source(&self) -> LimitSource {
        match (self.max_prefilling, self.learn_prefill) {
            (0, true) => LimitSource::Learned,
            (0, false) => LimitSource::None,
            _ => LimitSource::Configured,
        }
    }

    /// Learning, and the engine's answers show its prefills queue (or,
    /// none having voted yet, its gauges were read).
    fn prefills_queue(&self) -> bool {
        self.learn_prefill
            && match self.voted {
                true => self.prefill_votes >= SERIAL_VOTES,
                false => self.trusted,
            }
    }

    /// Allow a probe now if one is due (the cap of one learned or trusted,
    /// the cost known, none out, the last `period` ms ago or more):
    /// whether it was (room changed).
    fn arm_probe(&mut self, now_ms: u64, period: u64) -> bool {
        let due = self.cost_known
            && !self.prefill_probe
            && !self.probe_out
            && now_ms >= self.probed_ms + period;
        if due && self.prefills_queue() {
            (self.prefill_probe, self.probed_ms) = (true, now_ms);
            return true;
        }
        false
    }

    /// The next request to start, with `prefilling` already prefilling,
    /// goes as the probe.
    pub(super) fn next_is_probe(&self, prefilling: u32) -> bool {
        self.prefill_probe && self.prefills_queue() && prefilling >= 1
    }

    /// A probe started.
    pub(super) fn probe_started(&mut self) {
        (self.prefill_probe, self.probe_out) = (false, true);
    }

    /// A request ended (`probe`: the probe; `ran`: it held its slot, from
    /// the learned limit's window `era`, not one handed to it and passed on
    /// unused).
    pub(super) fn ended(&mut self, probe: bool, ran: Option<u32>) {
        self.probe_out &= !probe;
        if let Some(era) = ran {
            self.check.completed(era);
        }
    }

    /// The learned limit's window a request starting now starts in.
    pub(super) fn era(&self) -> u32 {
        self.check.era()
    }

    /// The first answer taught what one prefill costs: until then no probe
    /// could vote. One that has had no vote yet is probed at once (not at
    /// its next scrape: a burst of requests is waiting behind the cap it
    /// was given on trust). Whether room changed.
    pub(super) fn cost_learned(&mut self, now_ms: u64) -> bool {
        self.cost_known = true;
        !self.voted && self.arm_probe(now_ms, 0)
    }

    /// What an answer's vote ([`super::queue::Admission::vote_prefill`])
    /// counts as (`true`: prefills queued), when it counts: none while the
    /// engine queues requests itself; [`UNCLEAR_PROBES`] unclear ones in a
    /// row count as one that prefills ran side by side.
    pub(super) fn counts_as(&mut self, vote: Option<bool>) -> Option<bool> {
        if self.engine_queues {
            return None;
        }
        match vote {
            Some(v) => {
                self.unclear = 0;
                Some(v)
            }
            None => {
                self.unclear += 1;
                if self.unclear < UNCLEAR_PROBES {
                    return None;
                }
                self.unclear = 0;
                Some(false)
            }
        }
    }

    /// Count a vote on this gateway's own tally: the cap's state before
    /// and after.
    pub(super) fn count(&mut self, queued: bool) -> (bool, bool) {
        let before = self.prefills_queue();
        if !self.voted {
            (self.voted, self.prefill_votes) = (true, SERIAL_VOTES);
        }
        self.prefill_votes = match queued {
            true => (self.prefill_votes + 1).min(VOTES_MAX),
            false => (self.prefill_votes - 1).max(-VOTES_MAX),
        };
        (before, self.prefills_queue())
    }

    /// The fleet's tally of votes at this engine (every gateway's, counted
    /// as one gateway counts its own), which this gateway's cap follows:
    /// the cap's state before and after.
    pub(super) fn fleet_tally(&mut self, tally: i8) -> (bool, bool) {
        let before = self.prefills_queue();
        self.voted = true;
        self.prefill_votes = tally.clamp(-VOTES_MAX, VOTES_MAX);
        (before, self.prefills_queue())
    }

    /// The engine's gauges were read at `now_ms`, `waiting` requests in its
    /// own queue: trust and probes for the cap on prefills. Whether room
    /// changed.
    pub(super) fn gauged(&mut self, waiting: u64, now_ms: u64) -> bool {
        if self.gauged_ms == 0 {
            self.gauged_ms = now_ms.max(1);
        }
        self.engine_queues = waiting > 0;
        let trusting = now_ms < self.gauged_ms + TRUST_MS;
        let trust_changed = std::mem::replace(&mut self.trusted, trusting) != trusting;
        let period = if self.voted { PREFILL_PROBE_MS } else { 0 };
        self.arm_probe(now_ms, period) || trust_changed
    }

    /// The engine reported `running` requests and `waiting` ones in its own
    /// queue at `now_ms`, this gateway running and keeping what `here` says:
    /// the learned limit follows (see
    /// [`super::queue::Admission::observe`]). Whether it was raised.
    pub(super) fn limit_gauged(
        &mut self,
        running: u64,
        waiting: u64,
        now_ms: u64,
        here: Here,
    ) -> bool {
        if self.source != LimitSource::Learned {
            return false;
        }
        let before = self.limit;
        let raised = self.checked(here.running >= self.limit && here.waiting, now_ms)
            || self.gauge_step(running, waiting, now_ms, here);
        if self.limit != before {
            self.check.limit_set(self.limit, now_ms);
        }
        raised
    }

    /// The check against what the engine completes, at a reading
    /// (`bound`: the limit holds requests back now): whether it raised the
    /// limit. A lowering it undoes restarts slow start (the limit was set
    /// by gauges that were wrong).
    fn checked(&mut self, bound: bool, now_ms: u64) -> bool {
        use super::check::Verdict;
        let limit = match self.check.scraped(self.limit, bound, now_ms) {
            Verdict::None => return false,
            Verdict::Undo(limit) => {
                (self.slow_start, self.probing, self.queued_at) = (true, false, 0);
                limit
            }
            Verdict::Try(limit) | Verdict::Confirm(limit) => limit,
        };
        let raised = limit > self.limit;
        (self.limit, self.changed_ms) = (limit, now_ms);
        raised
    }

    /// What the gauges teach at a reading (see [`Learned::limit_gauged`]).
    fn gauge_step(&mut self, running: u64, waiting: u64, now_ms: u64, here: Here) -> bool {
        // Whose requests wait inside the engine. Alone, only this gateway's
        // own count: the engine runs fewer than it has there. Requests it
        // runs all of wait for nobody here; another client's queue (or a
        // gauge that reports one whatever runs) is not made shorter by
        // holding this gateway's back, and an honest engine with room would
        // be slowed for nothing. In a fleet, the other gateways' requests
        // count too (below: this one's share).
        let ours_queue = waiting > 0
            && running > 0
            && (here.fleet == Fleet::Share || here.running as u64 > running)
            && !self.check.gauges_held(now_ms);
        if ours_queue {
            // What the engine runs, of which this gateway's share: in a
            // fleet, whose other gateways send to the engine too, what this
            // one may run is its part of the batch, in proportion to what it
            // has there, so that together they fill it and queue nothing
            // inside it. (Alone, other clients' requests beside its own are
            // not its to make room for: it keeps the engine's count.)
            let holds = running + waiting;
            let mine = match here.running as u64 {
                r if here.fleet == Fleet::Share && r > 0 && r < holds => {
                    (running * r / holds).max(1)
                }
                _ => running,
            };
            let running = mine.min(u32::MAX as u64) as u32;
            // In slow start the gateway has just sent more than before and
            // is at its limit: one scrape is evidence enough, and each one
            // waited for leaves more requests queued inside the engine.
            if self.queued_at > 0 || (self.slow_start && here.running >= self.limit) {
                let seen = self.queued_at.max(running);
                if self.limit == 0 || seen < self.limit {
                    // (In a fleet what this gateway completes is part of
                    // what the engine does: sharing, it falls by design.)
                    if here.fleet == Fleet::Alone {
                        self.check.lowered(self.limit, seen, now_ms);
                    }
                    self.limit = seen;
                }
                self.changed_ms = now_ms;
                (self.slow_start, self.probing) = (false, false);
            }
            self.queued_at = running;
            return false;
        }
        let running = running.min(u32::MAX as u64) as u32;
        self.queued_at = 0;
        if self.limit == 0 {
            (self.limit, self.slow_start, self.changed_ms) = (SLOW_START, true, now_ms);
            return false;
        }
        let reached = here.running >= self.limit && here.waiting;
        if reached
            && self.slow_start
            && self.probing
            && running < self.limit
            && running * 2 >= here.running
            && now_ms < self.changed_ms + 1_000
        {
            // The one over is not running inside the engine yet (on its way,
            // or not scheduled): no evidence either way, for a second at
            // most (an engine whose gauge never shows it is read as before).
            // A gauge that counts fewer than half of what this gateway has
            // there, with nothing waiting, does not count its requests at
            // all (it reads 0, say, whatever runs): the one over cannot be
            // seen there, and the engine's empty queue is the evidence.
            return false;
        }
        if reached && self.slow_start {
            // One more first: an engine that runs it too has room, and the
            // limit doubles; one that queues it is at its limit (above)
            // with one request waiting inside it, not a doubling's worth,
            // ahead of whatever this gateway would send first.
            self.limit = match self.probing {
                true => (self.limit - 1).saturating_mul(2),
                false => self.limit + 1,
            };
            self.probing = !self.probing;
        } else if reached && now_ms >= self.changed_ms + PROBE_MS {
            (self.limit, self.probing) = (self.limit + 1, true);
        } else {
            // Past slow start, a raised limit the engine ran without
            // queueing is kept (or, not reached again, was never tried).
            if !self.slow_start {
                self.probing = false;
            }
            return false;
        }
        self.changed_ms = now_ms;
        true
    }

    /// Whether the learned limit is being tried, this gateway running
    /// `running` there (`waiters`: and keeping requests waiting for it):
    /// raised by one to see whether the engine runs the request, in slow
    /// start held at the limit (the next step is due), or a scrape found
    /// the engine queueing below the limit and the next one is to confirm
    /// it (an engine that queues at the limit, other clients' requests
    /// beside this gateway's, changes nothing and is not read sooner).
    /// Until the next scrape, a request the engine
    /// cannot run yet waits inside it, ahead of whatever this gateway would
    /// send first: the scraper reads such a backend again sooner
    /// ([`LEARN_SCRAPE_MS`]).
    pub(super) fn learning(&self, running: u32, waiters: bool) -> bool {
        self.source == LimitSource::Learned
            && ((self.probing && running >= self.limit)
                || ((self.slow_start || self.check.pending()) && waiters && running >= self.limit)
                || (self.queued_at > 0 && self.queued_at < self.limit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a fleet a limit lowered to this gateway's share of the batch is
    /// not checked against what this gateway completes (that falls by
    /// design; the other gateways' rises, unseen); alone, a lowering by
    /// more than a step is.
    #[test]
    fn only_a_lone_gateways_lowering_is_checked_against_completions() {
        for fleet in [Fleet::Share, Fleet::Queue, Fleet::Alone] {
            let mut l = Learned::default();
            l.configure(Limit::Learn, Prefill::None);
            let here = |running| Here {
                running,
                waiting: true,
                fleet,
            };
            l.limit_gauged(0, 0, 1_000, here(0));
            assert_eq!(l.limit, SLOW_START);
            // This gateway's (or fleet's) 4 there; the engine runs 1 and queues 8.
            l.limit_gauged(1, 8, 1_100, here(4));
            assert_eq!(l.limit, 1);
            let alone = fleet == Fleet::Alone;
            assert_eq!(l.check.pending(), alone, "fleet: {fleet:?}");
        }
    }
}
