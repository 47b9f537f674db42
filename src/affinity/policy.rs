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
//!   best other candidate: the prefill work queued there now (the estimated
//!   uncached tokens of this gateway's requests that have not begun to
//!   answer, less what the head of the queue has prefilled since it began)
//!   and the turn's new tokens, at each one's learned cost per token (so a
//!   backend that has slowed down counts, not only one that queues; one that
//!   has not learned its cost yet is assumed as fast as the fastest learned,
//!   or the prior if faster).
//!   The queue is read as it stands, not learned from answers: those report
//!   the queue as it was when they were sent, so a policy reading them sees
//!   a slowdown late and its relief late, and moves too late and then too
//!   many. T_saved is the session's last prompt re-prefilled at that
//!   candidate's learned cost per token; p_hit is the share of what the
//!   bound backend should have held on the last turn (the turn before's
//!   prompt) that it actually had cached: 1 after the session's first turn
//!   there, which it has just computed, and low for a backend that evicted
//!   the session (it no longer deserves it). Off a backend that is busy,
//!   not slow (under [`SLOWER`] times the other's cost per token), the move
//!   is charged the fleet's share of what it recomputes too: twice the
//!   recompute (the prompts its tokens evict, computed again later), for
//!   each request running at the other backend plus one, since each
//!   computation stalls them. A queue costs this turn alone and drains; a
//!   slow backend costs every later turn: off one, a move needs only a third
//!   of the margin ([`SLOW_MARGIN`]). A move goes to that best
//!   candidate. A cooldown and a cap on moves per session keep it from
//!   flapping, and moves off one backend are [`MOVE_GAP_MS`] apart, so
//!   requests reviewed on one snapshot of the queues do not all leave at once.
//! - `in_flight`: move off a backend with at least `soft_max_in_flight`
//!   requests in flight when another candidate has room.

use super::candidate::Candidate;
use super::table::Turns;

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

/// What this turn brings, as a policy weighs it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ThisTurn {
    /// The uncached tokens it brings to the bound backend, by the
    /// session's turns there ([`Turns::next_uncached`]).
    pub new: u64,
    /// Its whole prompt, when the prefix index has said how much of it each
    /// candidate holds ([`Candidate::prefix_tokens`]): each one's uncached
    /// share is then the prompt less that.
    pub indexed_prompt: Option<u64>,
}

impl ThisTurn {
    /// The uncached tokens the turn would bring to `c`.
    pub fn new_at(&self, c: &Candidate) -> u64 {
        match self.indexed_prompt {
            Some(p) => p.saturating_sub(c.prefix_tokens),
            None => self.new,
        }
    }
}

/// The soft-mode hook: given the bound backend, every candidate, and what the
/// session's turns found there, keep (`None`) or move, and why; and where a
/// move goes.
pub trait BindingPolicy: Send + Sync {
    fn review(
        &self,
        bound: &Candidate,
        candidates: &[Candidate],
        turns: &Turns,
        turn: &ThisTurn,
        now_ms: u64,
    ) -> Option<MoveReason>;

    /// Where a move for `reason` goes. `None`: first placement chooses
    /// among the other candidates.
    fn destination(
        &self,
        reason: MoveReason,
        bound: &Candidate,
        candidates: &[Candidate],
        turns: &Turns,
        turn: &ThisTurn,
    ) -> Option<u32> {
        let _ = (reason, bound, candidates, turns, turn);
        None
    }
}

/// Moves for cost off one backend are at least this far apart, ms: requests
/// reviewed at the same moment read the same queues (a move shows in them
/// once its request is sent), and must not all leave together.
pub const MOVE_GAP_MS: u64 = 25;

/// The cost-aware policy's knobs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostParams {
    /// Prefill µs per uncached token assumed until a backend has taught its own.
    pub prior_prefill_us_per_token: f64,
    /// ΔQ must beat p_hit · T_saved by this much, µs. 150 ms by default: a
    /// move spends the session's cache to spare one turn a wait, and on the
    /// chat trace the moves that spared 50–150 ms (two fifths of them) were
    /// turns in a loaded queue's ordinary spread, not its tail (which waits
    /// behind prompts several times longer): they cost hit and bought no p99.
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
            hysteresis_us: 150_000,
            cooldown_ms: 30_000,
            max_moves: 3,
        }
    }
}

/// A bound backend this many times slower per token than the best other is
/// slow, not busy: every later turn of the session pays it again, so a move
/// off it is not charged the fleet's share of its recompute (a queue costs
/// this turn alone; learned costs of equal backends differ by up to ~1.7×
/// on a busy host).
pub const SLOWER: f64 = 2.0;

/// Off a slow backend ([`SLOWER`]) a move needs this share of the margin:
/// the margin keeps one turn from moving for a queue's ordinary spread, but
/// off a slow backend every later turn would wait again, and the slowness
/// is learned from many answers, not read from one snapshot of the queues
/// (with the whole margin, soft mode's gain with a replica slowed 3× fell
/// from 1.52–1.56× hard's throughput to 1.39–1.50×).
pub const SLOW_MARGIN: f64 = 1.0 / 3.0;

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

    fn unlearned_cost(&self, candidates: &[Candidate]) -> f64 {
        super::candidate::unlearned_cost(candidates, self.cost.prior_prefill_us_per_token)
    }

    /// How long until a turn bringing `new` tokens gets its first token at
    /// `c`: the prefill work still queued there (less what its head has
    /// done), then its own, at the backend's cost per token (a slower
    /// backend is worse for both).
    fn wait_us(c: &Candidate, new: f64, unlearned: f64) -> f64 {
        c.wait_us(unlearned) + c.cost_or(unlearned) * new
    }

    /// The candidate other than `bound` where the turn would start soonest.
    fn soonest_other<'a>(
        bound: &Candidate,
        candidates: &'a [Candidate],
        turn: &ThisTurn,
        unlearned: f64,
    ) -> Option<&'a Candidate> {
        let wait = |c: &Candidate| Self::wait_us(c, turn.new_at(c) as f64, unlearned);
        candidates
            .iter()
            .filter(|c| c.slot != bound.slot && !c.draining)
            .min_by(|a, b| wait(a).total_cmp(&wait(b)))
    }

    fn cost_move(
        &self,
        bound: &Candidate,
        candidates: &[Candidate],
        turns: &Turns,
        turn: &ThisTurn,
        now_ms: u64,
    ) -> bool {
        let p = &self.cost;
        if turns.moves >= p.max_moves {
            return false;
        }
        if turns.moves > 0 && now_ms.saturating_sub(turns.moved_s as u64 * 1000) < p.cooldown_ms {
            return false;
        }
        let unlearned = self.unlearned_cost(candidates);
        let Some(best) = Self::soonest_other(bound, candidates, turn, unlearned) else {
            return false;
        };
        let at = |c: &Candidate| Self::wait_us(c, turn.new_at(c) as f64, unlearned);
        let delta_q = at(bound) - at(best);
        // With the index, each side already counts the prefill its own cache
        // leaves (what the bound backend still holds of *this* prompt, not
        // what its last turn found: a backend that evicted once and then
        // recomputed the whole prompt holds it again). Without it, ΔQ is
        // weighed against p_hit · T_saved, p_hit from the last turn.
        let saved = match turn.indexed_prompt {
            Some(_) => 0.0,
            None => turns.retention() * turns.prompt as f64 * best.cost_or(unlearned),
        };
        // A move off a busy backend (not a slow one, [`SLOWER`]) is charged
        // what its recompute at `best` costs the fleet beyond this turn,
        // whose own share is in ΔQ (or is `saved`): the prompts it evicts
        // there when caches are full are computed again later, and each
        // computation stalls (decoding) or delays (queued) every request
        // running there. So twice the recompute, times one more than the
        // requests in flight there: to an idle backend, its evictions alone.
        let recompute = match turn.indexed_prompt {
            Some(_) => {
                turn.new_at(best).saturating_sub(turn.new_at(bound)) as f64
                    * best.cost_or(unlearned)
            }
            None => saved,
        };
        let slow = bound.cost_or(unlearned) > SLOWER * best.cost_or(unlearned);
        let shared_by = match slow {
            true => 0.0,
            false => 2.0 * (1.0 + best.in_flight as f64),
        };
        let margin = match slow {
            true => p.hysteresis_us as f64 * SLOW_MARGIN,
            false => p.hysteresis_us as f64,
        };
        delta_q > saved + shared_by * recompute + margin
    }
}

impl BindingPolicy for DefaultPolicy {
    fn review(
        &self,
        bound: &Candidate,
        candidates: &[Candidate],
        turns: &Turns,
        turn: &ThisTurn,
        now_ms: u64,
    ) -> Option<MoveReason> {
        // A session its draining backend's engine says it evicted loses
        // nothing by moving now, whatever the mode.
        let evicted = bound.prefix_exact && bound.prefix_tokens == 0;
        if bound.draining && (bound.move_on_drain || self.mode == Mode::Soft || evicted) {
            return Some(MoveReason::Drain);
        }
        if self.mode != Mode::Soft {
            return None;
        }
        match self.soft {
            SoftPolicy::Cost => self
                .cost_move(bound, candidates, turns, turn, now_ms)
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

    /// A cost move goes where the policy found the turn starts soonest: the
    /// backend its ΔQ was weighed against, not the one first placement would
    /// pick by bindings (which after sessions left it is the slow one).
    fn destination(
        &self,
        reason: MoveReason,
        bound: &Candidate,
        candidates: &[Candidate],
        _turns: &Turns,
        turn: &ThisTurn,
    ) -> Option<u32> {
        match reason {
            MoveReason::Cost => {
                Self::soonest_other(bound, candidates, turn, self.unlearned_cost(candidates))
                    .map(|c| c.slot)
            }
            MoveReason::Drain | MoveReason::Overloaded => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Turns = Turns {
        prompt: 0,
        cached: 0,
        expected: 0,
        moves: 0,
        moved_s: 0,
    };

    /// `p`'s review of a session bound to `all[0]` whose turn brings as many
    /// new tokens as its last one did.
    fn review(p: &DefaultPolicy, all: &[Candidate], t: &Turns, now_ms: u64) -> Option<MoveReason> {
        let turn = ThisTurn {
            new: t.next_uncached(0),
            indexed_prompt: None,
        };
        p.review(&all[0], all, t, &turn, now_ms)
    }

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
        assert_eq!(review(&p, &all, &T0, 0), None);
        let mut asked = all;
        asked[0].move_on_drain = true;
        assert_eq!(review(&p, &asked, &T0, 0), Some(MoveReason::Drain));
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
        assert_eq!(review(&p, &all, &T0, 0), Some(MoveReason::Overloaded));
        let full = [c(0, 4, false), c(1, 4, false)];
        assert_eq!(review(&p, &full, &T0, 0), None, "nowhere better to go");
        let drain = [c(0, 0, true), c(1, 0, false)];
        assert_eq!(review(&p, &drain, &T0, 0), Some(MoveReason::Drain));
    }

    fn queued(slot: u32, queued_tokens: u64, prefill_us_per_token: f64) -> Candidate {
        Candidate {
            queued_tokens,
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

    /// Soft mode's cost policy with the shipped knobs.
    fn soft_default() -> DefaultPolicy {
        DefaultPolicy {
            mode: Mode::Soft,
            soft: SoftPolicy::Cost,
            soft_max_in_flight: 0,
            cost: CostParams::default(),
        }
    }

    /// A session whose last turn sent `prompt` tokens and found `cached` of
    /// them, of the `expected` its backend should have kept from the turn before.
    fn turns(prompt: u32, cached: u32, expected: u32, moves: u8, moved_s: u32) -> Turns {
        Turns {
            prompt,
            cached,
            expected,
            moves,
            moved_s,
        }
    }

    #[test]
    fn cost_policy_moves_only_when_the_queue_outweighs_the_cache_by_hand() {
        // At 200 µs a token, the bound backend has 2,500 ms of prefill
        // queued (12,500 tokens), the other 100 ms: ΔQ = 2,400 ms.
        let mut all = [queued(0, 12_500, 200.0), queued(1, 500, 200.0)];
        // 3,000 tokens, all it should have kept cached: T_saved = 3,000 ×
        // 200 µs = 600 ms, and the fleet pays it twice more at the idle
        // backend (the prompts it evicts): 1,800 ms + 50 ms hysteresis <
        // 2,400 ms: move.
        assert_eq!(
            review(&COST, &all, &turns(3000, 2900, 2900, 0, 0), 0),
            Some(MoveReason::Cost)
        );
        // 4,000 tokens: 2,400 ms + 50 ms > 2,400 ms: stay.
        assert_eq!(review(&COST, &all, &turns(4000, 3900, 3900, 0, 0), 0), None);
        // The backend evicted the session: of the 4,000 tokens it should
        // have kept it had 1,000 (p_hit 0.25): 3 × 1,000 ms × 0.25 + 50 <
        // 2,400: move.
        assert_eq!(
            review(&COST, &all, &turns(5000, 1000, 4000, 0, 0), 0),
            Some(MoveReason::Cost)
        );
        // The other backend runs 2 requests: the 3,000-token recompute
        // would stall both too, (1 + 2 × 3) × 600 ms > 2,400 ms: stay.
        all[1].in_flight = 2;
        assert_eq!(review(&COST, &all, &turns(3000, 2900, 2900, 0, 0), 0), None);
        all[1].in_flight = 0;
        // Equal queues never move; hard mode never moves for cost.
        let even = [queued(0, 2_500, 200.0), queued(1, 2_500, 200.0)];
        assert_eq!(review(&COST, &even, &turns(10, 0, 0, 0, 0), 0), None);
        let hard = DefaultPolicy {
            mode: Mode::Hard,
            ..COST
        };
        assert_eq!(review(&hard, &all, &turns(0, 0, 0, 0, 0), 0), None);
    }

    #[test]
    fn cost_policy_trusts_a_backend_with_the_prompt_it_has_just_computed() {
        // After a session's first turn there (nothing cached, nothing to keep
        // from before) the backend holds the whole 4,000-token prompt: moving
        // re-prefills it (800 ms + 50) for a 300 ms shorter queue: stay.
        let all = [queued(0, 2_000, 200.0), queued(1, 500, 200.0)];
        assert_eq!(review(&COST, &all, &turns(4000, 0, 0, 0, 0), 0), None);
        // Had it dropped the prompt by the next turn, moving would pay.
        assert_eq!(
            review(&COST, &all, &turns(4300, 0, 4000, 0, 0), 0),
            Some(MoveReason::Cost)
        );
    }

    #[test]
    fn with_the_index_a_backend_that_recomputed_an_evicted_prompt_keeps_it() {
        // The last turn found 1,000 of the 4,000 tokens it should have kept:
        // by that turn's share the backend "evicted" the session, and a
        // 300 ms shorter queue elsewhere moved it (the thrash seen on real
        // traces). But that turn computed the whole prompt again: the index
        // says backend 0 holds 4,000 of this 4,300-token prompt, backend 1
        // none. Staying: 5,000 queued + 300 new = 1,060 ms; moving: 500 +
        // 4,300 = 960 ms; ΔQ 100 ms, far below the fleet's twice 4,000
        // tokens recomputed (1,600 ms). Stay.
        let mut all = [queued(0, 5_000, 200.0), queued(1, 500, 200.0)];
        let t = turns(4300, 1000, 4000, 0, 0);
        assert_eq!(review(&COST, &all, &t, 0), Some(MoveReason::Cost));
        all[0].prefix_tokens = 4_000;
        let indexed = ThisTurn {
            new: t.next_uncached(0),
            indexed_prompt: Some(4_300),
        };
        assert_eq!(COST.review(&all[0], &all, &t, &indexed, 0), None);
        // Had it dropped the prompt since (the index holds nothing there
        // now either), each side pays the whole prefill: the shorter queue wins.
        all[0].prefix_tokens = 0;
        assert_eq!(
            COST.review(&all[0], &all, &t, &indexed, 0),
            Some(MoveReason::Cost)
        );
        // And a prefix the other backend holds counts for the move: with
        // even queues, backend 1 holding the prompt (backend 0 not) moves.
        let mut even = [queued(0, 500, 200.0), queued(1, 500, 200.0)];
        even[1].prefix_tokens = 4_000;
        assert_eq!(
            COST.review(&even[0], &even, &t, &indexed, 0),
            Some(MoveReason::Cost)
        );
        assert_eq!(
            COST.destination(MoveReason::Cost, &even[0], &even, &t, &indexed),
            Some(1)
        );
    }

    #[test]
    fn with_the_index_a_move_pays_for_what_the_fleet_recomputes() {
        // Backend 0 holds 4,000 of this 4,300-token prompt behind 10,000
        // queued tokens (200 µs a token: 2,060 ms to its first token);
        // backend 1, idle, holds none (860 ms): ΔQ 1,200 ms. The 4,000
        // tokens it recomputes (800 ms, in ΔQ) evict as many of others' at
        // backend 1, computed again later: 1,600 + 50 > 1,200: stay.
        let t = turns(4000, 3900, 3900, 0, 0);
        let indexed = ThisTurn {
            new: 300,
            indexed_prompt: Some(4_300),
        };
        let mut all = [queued(0, 10_000, 200.0), queued(1, 0, 200.0)];
        all[0].prefix_tokens = 4_000;
        assert_eq!(COST.review(&all[0], &all, &t, &indexed, 0), None);
        // 20,000 queued (ΔQ 3,200 ms): move.
        all[0].queued_tokens = 20_000;
        assert_eq!(
            COST.review(&all[0], &all, &t, &indexed, 0),
            Some(MoveReason::Cost)
        );
        // Backend 1 runs one request, which each recompute stalls too:
        // 2 × 2 × 800 + 50 > 3,200: stay.
        all[1].in_flight = 1;
        assert_eq!(COST.review(&all[0], &all, &t, &indexed, 0), None);
    }

    #[test]
    fn by_default_a_move_saves_its_turn_more_than_a_queues_ordinary_spread() {
        // The chat trace's moves, at 4 µs a token with the default margin:
        // a 5,000-token turn whose backend holds 2,000 of it, an idle other
        // backend holding none. Behind 30,000 queued tokens (120 ms) staying
        // is 112 ms later than moving (132 against 20 ms) for 2,000 tokens
        // recomputed (8 ms, twice): under 150 ms, a queue's ordinary spread,
        // it stays (with a 50 ms margin it moved: two fifths of soft mode's
        // moves on that trace spared 50–150 ms).
        let soft = soft_default();
        let t = turns(3000, 2900, 2900, 0, 0);
        let turn = ThisTurn {
            new: 3_000,
            indexed_prompt: Some(5_000),
        };
        let mut all = [queued(0, 30_000, 4.0), queued(1, 0, 4.0)];
        all[0].prefix_tokens = 2_000;
        assert_eq!(soft.review(&all[0], &all, &t, &turn, 0), None);
        // Behind 50,000 (a long prompt prefilling there): 192 ms saved, move.
        all[0].queued_tokens = 50_000;
        assert_eq!(
            soft.review(&all[0], &all, &t, &turn, 0),
            Some(MoveReason::Cost)
        );
        // A session its backend no longer holds costs no recompute to move,
        // and still moves only for more than the margin.
        all[0].prefix_tokens = 0;
        all[0].queued_tokens = 35_000;
        assert_eq!(soft.review(&all[0], &all, &t, &turn, 0), None);
        all[0].queued_tokens = 40_000;
        assert_eq!(
            soft.review(&all[0], &all, &t, &turn, 0),
            Some(MoveReason::Cost)
        );
    }

    #[test]
    fn cost_policy_counts_a_slower_backend_not_only_a_longer_queue() {
        // No queue anywhere, but the bound backend now takes 300 µs a token
        // against 100. The turn brings 1,000 new tokens (1,500 prompt, 500
        // cached last time, all it should have kept): 300 ms there against
        // 100 ms: ΔQ = 200 ms. Re-prefilling 1,500 tokens elsewhere costs
        // 150 ms: + a third of the default 150 ms margin (off a slow
        // backend) is not less than 200 ms: stay.
        let soft = soft_default();
        let all = [queued(0, 0, 300.0), queued(1, 0, 100.0)];
        assert_eq!(review(&soft, &all, &turns(1500, 500, 500, 0, 0), 0), None);
        // 1,400 new tokens of 1,900 (ΔQ 280 ms; re-prefill 190 ms + 50): move,
        // where a queue the same 280 ms longer would need 190 + 150 ms.
        assert_eq!(
            review(&soft, &all, &turns(1900, 500, 500, 0, 0), 0),
            Some(MoveReason::Cost)
        );
    }

    #[test]
    fn cost_policy_respects_cooldown_and_the_move_cap() {
        let all = [queued(0, 4_500, 200.0), queued(1, 0, 200.0)];
        let t = turns(100, 100, 100, 1, 100);
        assert_eq!(review(&COST, &all, &t, 110_000), None, "10 s after a move");
        assert_eq!(review(&COST, &all, &t, 131_000), Some(MoveReason::Cost));
        assert_eq!(
            review(&COST, &all, &turns(100, 100, 100, 3, 0), 10_000_000),
            None,
            "cap"
        );
    }

    #[test]
    fn cost_policy_uses_the_prior_until_a_backend_has_taught_its_cost() {
        // Unlearned costs (0): the 100 µs prior, so 20,000 and 1,000 queued
        // tokens are 2,000 and 100 ms; 5,000 tokens → 3 × 500 ms + 50 < 1,900.
        let all = [queued(0, 20_000, 0.0), queued(1, 1_000, 0.0)];
        assert_eq!(
            review(&COST, &all, &turns(5000, 4900, 4900, 0, 0), 0),
            Some(MoveReason::Cost)
        );
    }

    #[test]
    fn a_backend_that_has_not_taught_its_cost_is_assumed_as_fast_as_the_best_known() {
        // The bound backend has not learned its cost; the other has, 50 µs a
        // token. 15,000 tokens queued at the bound one, none at the other, a
        // 5,000-token session that brings 300 new: at the 100 µs prior the
        // bound queue would read 1,530 ms against 15, ΔQ 1,515 ms > 3 × 250
        // + 50. Assumed as fast as the other (50 µs): 765 ms against 15, ΔQ
        // 750 ms < 800: stay.
        let all = [queued(0, 15_000, 0.0), queued(1, 0, 50.0)];
        assert_eq!(review(&COST, &all, &turns(5000, 4700, 4700, 0, 0), 0), None);
        // The only backend that has learned is the bound one, which slowed
        // to 1,000 µs a token: the other is not assumed as slow, but at the
        // faster prior (100 µs). 500 new tokens: 500 ms there against 50 ms,
        // ΔQ 450 ms > re-prefilling 1,000 tokens (100 ms) + 50: move.
        let slowed = [queued(0, 0, 1000.0), queued(1, 0, 0.0)];
        assert_eq!(
            review(&COST, &slowed, &turns(1000, 500, 500, 0, 0), 0),
            Some(MoveReason::Cost)
        );
        // With nothing learned anywhere the prior applies to both alike:
        // 430 ms against 30, ΔQ 400 ms < 3 × 500 + 50: stay; four times the
        // queue (ΔQ 1,600 ms) moves.
        let unknown = [queued(0, 4_000, 0.0), queued(1, 0, 0.0)];
        assert_eq!(
            review(&COST, &unknown, &turns(5000, 4700, 4700, 0, 0), 0),
            None
        );
        let longer = [queued(0, 16_000, 0.0), queued(1, 0, 0.0)];
        assert_eq!(
            review(&COST, &longer, &turns(5000, 4700, 4700, 0, 0), 0),
            Some(MoveReason::Cost)
        );
    }

    #[test]
    fn a_queue_whose_head_has_been_prefilling_is_a_shorter_wait() {
        // 15,000 tokens queued at 100 µs a token: 1,500 ms, against none
        // elsewhere; a 3,000-token session (3 × 300 ms + 50 for its
        // re-prefill and the prompts it evicts): move.
        let fresh = [queued(0, 15_000, 100.0), queued(1, 0, 100.0)];
        let t = turns(3000, 2900, 2900, 0, 0);
        assert_eq!(review(&COST, &fresh, &t, 0), Some(MoveReason::Cost));
        // The head has been prefilling for 600 ms: 6,000 of those tokens are
        // done, 900 ms are left: stay.
        let mut started = fresh;
        started[0].head_ms = 600;
        assert_eq!(review(&COST, &started, &t, 0), None);
    }

    #[test]
    fn a_head_far_past_its_estimate_shows_a_backend_that_stalled_before_it_answers() {
        // Both backends learned 100 µs a token. At the bound one a 1,000-token
        // head (100 ms expected) and 1,000 tokens behind it; nothing elsewhere.
        // A 3,000-token session: staying costs the queue, moving 300 + 50 ms.
        let mut q = [queued(0, 2_000, 100.0), queued(1, 0, 100.0)];
        q[0].head_tokens = 1_000;
        let t = turns(3000, 2900, 2900, 0, 0);
        // 90 ms in, on time: 10 ms of the head and 100 behind it: stay.
        q[0].head_ms = 90;
        assert_eq!(review(&COST, &q, &t, 0), None);
        // 800 ms in: late, but not past 4 × the whole queue + 50 ms (850 ms).
        // The head is taken as done, 100 ms behind it: stay. (Read at the
        // learned cost alone, its progress would eat the queue behind it.)
        q[0].head_ms = 800;
        assert_eq!(q[0].cost_or(100.0), 100.0);
        assert_eq!(review(&COST, &q, &t, 0), None);
        // 1 s in: overdue, the backend shows 1,000 µs a token. The head is
        // expected 900 ms late again, and 1,000 tokens at 1,000 µs follow:
        // 1.9 s against 350 ms: move, before any slow answer taught the cost.
        q[0].head_ms = 1_000;
        assert_eq!(q[0].cost_or(100.0), 1_000.0);
        assert_eq!(q[0].wait_us(100.0), 900_000.0 + 1_000_000.0);
        assert_eq!(review(&COST, &q, &t, 0), Some(MoveReason::Cost));
        // A head too small to tell (fixed overheads) is never overdue.
        let mut small = q;
        small[0].head_tokens = 50;
        assert_eq!(small[0].cost_or(100.0), 100.0);
    }
}
