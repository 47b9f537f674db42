//! Whether a live binding is kept or moved: the hook soft mode consults.
//!
//! Hard mode keeps a binding while its backend is a candidate (and not
//! drained with "move sessions"). Soft mode treats the binding as a
//! preference: [`BindingPolicy::review`] may move it. Both soft policies move
//! a session off a draining backend. Beyond that:
//!
//! - `cost` (the default soft policy, seed 001's rule): leave the bound
//!   backend only when the extra delay from staying, ΔQ, exceeds what
//!   staying saves, p_hit · T_saved, by a hysteresis margin. ΔQ is how much
//!   later this turn's first token comes at the bound backend than at the
//!   best other candidate: learned queueing delay plus the turn's new tokens
//!   at each one's learned cost per token (so a backend that has slowed down
//!   counts, not only one that queues); T_saved is the session's last prompt
//!   re-prefilled at that candidate's learned cost per token; p_hit is the
//!   share of its last prompt the bound backend actually had cached (a
//!   backend that evicted the session no longer deserves it). A cooldown and a cap on moves per session keep it from
//!   flapping, and moves off one backend are spaced by its queue estimate so
//!   its sessions do not all leave on the same stale reading.
//! - `in_flight`: move off a backend with at least `soft_max_in_flight`
//!   requests in flight when another candidate has room.

use super::table::Turns;
use super::Candidate;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Hard,
    Soft,
}

/// Which soft policy (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SoftPolicy {
    Cost,
    InFlight,
}

/// Why a live binding was moved (`agentserve_affinity_moves_total{reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveReason {
    Drain,
    Overloaded,
    Cost,
}

impl MoveReason {
    pub fn as_str(self) -> &'static str {
        match self {
            MoveReason::Drain => "drain",
            MoveReason::Overloaded => "overloaded",
            MoveReason::Cost => "cost",
        }
    }
}

/// The soft-mode hook: given the bound backend, every candidate, and what the
/// session's turns found there, keep (`None`) or move, and why. The
/// destination is then chosen by first placement among the other candidates.
pub trait BindingPolicy: Send + Sync {
    fn review(
        &self,
        bound: &Candidate,
        candidates: &[Candidate],
        turns: &Turns,
        now_ms: u64,
    ) -> Option<MoveReason>;
}

/// The cost-aware policy's knobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostParams {
    /// Prefill µs per uncached token assumed until a backend has taught its own.
    pub prior_prefill_us_per_token: f64,
    /// ΔQ must beat p_hit · T_saved by this much, µs.
    pub hysteresis_us: u64,
    /// No second move within this long of the last one, ms.
    pub cooldown_ms: u64,
    /// No session moves more often than this.
    pub max_moves: u8,
}

impl Default for CostParams {
    fn default() -> Self {
        CostParams {
            prior_prefill_us_per_token: 100.0,
            hysteresis_us: 50_000,
            cooldown_ms: 30_000,
            max_moves: 3,
        }
    }
}

/// The default policy, in either mode.
#[derive(Clone, Copy, Debug)]
pub struct DefaultPolicy {
    pub mode: Mode,
    pub soft: SoftPolicy,
    /// `in_flight` policy: 0 = no limit.
    pub soft_max_in_flight: u64,
    pub cost: CostParams,
}

impl DefaultPolicy {
    pub fn hard() -> Self {
        DefaultPolicy {
            mode: Mode::Hard,
            soft: SoftPolicy::Cost,
            soft_max_in_flight: 0,
            cost: CostParams::default(),
        }
    }

    /// How long after one session moved off `bound` for cost the next may:
    /// its queue estimate (the time a move takes to show there), between
    /// 100 ms and 2 s.
    pub fn move_spacing_ms(&self, bound: &Candidate) -> u64 {
        (bound.queue_us / 1000).clamp(100, 2000)
    }

    fn cost_move(
        &self,
        bound: &Candidate,
        candidates: &[Candidate],
        turns: &Turns,
        now_ms: u64,
    ) -> bool {
        let p = &self.cost;
        if turns.moves >= p.max_moves {
            return false;
        }
        if turns.moves > 0 && now_ms.saturating_sub(turns.moved_s as u64 * 1000) < p.cooldown_ms {
            return false;
        }
        // The work this turn brings whichever backend serves it: the new
        // tokens, as many as the last turn's uncached ones.
        let new = turns.prompt.saturating_sub(turns.cached) as f64;
        let per_token = |c: &Candidate| {
            if c.prefill_us_per_token > 0.0 {
                c.prefill_us_per_token
            } else {
                p.prior_prefill_us_per_token
            }
        };
        // How long until this turn's first token: the backend's queue plus
        // its prefill of the new tokens (a slower backend is worse for it too).
        let wait = |c: &Candidate| c.queue_us as f64 + per_token(c) * new;
        let Some(best) = candidates
            .iter()
            .filter(|c| c.slot != bound.slot && !c.draining)
            .min_by(|a, b| wait(a).total_cmp(&wait(b)))
        else {
            return false;
        };
        let delta_q = wait(bound) - wait(best);
        let p_hit = if turns.prompt == 0 {
            0.0
        } else {
            turns.cached as f64 / turns.prompt as f64
        };
        let t_saved = turns.prompt as f64 * per_token(best);
        delta_q > p_hit * t_saved + p.hysteresis_us as f64
    }
}

impl BindingPolicy for DefaultPolicy {
    fn review(
        &self,
        bound: &Candidate,
        candidates: &[Candidate],
        turns: &Turns,
        now_ms: u64,
    ) -> Option<MoveReason> {
        if bound.draining && (bound.move_on_drain || self.mode == Mode::Soft) {
            return Some(MoveReason::Drain);
        }
        if self.mode != Mode::Soft {
            return None;
        }
        match self.soft {
            SoftPolicy::Cost => self
                .cost_move(bound, candidates, turns, now_ms)
                .then_some(MoveReason::Cost),
            SoftPolicy::InFlight if self.soft_max_in_flight > 0 => {
                let limit = self.soft_max_in_flight;
                let has_room = candidates
                    .iter()
                    .any(|c| c.slot != bound.slot && !c.draining && c.in_flight < limit);
                (bound.in_flight >= limit && has_room).then_some(MoveReason::Overloaded)
            }
            SoftPolicy::InFlight => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Turns = Turns {
        prompt: 0,
        cached: 0,
        moves: 0,
        moved_s: 0,
    };

    fn c(slot: u32, in_flight: u64, draining: bool) -> Candidate {
        Candidate {
            slot,
            seed: slot as u64,
            weight: 1,
            in_flight,
            engine_requests: 0,
            draining,
            move_on_drain: false,
            ..Default::default()
        }
    }

    #[test]
    fn hard_mode_keeps_through_load_and_plain_drain() {
        let p = DefaultPolicy {
            mode: Mode::Hard,
            soft: SoftPolicy::InFlight,
            soft_max_in_flight: 1,
            cost: CostParams::default(),
        };
        let all = [c(0, 50, true), c(1, 0, false)];
        assert_eq!(p.review(&all[0], &all, &T0, 0), None);
        let mut asked = all;
        asked[0].move_on_drain = true;
        assert_eq!(p.review(&asked[0], &asked, &T0, 0), Some(MoveReason::Drain));
    }

    #[test]
    fn soft_mode_moves_off_draining_or_overloaded_backends_only_when_there_is_room() {
        let p = DefaultPolicy {
            mode: Mode::Soft,
            soft: SoftPolicy::InFlight,
            soft_max_in_flight: 4,
            cost: CostParams::default(),
        };
        let all = [c(0, 4, false), c(1, 3, false)];
        assert_eq!(
            p.review(&all[0], &all, &T0, 0),
            Some(MoveReason::Overloaded)
        );
        let full = [c(0, 4, false), c(1, 4, false)];
        assert_eq!(
            p.review(&full[0], &full, &T0, 0),
            None,
            "nowhere better to go"
        );
        let drain = [c(0, 0, true), c(1, 0, false)];
        assert_eq!(p.review(&drain[0], &drain, &T0, 0), Some(MoveReason::Drain));
    }

    fn queued(slot: u32, queue_us: u64, prefill_us_per_token: f64) -> Candidate {
        Candidate {
            queue_us,
            prefill_us_per_token,
            ..c(slot, 0, false)
        }
    }

    const COST: DefaultPolicy = DefaultPolicy {
        mode: Mode::Soft,
        soft: SoftPolicy::Cost,
        soft_max_in_flight: 0,
        cost: CostParams {
            prior_prefill_us_per_token: 100.0,
            hysteresis_us: 50_000,
            cooldown_ms: 30_000,
            max_moves: 3,
        },
    };

    fn turns(prompt: u32, cached: u32, moves: u8, moved_s: u32) -> Turns {
        Turns {
            prompt,
            cached,
            moves,
            moved_s,
        }
    }

    #[test]
    fn cost_policy_moves_only_when_the_queue_outweighs_the_cache_by_hand() {
        // Bound backend queues 900 ms, the other 100 ms: ΔQ = 800 ms.
        let all = [queued(0, 900_000, 200.0), queued(1, 100_000, 200.0)];
        // 3,000 tokens, all cached: T_saved = 3,000 × 200 µs = 600 ms; + 50 ms
        // hysteresis = 650 ms < 800 ms: move.
        assert_eq!(
            COST.review(&all[0], &all, &turns(3000, 3000, 0, 0), 0),
            Some(MoveReason::Cost)
        );
        // 4,000 tokens cached: 800 ms + 50 ms > 800 ms: stay.
        assert_eq!(
            COST.review(&all[0], &all, &turns(4000, 4000, 0, 0), 0),
            None
        );
        // The backend evicted the session (p_hit 0.25): 1,000 ms × 0.25 + 50 < 800: move.
        assert_eq!(
            COST.review(&all[0], &all, &turns(5000, 1250, 0, 0), 0),
            Some(MoveReason::Cost)
        );
        // Equal queues never move; hard mode never moves for cost.
        let even = [queued(0, 500_000, 200.0), queued(1, 500_000, 200.0)];
        assert_eq!(COST.review(&even[0], &even, &turns(10, 0, 0, 0), 0), None);
        let hard = DefaultPolicy {
            mode: Mode::Hard,
            ..COST
        };
        assert_eq!(hard.review(&all[0], &all, &turns(0, 0, 0, 0), 0), None);
    }

    #[test]
    fn cost_policy_counts_a_slower_backend_not_only_a_longer_queue() {
        // No queue anywhere, but the bound backend now takes 300 µs a token
        // against 100. The turn brings 1,000 new tokens (1,500 prompt, 500
        // cached last time): 300 ms there against 100 ms: ΔQ = 200 ms.
        // Staying saves 500 cached × 100 µs = 50 ms, + 50 ms hysteresis: move.
        let all = [queued(0, 0, 300.0), queued(1, 0, 100.0)];
        assert_eq!(
            COST.review(&all[0], &all, &turns(1500, 500, 0, 0), 0),
            Some(MoveReason::Cost)
        );
        // With 2,000 of its tokens cached there, staying saves 200 ms + 50: stay.
        assert_eq!(
            COST.review(&all[0], &all, &turns(3000, 2000, 0, 0), 0),
            None
        );
    }

    #[test]
    fn cost_policy_respects_cooldown_and_the_move_cap() {
        let all = [queued(0, 900_000, 200.0), queued(1, 0, 200.0)];
        let t = turns(100, 100, 1, 100);
        assert_eq!(
            COST.review(&all[0], &all, &t, 110_000),
            None,
            "10 s after a move"
        );
        assert_eq!(
            COST.review(&all[0], &all, &t, 131_000),
            Some(MoveReason::Cost)
        );
        assert_eq!(
            COST.review(&all[0], &all, &turns(100, 100, 3, 0), 10_000_000),
            None,
            "cap"
        );
    }

    #[test]
    fn cost_policy_uses_the_prior_until_a_backend_has_taught_its_cost() {
        // Unlearned destination (0): the 100 µs prior; 5,000 tokens → 500 ms + 50 < 600.
        let all = [queued(0, 700_000, 0.0), queued(1, 100_000, 0.0)];
        assert_eq!(
            COST.review(&all[0], &all, &turns(5000, 5000, 0, 0), 0),
            Some(MoveReason::Cost)
        );
    }
}
