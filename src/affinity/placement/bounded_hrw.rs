//! Rendezvous hashing with bounded loads: walk the session's HRW order and
//! take the first backend whose load, with this session added, stays within
//! `balance_factor` × its weighted share of the tier's load (Mirrokni et al.,
//! "Consistent Hashing with Bounded Loads"; the bound includes the new
//! session, so some backend always qualifies).
//!
//! A backend's share counts its weight and, with `placement.speed_aware`, its
//! learned speed: one that prefills well slower than the fastest takes
//! proportionally fewer sessions (see [`SAME_SPEED`]).
//!
//! With `placement.queue_aware`, among the backends within the bound the one
//! where a request would wait least for the prefill work queued there wins
//! ([`Candidate::wait_us`]: the estimated uncached tokens of this gateway's
//! requests there without a first byte, at the backend's cost per token,
//! less what the head of the queue has prefilled since it began), HRW order
//! breaking ties: a first turn does not wait behind a long prefill when a
//! backend just as balanced has none. Idle queues tie, so the choice is the
//! bounded HRW one and gateways keep agreeing whenever nothing queues. When
//! every backend within the bound queues much longer than one just at it, a
//! first turn may take that one, one unit over ([`RELIEF_SHARE`]). A prompt
//! whose opening some backend within the bound holds (by the prefix index,
//! [`HELD_OPENING_TOKENS`] beyond what every backend holds) goes to such a
//! holder whatever the queues: the queues choose among the holders only.
//!
//! With balanced load every backend qualifies and the choice is plain HRW, so
//! gateways that see the same fleet agree. A backend that has run ahead (hash
//! lumpiness, heavy sessions, a slow replica) is skipped until the others
//! catch up; a replica that comes back empty is below its share and takes new
//! sessions until it is level, each one's HRW order permitting.

use super::first::FirstPlacement;
use crate::affinity::candidate::{unlearned_cost, Candidate};
use crate::affinity::hrw;

pub struct BoundedHrw {
    /// ≥ 1; 1.25 is the customary choice.
    pub balance_factor: f64,
    /// Scale each backend's share by its learned speed (`placement.speed_aware`).
    pub speed_aware: bool,
    /// Among backends within the bound, prefer the least queued prefill work
    /// (`placement.queue_aware`).
    pub queue_aware: bool,
    /// The prefill cost per token assumed before any backend has learned its
    /// own (`affinity.prior_prefill_us_per_token`): it times the progress of
    /// each queue's head.
    pub prior_us_per_token: f64,
}

/// A backend's share of the tier's capacity counts its speed as well as its
/// weight: one whose learned prefill cost per token is well above the
/// fastest backend's (a throttled GPU, an older card, a noisy neighbour)
/// serves that much less, so it takes that much fewer sessions. Costs within
/// [`SAME_SPEED`] of the fastest count as equal, so learning noise never moves
/// a bound and gateways keep agreeing; unknown costs count as the fastest.
pub const SAME_SPEED: f64 = 0.8;

/// `c`'s speed relative to the fastest learned cost (`fastest` µs/token).
fn speed(c: &Candidate, fastest: f64) -> f64 {
    if c.prefill_us_per_token <= 0.0 || fastest <= 0.0 {
        return 1.0;
    }
    let r = fastest / c.prefill_us_per_token;
    if r >= SAME_SPEED {
        1.0
    } else {
        r
    }
}

/// The tier-wide sums every backend's capacity is a share of.
struct Totals {
    load: u64,
    weight: f64,
    fastest: f64,
}

impl Totals {
    /// `speed_aware` off: every speed counts as the fastest (`fastest` 0).
    fn of(open: &[Candidate], load: &[u64], speed_aware: bool) -> Totals {
        let fastest = match speed_aware {
            true => open
                .iter()
                .map(|c| c.prefill_us_per_token)
                .filter(|&us| us > 0.0)
                .fold(0.0, |m: f64, us| if m == 0.0 { us } else { m.min(us) }),
            false => 0.0,
        };
        Totals {
            load: load.iter().sum(),
            weight: open.iter().map(|c| effective_weight(c, fastest)).sum(),
            fastest,
        }
    }
}

fn effective_weight(c: &Candidate, fastest: f64) -> f64 {
    c.weight.max(1) as f64 * speed(c, fastest)
}

/// A first turn may go to a backend one unit over its bound (one session,
/// with the default load measure) when its queue's wait is shorter than the
/// best within the bound's by at least a third of that and at least
/// [`RELIEF_FLOOR_US`]: a first turn need not wait a whole heavy prefill for
/// one session's worth of balance. One unit and no more, so the bound still
/// holds to within one; queues that differ little, or that are idle (where
/// gateways must agree), leave the choice to bounded HRW. Some backend of the
/// tier must have learned its cost per token: in a start-up burst, before any
/// answer, every wait is a guess at the prior, and relief taken on guesses
/// leaves a lasting excess of sessions on one replica for a first turn's gain.
pub const RELIEF_SHARE: f64 = 1.0 / 3.0;
pub const RELIEF_FLOOR_US: u64 = 50_000;

/// Whether a wait of `short` µs relieves a first turn enough, against
/// `best` µs within the bound, to exceed the bound by one ([`RELIEF_SHARE`]).
fn relieves(short: u64, best: u64) -> bool {
    let saving = best.saturating_sub(short);
    saving >= RELIEF_FLOOR_US && saving as f64 >= RELIEF_SHARE * best as f64
}

/// A backend holds a prompt's opening when the prefix index says it holds
/// at least [`HELD_OPENING_TOKENS`] more of it than the backend holding
/// least (a system prompt every backend holds is no opening of this
/// prompt's), and at least half of the most any backend holds beyond that.
pub const HELD_OPENING_TOKENS: u64 = 512;

struct Holders {
    least: u64,
    most: u64,
}

impl Holders {
    fn of(open: &[Candidate]) -> Holders {
        let (least, most) = open.iter().fold((u64::MAX, 0), |(least, most), c| {
            (least.min(c.prefix_tokens), most.max(c.prefix_tokens))
        });
        Holders {
            least: least.min(most),
            most,
        }
    }

    fn holds(&self, c: &Candidate) -> bool {
        let beyond = c.prefix_tokens - self.least;
        let most = self.most - self.least;
        most >= HELD_OPENING_TOKENS && beyond >= HELD_OPENING_TOKENS && 2 * beyond >= most
    }
}

impl BoundedHrw {
    /// How many load units `c` may carry: ⌈factor × (total + 1) × share⌉,
    /// its weighted (and speed-scaled) share of the tier's load with the new
    /// session counted.
    fn capacity(&self, c: &Candidate, t: &Totals) -> u64 {
        let share = effective_weight(c, t.fastest) / t.weight.max(f64::MIN_POSITIVE);
        (self.balance_factor * (t.load + 1) as f64 * share).ceil() as u64
    }

    /// Whether `open[i]` can take one more unit and stay within capacity.
    pub fn accepts(&self, i: usize, open: &[Candidate], load: &[u64]) -> bool {
        load[i] < self.capacity(&open[i], &Totals::of(open, load, self.speed_aware))
    }
}

impl FirstPlacement for BoundedHrw {
    fn place(&self, session: u64, open: &[Candidate], load: &[u64]) -> Option<usize> {
        let totals = Totals::of(open, load, self.speed_aware);
        let within = |i: usize| load[i] < self.capacity(&open[i], &totals);
        let holders = Holders::of(open);
        let most_held = holders.most;
        if !self.queue_aware && most_held == 0 {
            return hrw::choose_where(session, open, within).or_else(|| hrw::choose(session, open));
        }
        let unlearned = unlearned_cost(open, self.prior_us_per_token);
        let learned = || open.iter().any(|c| c.prefill_us_per_token > 0.0);
        // Where an opening is cached (a document many conversations start
        // with, a fork's transcript), a backend holding it within the
        // bound takes the session whatever the queues: a queue drains in a
        // moment, while the opening computed again elsewhere is work every
        // later conversation on it pays too, and a second copy of it in
        // another cache.
        let holder_within = (0..open.len()).any(|i| holders.holds(&open[i]) && within(i));
        // How much later the first token comes at `i` than at the best:
        // the queue there (queue-aware), and the prefill of what it does
        // not hold of the prompt that some backend does. One cost per token
        // for every backend: equal holdings tie (HRW decides), and a prefix
        // that every backend holds is no reason to pick one.
        let wait = |i: usize| {
            let queue = match self.queue_aware {
                true => open[i].wait_us(unlearned),
                false => 0.0,
            };
            (queue + (most_held - open[i].prefix_tokens) as f64 * unlearned) as u64
        };
        // Within the bound, or at it (relief: one unit over for a queue much
        // shorter), in one pass.
        let (best, short) = hrw::choose_least_of_two(session, open, |i| {
            let cap = self.capacity(&open[i], &totals);
            let eligible = !holder_within || holders.holds(&open[i]);
            (load[i] <= cap && eligible).then(|| (wait(i), load[i] < cap))
        });
        match (best, short) {
            (Some(b), Some(s)) if relieves(wait(s), wait(b)) && learned() => Some(s),
            (Some(b), _) => Some(b),
            _ => hrw::choose(session, open),
        }
    }

    /// Beyond what placement itself may fill: the bound, and with
    /// `queue_aware` relief's one unit over it, so a parent that relief
    /// placed one over still has its subagents join it.
    fn overloaded(&self, i: usize, open: &[Candidate], load: &[u64]) -> bool {
        let relief = u64::from(self.queue_aware);
        load[i] > self.capacity(&open[i], &Totals::of(open, load, self.speed_aware)) + relief
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affinity::placement::testing::open;

    const B: BoundedHrw = BoundedHrw {
        balance_factor: 1.25,
        speed_aware: false,
        queue_aware: false,
        prior_us_per_token: 100.0,
    };

    #[test]
    fn balanced_load_gives_plain_hrw() {
        let o = open(4);
        for s in 0..200u64 {
            assert_eq!(B.place(s, &o, &[10, 10, 10, 10]), hrw::choose(s, &o));
            assert_eq!(B.place(s, &o, &[0, 0, 0, 0]), hrw::choose(s, &o));
        }
    }

    #[test]
    fn the_first_sessions_spread_before_any_backend_takes_a_second() {
        let o = open(3);
        let mut load = [0u64; 3];
        for s in 0..3u64 {
            load[B.place(hrw::mix(s), &o, &load).unwrap()] += 1;
        }
        assert_eq!(load, [1, 1, 1]);
    }

    #[test]
    fn skips_a_backend_over_its_bound_by_hand() {
        // Loads 12, 6, 6: total 24, capacity ⌈1.25 × 25 / 3⌉ = ⌈10.42⌉ = 11.
        // Backend 0 (12) is over it; backends 1 and 2 (6) accept one more.
        let o = open(3);
        let load = [12, 6, 6];
        assert!(!B.accepts(0, &o, &load));
        assert!(B.overloaded(0, &o, &load));
        assert!(B.accepts(1, &o, &load));
        assert!(!B.overloaded(1, &o, &load));
        // Loads 10, 6, 6: capacity ⌈1.25 × 23 / 3⌉ = ⌈9.58⌉ = 10. Backend 0 is
        // full but not over: a subagent may still join its parent there.
        assert!(!B.accepts(0, &o, &[10, 6, 6]));
        assert!(!B.overloaded(0, &o, &[10, 6, 6]));
        let s = (0..1000u64)
            .find(|&s| hrw::choose(s, &o) == Some(0))
            .expect("a session whose HRW top is backend 0");
        let second = hrw::ranked(s, &o)[1];
        assert_eq!(B.place(s, &o, &load), Some(second));
    }

    #[test]
    fn an_empty_replica_takes_new_sessions_until_level() {
        // Two replicas hold 30 sessions each; a third comes back empty.
        // The full ones accept again once ⌈1.25 × (61 + k) / 3⌉ > 30, i.e.
        // after k = 12 sessions went to the empty one.
        let o = open(3);
        let mut load = [30u64, 30, 0];
        let picks: Vec<usize> = (0..30u64)
            .map(|s| {
                let i = B.place(hrw::mix(s), &o, &load).unwrap();
                load[i] += 1;
                i
            })
            .collect();
        assert!(picks[..12].iter().all(|&i| i == 2), "{picks:?}");
        assert!(
            picks[12..].iter().any(|&i| i != 2),
            "then HRW again: {picks:?}"
        );
        // And every replica ends within the bound (capacity at 90 sessions: 38).
        assert!(load.iter().all(|&l| l <= 38), "{load:?}");
    }

    #[test]
    fn a_parent_placed_one_over_by_relief_keeps_its_subagents() {
        let q = BoundedHrw {
            balance_factor: 1.0,
            queue_aware: true,
            ..B
        };
        let o = open(3);
        // Loads 5, 3, 3: capacity ⌈12 / 3⌉ = 4, backend 0 one over (as relief
        // leaves it). Queue-blind, that is over the bound and subagents go
        // elsewhere; queue-aware, it is what placement itself may fill.
        let blind = BoundedHrw {
            queue_aware: false,
            ..q
        };
        assert!(blind.overloaded(0, &o, &[5, 3, 3]));
        assert!(!q.overloaded(0, &o, &[5, 3, 3]));
        // Two over (7, 3, 3: capacity ⌈14 / 3⌉ = 5) is over for both.
        assert!(q.overloaded(0, &o, &[7, 3, 3]));
        assert!(blind.overloaded(0, &o, &[7, 3, 3]));
    }

    #[test]
    fn weights_scale_the_share() {
        // Backend 0 has weight 3 of 5: capacity ⌈1.25 × 11 × 0.6⌉ = ⌈8.25⌉ = 9.
        let mut o = open(3);
        o[0].weight = 3;
        assert!(B.accepts(0, &o, &[8, 1, 1]));
        assert!(!B.accepts(0, &o, &[9, 1, 0]));
        // The same loads on an equal-weight backend: ⌈1.25 × 11 / 5⌉ = 3.
        assert!(!B.accepts(1, &o, &[6, 3, 1]));
    }

    #[test]
    fn a_slower_backend_takes_fewer_sessions_by_hand() {
        // Learned costs 150, 50, 50 µs a token: speeds 1/3, 1, 1, shares
        // 1/7, 3/7, 3/7. Loads 2, 3, 3 (total 8): the slow one's capacity is
        // ⌈1.0 × 9 × 1/7⌉ = 2 — full; a fast one's ⌈9 × 3/7⌉ = 4.
        let b = BoundedHrw {
            balance_factor: 1.0,
            speed_aware: true,
            queue_aware: false,
            prior_us_per_token: 100.0,
        };
        let mut o = open(3);
        for (c, us) in o.iter_mut().zip([150.0, 50.0, 50.0]) {
            c.prefill_us_per_token = us;
        }
        let load = [2, 3, 3];
        assert!(!b.accepts(0, &o, &load));
        assert!(b.accepts(1, &o, &load));
        // Speed unknown, or `speed_aware` off: capacity ⌈9 / 3⌉ = 3 and it accepts.
        assert!(b.accepts(0, &open(3), &load));
        let blind = BoundedHrw {
            speed_aware: false,
            ..b
        };
        assert!(blind.accepts(0, &o, &load));
        // Within 20% of the fastest counts as the same speed: plain HRW.
        for (c, us) in o.iter_mut().zip([55.0, 50.0, 60.0]) {
            c.prefill_us_per_token = us;
        }
        for s in 0..200u64 {
            assert_eq!(b.place(s, &o, &[3, 3, 3]), hrw::choose(s, &o));
        }
    }

    #[test]
    fn no_backend_ends_above_its_capacity() {
        let o = open(3);
        for factor in [1.25, 1.1, 1.0] {
            let b = BoundedHrw {
                balance_factor: factor,
                ..B
            };
            let mut load = [0u64; 3];
            for s in 0..64u64 {
                load[b.place(hrw::mix(s), &o, &load).unwrap()] += 1;
            }
            let cap = (factor * 64.0 / 3.0).ceil() as u64;
            assert!(load.iter().all(|&l| l <= cap), "factor {factor}: {load:?}");
        }
    }

    #[test]
    fn queue_aware_takes_the_least_queued_backend_within_the_bound() {
        let q = BoundedHrw {
            balance_factor: 1.0,
            queue_aware: true,
            ..B
        };
        let mut o = open(3);
        // Idle queues tie: plain (bounded) HRW, so gateways agree.
        for s in 0..200u64 {
            assert_eq!(q.place(s, &o, &[2, 2, 2]), hrw::choose(s, &o));
        }
        // 7,000 tokens queued at backends 0 and 1, 1,000 at 2: backend 2,
        // whatever the hash says.
        for (c, tokens) in o.iter_mut().zip([7_000, 7_000, 1_000]) {
            c.queued_tokens = tokens;
        }
        for s in 0..200u64 {
            assert_eq!(q.place(s, &o, &[2, 2, 2]), Some(2));
        }
        // Loads 2, 2, 3: capacity ⌈8 / 3⌉ = 3, backend 2 is full. Before any
        // backend has learned its cost the waits are guesses: no relief, the
        // least queued of the others.
        for s in 0..200u64 {
            let pick = q.place(s, &o, &[2, 2, 3]).unwrap();
            assert_eq!(Some(pick), hrw::choose_where(s, &o, |i| i < 2));
        }
        // Once one backend has learned 100 µs a token (what the others are
        // then taken to cost too), backend 2's wait (100 ms) is 600 ms
        // shorter than the others' 700 ms (over 50 ms and a third): relief,
        // one over.
        o[1].prefill_us_per_token = 100.0;
        for s in 0..200u64 {
            assert_eq!(q.place(s, &o, &[2, 2, 3]), Some(2));
        }
        // Two over (loads 2, 2, 4; capacity ⌈9 / 3⌉ = 3) never: the least
        // queued of the others, 0 and 1 tying by hash.
        for s in 0..200u64 {
            let pick = q.place(s, &o, &[2, 2, 4]).unwrap();
            let by_hash = hrw::choose_where(s, &o, |i| i < 2);
            assert_eq!(Some(pick), by_hash);
        }
        // Nor for a saving under a third: 5,000 tokens at backend 2 (500 ms
        // against 700 ms saves 200 ms, 29%).
        o[2].queued_tokens = 5_000;
        for s in 0..200u64 {
            let pick = q.place(s, &o, &[2, 2, 3]).unwrap();
            assert_eq!(Some(pick), hrw::choose_where(s, &o, |i| i < 2));
        }
        o[2].queued_tokens = 1_000;
        // A head 100 ms into its prefill at 50 µs a token has done 2,000 of
        // backend 0's 7,000: 5,000 still beat backend 1's 7,000.
        // (Seen by a session whose hash prefers backend 1.)
        let s = (0..1000u64)
            .find(|&s| hrw::choose_where(s, &o, |i| i < 2) == Some(1))
            .expect("a session preferring backend 1");
        o[0].prefill_us_per_token = 50.0;
        o[0].head_ms = 100;
        assert_eq!(q.place(s, &o, &[2, 2, 4]), Some(0));
        // Off, the queues do not count.
        let blind = BoundedHrw {
            queue_aware: false,
            ..q
        };
        assert_eq!(blind.place(s, &o, &[2, 2, 4]), Some(1));
    }

    #[test]
    fn a_new_binding_goes_where_its_prefix_is_held_within_the_bound() {
        let q = BoundedHrw {
            balance_factor: 1.0,
            queue_aware: true,
            ..B
        };
        let mut o = open(3);
        // Backend 1 holds 4,000 tokens of the prompt (a fork, a retry under
        // a fresh id, a subagent repeating its parent): it wins, whatever
        // the hash says.
        o[1].prefix_tokens = 4_000;
        for s in 0..200u64 {
            assert_eq!(q.place(s, &o, &[2, 2, 2]), Some(1));
        }
        // Queue-blind placement reads the prefix too.
        let blind = BoundedHrw {
            queue_aware: false,
            ..q
        };
        assert_eq!(blind.place(7, &o, &[2, 2, 2]), Some(1));
        // A prefix every backend holds (a shared system prompt) is no reason
        // to pick one: plain HRW.
        for c in o.iter_mut() {
            c.prefix_tokens = 2_000;
        }
        for s in 0..200u64 {
            assert_eq!(q.place(s, &o, &[2, 2, 2]), hrw::choose(s, &o));
        }
        // The bound still rules: backend 1 full (loads 2, 3, 2: capacity 3)
        // and nothing learned yet, its prefix waits for a backend with room.
        o[1].prefix_tokens = 4_000;
        for s in 0..200u64 {
            let pick = q.place(s, &o, &[2, 3, 2]).unwrap();
            assert_eq!(Some(pick), hrw::choose_where(s, &o, |i| i != 1));
        }
        // A queue does not outweigh it within the bound: 30,000 tokens
        // queued at backend 1 (3 s) against 2,000 saved (200 ms), learned.
        o[1].queued_tokens = 30_000;
        for c in o.iter_mut() {
            c.prefill_us_per_token = 100.0;
        }
        for s in 0..200u64 {
            assert_eq!(q.place(s, &o, &[2, 2, 2]), Some(1));
        }
        // Among backends that hold it alike the queue decides: backend 2
        // holds the same opening and has nothing queued.
        o[2].prefix_tokens = 4_000;
        for s in 0..200u64 {
            assert_eq!(q.place(s, &o, &[2, 2, 2]), Some(2));
        }
        // A holder over the bound leaves the choice to the queues of all.
        o[2].prefix_tokens = 2_000;
        o[0].queued_tokens = 10_000;
        for s in 0..200u64 {
            assert_eq!(q.place(s, &o, &[2, 3, 2]), Some(2));
        }
    }

    #[test]
    fn a_prompt_opens_on_what_a_backend_holds_well_beyond_the_rest() {
        let mut o = open(3);
        let held = |o: &[Candidate]| -> Vec<bool> {
            let h = Holders::of(o);
            o.iter().map(|c| h.holds(c)).collect()
        };
        // A system prompt all hold: no one holds an opening.
        for c in o.iter_mut() {
            c.prefix_tokens = 2_000;
        }
        assert_eq!(held(&o), [false, false, false]);
        // Less than an opening's worth beyond it: none either.
        o[0].prefix_tokens = 2_000 + HELD_OPENING_TOKENS - 1;
        assert_eq!(held(&o), [false, false, false]);
        // A document beyond it (4,096 tokens): its holder; one holding the
        // document and a little more (a fork), both; one holding less than
        // half of the most, not.
        o[0].prefix_tokens = 6_096;
        o[1].prefix_tokens = 7_000;
        assert_eq!(held(&o), [true, true, false]);
        o[0].prefix_tokens = 3_000;
        assert_eq!(held(&o), [false, true, false]);
    }
}
