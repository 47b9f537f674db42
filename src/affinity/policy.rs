//! Whether a live binding is kept or moved: the hook soft mode consults.
//!
//! Hard mode keeps a binding while its backend is a candidate (and not
//! drained with "move sessions"). Soft mode treats the binding as a
//! preference: [`BindingPolicy::review`] may move it. The shipped policy moves
//! a session off a draining backend, or off one with at least
//! `soft_max_in_flight` requests in flight when another candidate has room.

use super::Candidate;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Hard,
    Soft,
}

/// Why a live binding was moved (`agentserve_affinity_moves_total{reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoveReason {
    Drain,
    Overloaded,
}

impl MoveReason {
    pub fn as_str(self) -> &'static str {
        match self {
            MoveReason::Drain => "drain",
            MoveReason::Overloaded => "overloaded",
        }
    }
}

/// The soft-mode hook: given the bound backend and every candidate, keep
/// (`None`) or move, and why. The destination is then chosen by HRW among
/// the candidates that may take new sessions.
pub trait BindingPolicy: Send + Sync {
    fn review(&self, bound: &Candidate, candidates: &[Candidate]) -> Option<MoveReason>;
}

/// The default policy, in either mode.
#[derive(Clone, Copy, Debug)]
pub struct DefaultPolicy {
    pub mode: Mode,
    /// 0 = no limit.
    pub soft_max_in_flight: u64,
}

impl BindingPolicy for DefaultPolicy {
    fn review(&self, bound: &Candidate, candidates: &[Candidate]) -> Option<MoveReason> {
        if bound.draining && (bound.move_on_drain || self.mode == Mode::Soft) {
            return Some(MoveReason::Drain);
        }
        if self.mode == Mode::Soft && self.soft_max_in_flight > 0 {
            let limit = self.soft_max_in_flight;
            let has_room = candidates
                .iter()
                .any(|c| c.slot != bound.slot && !c.draining && c.in_flight < limit);
            if bound.in_flight >= limit && has_room {
                return Some(MoveReason::Overloaded);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(slot: u32, in_flight: u64, draining: bool) -> Candidate {
        Candidate {
            slot,
            seed: slot as u64,
            weight: 1,
            in_flight,
            engine_requests: 0,
            draining,
            move_on_drain: false,
        }
    }

    #[test]
    fn hard_mode_keeps_through_load_and_plain_drain() {
        let p = DefaultPolicy {
            mode: Mode::Hard,
            soft_max_in_flight: 1,
        };
        let all = [c(0, 50, true), c(1, 0, false)];
        assert_eq!(p.review(&all[0], &all), None);
        let mut asked = all;
        asked[0].move_on_drain = true;
        assert_eq!(p.review(&asked[0], &asked), Some(MoveReason::Drain));
    }

    #[test]
    fn soft_mode_moves_off_draining_or_overloaded_backends_only_when_there_is_room() {
        let p = DefaultPolicy {
            mode: Mode::Soft,
            soft_max_in_flight: 4,
        };
        let all = [c(0, 4, false), c(1, 3, false)];
        assert_eq!(p.review(&all[0], &all), Some(MoveReason::Overloaded));
        let full = [c(0, 4, false), c(1, 4, false)];
        assert_eq!(p.review(&full[0], &full), None, "nowhere better to go");
        let drain = [c(0, 0, true), c(1, 0, false)];
        assert_eq!(p.review(&drain[0], &drain), Some(MoveReason::Drain));
    }
}
