//! A learned limit checked against what the engine completes ([`Check`]):
//! a limit the engine's gauges lowered by more than a step is kept only if
//! the engine completes as much under it as it did above it. Gauges can be
//! wrong in ways the gateway cannot see from them alone (an address that
//! fronts several engines but reports one's gauges, an engine that reports
//! its requests waiting whatever runs); completions are not.
//!
//! Completions are counted over [`WINDOW_MS`] or more (and [`WINDOW_DONE`]
//! requests at least) of time during which the limit held requests back
//! ("bound", at the readings either side: what came back is what the engine
//! completes at that many, not what was asked of it; the time between
//! bursts does not count). A lowering is judged
//! by the bound window at the higher limit before it, or, with none, by a
//! trial: one window at twice the lower limit (at most the higher). A
//! lowering that cuts completions by a fifth or more is undone, and gauges
//! that lowered a limit wrongly are not followed for a while
//! ([`DISTRUST_MIN_MS`], doubling up to [`DISTRUST_MAX_MS`]).

/// A window's least length, ms.
pub(super) const WINDOW_MS: u64 = 2_000;
/// Completions a window needs to judge by.
pub(super) const WINDOW_DONE: u32 = 8;
/// A window closes by this long, enough completions or not, ms.
pub(super) const WINDOW_MAX_MS: u64 = 30_000;
/// What the higher limit must complete over the lower one to be kept.
pub(super) const GAIN: f64 = 1.25;
/// How long gauges that lowered a limit wrongly are not followed, the
/// first time and at most, ms.
pub(super) const DISTRUST_MIN_MS: u64 = 30_000;
pub(super) const DISTRUST_MAX_MS: u64 = 600_000;

/// Completions at one limit since a moment.
#[derive(Default)]
struct Window {
    /// Which window: a request counts in the one it started in (one that
    /// started under another limit tells nothing of this one's).
    era: u32,
    since_ms: u64,
    limit: u32,
    /// Completions since the last reading.
    done: u32,
    /// The last reading, and whether the limit held requests back then.
    last_ms: u64,
    last_bound: bool,
    /// Time between readings both bound, and the completions in it.
    bound_ms: u64,
    bound_done: u32,
    /// Completions since the window began, bound or not.
    all_done: u32,
}

/// What is being checked.
enum Pending {
    /// The gauges lowered the limit `from` -> `to`; `before`: what the
    /// engine completed a second at `from`, bound, if that was measured.
    Lowered {
        from: u32,
        to: u32,
        before: Option<f64>,
    },
    /// One window at `high` to compare with `low`'s completions a second.
    Trial { low: u32, rate_low: f64, high: u32 },
}

/// What a reading decided.
#[derive(Debug, PartialEq)]
pub(super) enum Verdict {
    None,
    /// The lowering cut what the engine completes: the limit is this again.
    Undo(u32),
    /// No window at the higher limit before it: try this one.
    Try(u32),
    /// The trial gained nothing: the lowering stands, the limit is this.
    Confirm(u32),
}

#[derive(Default)]
pub(super) struct Check {
    window: Window,
    /// The last bound window: its limit, and what it completed a second.
    last: Option<(u32, f64)>,
    pending: Option<Pending>,
    distrust_until_ms: u64,
    distrust_ms: u64,
}

impl Check {
    /// A request that started in window `era` ended there.
    pub(super) fn completed(&mut self, era: u32) {
        if era == self.window.era {
            self.window.done += 1;
            self.window.all_done += 1;
        }
    }

    /// The window a request starting now starts in.
    pub(super) fn era(&self) -> u32 {
        self.window.era
    }

    /// The gauges are not followed now (they lowered a limit wrongly), or a
    /// trial is running that they would cut short.
    pub(super) fn gauges_held(&self, now_ms: u64) -> bool {
        now_ms < self.distrust_until_ms || matches!(self.pending, Some(Pending::Trial { .. }))
    }

    /// A check is waiting for a bound window.
    pub(super) fn pending(&self) -> bool {
        self.pending.is_some()
    }

    /// The limit is `limit` from `now_ms` (a new window starts: what ends
    /// before the next reading ran under the change, and is not counted).
    pub(super) fn limit_set(&mut self, limit: u32, now_ms: u64) {
        self.window = Window {
            era: self.window.era.wrapping_add(1),
            since_ms: now_ms,
            limit,
            last_ms: now_ms,
            ..Window::default()
        };
    }

    /// A new window at the same limit (requests that started in the one
    /// before still count).
    fn next_window(&mut self, now_ms: u64) {
        self.window = Window {
            era: self.window.era,
            since_ms: now_ms,
            limit: self.window.limit,
            last_ms: now_ms,
            last_bound: self.window.last_bound,
            ..Window::default()
        };
    }

    /// The gauges lowered the limit `from` -> `to` at `now_ms`: checked
    /// when by more than a step (a step costs less than [`GAIN`] could
    /// tell). What the engine completed at `from` is the last bound
    /// window's, or, more, what the window running now saw whether bound
    /// or not (less than the engine could, never more: enough to show a
    /// lowering cut it).
    pub(super) fn lowered(&mut self, from: u32, to: u32, now_ms: u64) {
        if from < to + (to / 4).max(2) {
            return;
        }
        let w = &self.window;
        let age = now_ms.saturating_sub(w.since_ms);
        let now = (w.limit == from && age >= WINDOW_MS && w.all_done >= WINDOW_DONE)
            .then(|| w.all_done as f64 * 1_000.0 / age as f64);
        let bound = self.last.filter(|(l, _)| *l == from).map(|(_, r)| r);
        let before = match (bound, now) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.pending = Some(Pending::Lowered { from, to, before });
    }

    /// A reading at `now_ms`, the limit `limit` (`bound`: holding requests
    /// back now).
    pub(super) fn scraped(&mut self, limit: u32, bound: bool, now_ms: u64) -> Verdict {
        if self.window.limit != limit || now_ms < self.window.since_ms {
            self.limit_set(limit, now_ms);
            return Verdict::None;
        }
        let w = &mut self.window;
        if w.last_bound && bound {
            w.bound_ms += now_ms.saturating_sub(w.last_ms);
            w.bound_done += w.done;
        }
        (w.done, w.last_ms, w.last_bound) = (0, now_ms, bound);
        // Far below what the higher limit completed: one more completion
        // would not change the verdict, and each one waited for is slow.
        let (bound_ms, bound_done) = (w.bound_ms, w.bound_done);
        if let Some(Pending::Lowered {
            from,
            to,
            before: Some(b),
        }) = self.pending
        {
            let at_most = (bound_done + 1) as f64 * 1_000.0 / bound_ms.max(1) as f64;
            if to == limit && bound_ms >= WINDOW_MS && at_most * GAIN <= b {
                self.pending = None;
                self.next_window(now_ms);
                return self.undo(from, now_ms);
            }
        }
        let w = &mut self.window;
        let judged = w.bound_ms >= WINDOW_MS && w.bound_done >= WINDOW_DONE;
        if !judged && now_ms - w.since_ms < WINDOW_MAX_MS {
            return Verdict::None;
        }
        let rate = w.bound_done as f64 * 1_000.0 / w.bound_ms.max(1) as f64;
        self.next_window(now_ms);
        if !judged {
            return Verdict::None;
        }
        self.last = Some((limit, rate));
        match self.pending.take() {
            Some(Pending::Lowered { from, to, before }) if to == limit => match before {
                Some(b) if rate * GAIN <= b => self.undo(from, now_ms),
                Some(_) => {
                    self.distrust_ms = 0;
                    Verdict::None
                }
                None => {
                    let high = from.min(to.saturating_mul(2));
                    self.pending = Some(Pending::Trial {
                        low: to,
                        rate_low: rate,
                        high,
                    });
                    Verdict::Try(high)
                }
            },
            Some(Pending::Trial {
                low,
                rate_low,
                high,
            }) if high == limit => match rate >= rate_low * GAIN {
                true => self.undo(high, now_ms),
                false => {
                    self.distrust_ms = 0;
                    Verdict::Confirm(low)
                }
            },
            // Overtaken: the limit moved on.
            _ => Verdict::None,
        }
    }

    fn undo(&mut self, limit: u32, now_ms: u64) -> Verdict {
        self.distrust_ms = (self.distrust_ms * 2).clamp(DISTRUST_MIN_MS, DISTRUST_MAX_MS);
        self.distrust_until_ms = now_ms + self.distrust_ms;
        Verdict::Undo(limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` completions over `ms` from a reading just after `at`, bound at
    /// both; the verdict of the reading that closes the window.
    fn window(c: &mut Check, limit: u32, at: u64, ms: u64, n: u32) -> Verdict {
        assert_eq!(c.scraped(limit, true, at + 1), Verdict::None);
        for _ in 0..n {
            c.completed(c.era());
        }
        c.scraped(limit, true, at + 1 + ms)
    }

    #[test]
    fn a_lowering_that_cuts_completions_is_undone_and_the_gauges_held() {
        let mut c = Check::default();
        c.limit_set(16, 0);
        // 16 at a time completed 32 in 2 s.
        assert_eq!(window(&mut c, 16, 0, 2_000, 32), Verdict::None);
        c.lowered(16, 4, 2_000);
        c.limit_set(4, 2_000);
        // At 4, 8 in 2 s: a quarter. Undone.
        assert_eq!(window(&mut c, 4, 2_000, 2_000, 8), Verdict::Undo(16));
        assert!(c.gauges_held(4_001 + DISTRUST_MIN_MS - 1));
        assert!(!c.gauges_held(4_001 + DISTRUST_MIN_MS));
    }

    #[test]
    fn a_lowering_that_completes_as_much_stands() {
        let mut c = Check::default();
        c.limit_set(16, 0);
        assert_eq!(window(&mut c, 16, 0, 2_000, 32), Verdict::None);
        c.lowered(16, 8, 2_000);
        c.limit_set(8, 2_000);
        // The engine ran 8: as many complete at 8 as at 16.
        assert_eq!(window(&mut c, 8, 2_000, 2_000, 30), Verdict::None);
        assert!(!c.pending());
        assert!(!c.gauges_held(4_000));
    }

    #[test]
    fn what_the_higher_limit_completed_unbound_is_enough_to_undo_a_lowering() {
        let mut c = Check::default();
        c.limit_set(64, 0);
        // 40 a second at 64, never bound (40 asked at a time).
        assert_eq!(c.scraped(64, false, 1), Verdict::None);
        for _ in 0..120 {
            c.completed(c.era());
        }
        assert_eq!(c.scraped(64, false, 3_000), Verdict::None);
        c.lowered(64, 1, 3_000);
        c.limit_set(1, 3_000);
        // At 1, one a second: undone once the time bound shows it, with
        // no trial and before eight have come back.
        assert_eq!(window(&mut c, 1, 3_000, 2_000, 2), Verdict::Undo(64));
    }

    #[test]
    fn with_nothing_measured_above_it_a_lowering_is_tried_at_twice() {
        let mut c = Check::default();
        c.lowered(4, 1, 0);
        c.limit_set(1, 0);
        assert_eq!(window(&mut c, 1, 0, 8_000, 8), Verdict::Try(2));
        assert!(c.gauges_held(8_000), "not cut short by the gauges");
        c.limit_set(2, 8_000);
        // Twice the limit, twice the completions: the engine had room.
        assert_eq!(window(&mut c, 2, 8_000, 4_000, 8), Verdict::Undo(2));
        // Another, whose trial gains nothing, stands.
        let mut c = Check::default();
        c.lowered(8, 4, 0);
        c.limit_set(4, 0);
        assert_eq!(window(&mut c, 4, 0, 2_000, 8), Verdict::Try(8));
        c.limit_set(8, 2_000);
        assert_eq!(window(&mut c, 8, 2_000, 2_000, 9), Verdict::Confirm(4));
    }

    #[test]
    fn only_time_that_held_requests_back_counts_and_too_few_judge_nothing() {
        let mut c = Check::default();
        c.lowered(16, 4, 2_000);
        c.limit_set(4, 0);
        assert_eq!(c.scraped(4, true, 1), Verdict::None);
        // Between bursts (not bound at the next reading): 20 completions
        // and 2.5 s that do not count.
        for _ in 0..20 {
            c.completed(c.era());
        }
        assert_eq!(c.scraped(4, false, 2_500), Verdict::None);
        assert_eq!(c.scraped(4, true, 2_600), Verdict::None);
        assert!(c.pending(), "still to be checked");
        // Bound again: 2 s, 8 completions (4 a second: a quarter of the 16
        // it was lowered from is not known, so a trial at 8).
        for _ in 0..8 {
            c.completed(c.era());
        }
        assert_eq!(c.scraped(4, true, 4_600), Verdict::Try(8));
        // Bound, too few completions: by the longest window, nothing.
        let mut c = Check::default();
        c.lowered(16, 4, 2_000);
        c.limit_set(4, 0);
        assert_eq!(c.scraped(4, true, 1), Verdict::None);
        c.completed(c.era());
        assert_eq!(
            c.scraped(4, true, WINDOW_MAX_MS),
            Verdict::None,
            "one completed"
        );
        // Requests that started under the limit before do not count.
        let mut c = Check::default();
        c.lowered(16, 4, 2_000);
        c.limit_set(4, 0);
        let before = c.era();
        c.limit_set(4, 0);
        assert_eq!(c.scraped(4, true, 1), Verdict::None);
        for _ in 0..20 {
            c.completed(before);
        }
        assert_eq!(c.scraped(4, true, 3_000), Verdict::None);
        // A step (4 -> 3) is not checked.
        let mut c = Check::default();
        c.lowered(4, 3, 0);
        assert!(!c.pending());
    }
}
