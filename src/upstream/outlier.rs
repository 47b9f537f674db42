//! Passive health: outlier ejection (Envoy's outlier detection, HAProxy's
//! `observe layer7`).
//!
//! A backend whose health endpoint still answers 200 can hang, reset or
//! answer 5xx to real requests. After `consecutive_failures` such answers in a
//! row it is ejected: not a candidate for `base_ejection` (doubling with each
//! ejection in a row, up to `max_ejection`), so its sessions rebind once
//! (counted broken) instead of failing turn after turn. A success resets the
//! count; the ejection backoff resets when the backend succeeds after
//! returning. Ejection never takes a tier below its panic threshold: the
//! caller refuses an ejection that would leave more than
//! `max_ejected_percent` of a tier's backends out (so never a whole tier).

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

pub use crate::config::OutlierConfig;

/// Serialises a tier's ejection decisions (see [`OutlierState::record_in`]).
#[derive(Debug, Default)]
pub struct EjectionGate(parking_lot::Mutex<()>);

/// One backend's passive-health state (lives in its `BackendStats`).
#[derive(Debug, Default)]
pub struct OutlierState {
    consecutive: AtomicU32,
    /// `consecutive_failures` as last configured (0: no outcome seen yet).
    threshold: AtomicU32,
    /// Gateway clock (ms) until which the backend is out; 0 = in.
    ejected_until_ms: AtomicU64,
    /// Ejections since the backend last succeeded after returning.
    streak: AtomicU32,
}

/// What one finished request says about its backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The backend answered (any status below 500).
    Success,
    /// Connect failure, timeout, early close, garbage or a 5xx.
    Failure,
}

impl OutlierState {
    pub fn ejected(&self, now_ms: u64) -> bool {
        now_ms < self.ejected_until_ms.load(Ordering::Relaxed)
    }

    /// [`Self::ejected`] now, reading the clock only for a backend that has
    /// been ejected at some point (this is asked per candidate per request).
    pub fn ejected_now(&self) -> bool {
        let until = self.ejected_until_ms.load(Ordering::Relaxed);
        until != 0 && crate::clock::now_ms() < until
    }

    /// [`Self::ejected_now`] with the clock already read (`clock::now_ms`).
    pub fn ejected_at(&self, now_ms: u64) -> bool {
        let until = self.ejected_until_ms.load(Ordering::Relaxed);
        until != 0 && now_ms < until
    }

    /// Record one outcome. Returns how long the backend is now ejected for,
    /// when this failure ejected it and `may_eject` (the panic threshold,
    /// asked only then) allowed it.
    pub fn record(
        &self,
        outcome: Outcome,
        cfg: &OutlierConfig,
        now_ms: u64,
        may_eject: impl FnOnce() -> bool,
    ) -> Option<Duration> {
        if !cfg.enabled {
            return None;
        }
        self.threshold
            .store(cfg.consecutive_failures, Ordering::Relaxed);
        match outcome {
            Outcome::Success => {
                self.consecutive.store(0, Ordering::Relaxed);
                if !self.ejected(now_ms) {
                    self.streak.store(0, Ordering::Relaxed);
                }
                None
            }
            Outcome::Failure => {
                let n = self.consecutive.fetch_add(1, Ordering::Relaxed) + 1;
                if n < cfg.consecutive_failures || self.ejected(now_ms) {
                    return None;
                }
                if !may_eject() {
                    return None;
                }
                let streak = self.streak.load(Ordering::Relaxed).min(16);
                let span = cfg
                    .base_ejection
                    .saturating_mul(1u32 << streak)
                    .min(cfg.max_ejection.max(cfg.base_ejection));
                let until = now_ms + span.as_millis() as u64;
                let current = self.ejected_until_ms.load(Ordering::Relaxed);
                // Concurrent failures race here: one of them ejects.
                if current > now_ms
                    || self
                        .ejected_until_ms
                        .compare_exchange(current, until, Ordering::Relaxed, Ordering::Relaxed)
                        .is_err()
                {
                    return None;
                }
                self.streak.fetch_add(1, Ordering::Relaxed);
                self.consecutive.store(0, Ordering::Relaxed);
                Some(span)
            }
        }
    }

    /// [`Self::record`] with the ejections of the backend's tier decided one
    /// at a time through `gate`: the panic threshold counts the backends out,
    /// and two failing backends that counted at once would both see room and
    /// both go, past the threshold (every backend of a tier, at worst).
    pub fn record_in(
        &self,
        gate: &EjectionGate,
        outcome: Outcome,
        cfg: &OutlierConfig,
        now_ms: u64,
        may_eject: impl FnOnce() -> bool,
    ) -> Option<Duration> {
        let _one = (outcome == Outcome::Failure).then(|| gate.0.lock());
        self.record(outcome, cfg, now_ms, may_eject)
    }

    /// Eject it now, as `consecutive_failures` failed requests in a row
    /// would (a backend that stalled: `super::stall`), through `gate` like
    /// [`Self::record_in`]. Where `may_eject` refuses, it counts as
    /// failing, so its sessions still leave it.
    pub fn eject_stalled(
        &self,
        gate: &EjectionGate,
        cfg: &OutlierConfig,
        now_ms: u64,
        may_eject: impl FnOnce() -> bool,
    ) -> Option<Duration> {
        if !cfg.enabled || self.ejected(now_ms) {
            return None;
        }
        let _one = gate.0.lock();
        let before = cfg.consecutive_failures.saturating_sub(1);
        self.consecutive.fetch_max(before, Ordering::Relaxed);
        self.record(Outcome::Failure, cfg, now_ms, may_eject)
    }

    /// When its last ejection ended (or ends), gateway clock ms; 0: never
    /// ejected.
    pub fn ejection_end_ms(&self) -> u64 {
        self.ejected_until_ms.load(Ordering::Relaxed)
    }

    /// Whether its last `consecutive_failures` requests in a row failed,
    /// ejected or not: a backend the ejection cap keeps in still fails its
    /// sessions, which then move (see `Candidate::failing`).
    pub fn failing(&self) -> bool {
        let threshold = self.threshold.load(Ordering::Relaxed);
        threshold > 0 && self.consecutive.load(Ordering::Relaxed) >= threshold
    }

    /// Put the backend back now (admin undrain, or a reload that re-adds it).
    pub fn reset(&self) {
        self.ejected_until_ms.store(0, Ordering::Relaxed);
        self.consecutive.store(0, Ordering::Relaxed);
        self.streak.store(0, Ordering::Relaxed);
    }

    /// Milliseconds of ejection left (0 when in).
    pub fn remaining_ms(&self, now_ms: u64) -> u64 {
        self.ejected_until_ms
            .load(Ordering::Relaxed)
            .saturating_sub(now_ms)
    }
}

/// Whether one more ejection keeps a tier of `total` backends, `out` of which
/// are already out (ejected or failing health checks), within the threshold.
pub fn may_eject(total: usize, out: usize, max_percent: u32) -> bool {
    let after = out + 1;
    after < total && after * 100 <= total * max_percent as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_failing_together_never_eject_past_the_threshold() {
        // Two backends of a tier of two may not both be out (the threshold
        // keeps one), and both reach their failure count at the same moment.
        let c = OutlierConfig {
            consecutive_failures: 1,
            max_ejected_percent: 100,
            ..OutlierConfig::default()
        };
        let gate = EjectionGate::default();
        let states = [OutlierState::default(), OutlierState::default()];
        // Both count the backends out, then both decide: each step waits (up
        // to 200 ms) for the other, which forces the race the gate must close.
        let arrived = std::sync::atomic::AtomicUsize::new(0);
        let counted = std::sync::atomic::AtomicUsize::new(0);
        let meet = |step: &std::sync::atomic::AtomicUsize| {
            step.fetch_add(1, Ordering::SeqCst);
            let until = std::time::Instant::now() + Duration::from_millis(200);
            while step.load(Ordering::SeqCst) < 2 && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
        };
        std::thread::scope(|scope| {
            for me in 0..2 {
                let (gate, states, c, meet) = (&gate, &states, &c, &meet);
                let (arrived, counted) = (&arrived, &counted);
                scope.spawn(move || {
                    states[me].record_in(gate, Outcome::Failure, c, 10, || {
                        meet(arrived);
                        let out = states.iter().filter(|s| s.ejected(10)).count();
                        meet(counted);
                        may_eject(2, out, c.max_ejected_percent)
                    })
                });
            }
        });
        let out = states.iter().filter(|s| s.ejected(10)).count();
        assert_eq!(out, 1, "one of the two is ejected, never both");
    }

    fn cfg() -> OutlierConfig {
        OutlierConfig {
            consecutive_failures: 3,
            base_ejection: Duration::from_millis(1000),
            max_ejection: Duration::from_millis(3000),
            ..Default::default()
        }
    }

    #[test]
    fn ejects_after_consecutive_failures_only() {
        let s = OutlierState::default();
        let c = cfg();
        assert_eq!(s.record(Outcome::Failure, &c, 10, || true), None);
        assert_eq!(s.record(Outcome::Failure, &c, 10, || true), None);
        // A success in between starts the count again.
        assert_eq!(s.record(Outcome::Success, &c, 10, || true), None);
        assert_eq!(s.record(Outcome::Failure, &c, 10, || true), None);
        assert_eq!(s.record(Outcome::Failure, &c, 10, || true), None);
        assert!(!s.ejected(10));
        assert_eq!(
            s.record(Outcome::Failure, &c, 10, || true),
            Some(Duration::from_millis(1000))
        );
        assert!(s.ejected(10));
        assert!(s.ejected(1009));
        assert!(!s.ejected(1010));
    }

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets_on_success() {
        let s = OutlierState::default();
        let c = cfg();
        let mut now = 0;
        let mut spans = Vec::new();
        for _ in 0..4 {
            let mut got = None;
            for _ in 0..3 {
                got = s.record(Outcome::Failure, &c, now, || true).or(got);
            }
            let span = got.expect("ejected");
            spans.push(span.as_millis());
            now += span.as_millis() as u64;
        }
        assert_eq!(spans, vec![1000, 2000, 3000, 3000]);
        // Back, and it answers: the next ejection starts from the base again.
        s.record(Outcome::Success, &c, now, || true);
        for _ in 0..2 {
            s.record(Outcome::Failure, &c, now, || true);
        }
        assert_eq!(
            s.record(Outcome::Failure, &c, now, || true),
            Some(Duration::from_millis(1000))
        );
    }

    #[test]
    fn the_panic_threshold_refuses_and_disabled_never_ejects() {
        let s = OutlierState::default();
        let c = cfg();
        for _ in 0..10 {
            assert_eq!(s.record(Outcome::Failure, &c, 0, || false), None);
        }
        assert!(!s.ejected(0));
        let off = OutlierConfig {
            enabled: false,
            ..cfg()
        };
        for _ in 0..10 {
            assert_eq!(s.record(Outcome::Failure, &off, 0, || true), None);
        }
        assert!(!s.ejected(0));
    }

    #[test]
    fn threshold_arithmetic() {
        // Never the last backend of a tier.
        assert!(!may_eject(1, 0, 100));
        assert!(!may_eject(2, 1, 100));
        // 50%: one of two, one of three, two of four.
        assert!(may_eject(2, 0, 50));
        assert!(may_eject(3, 0, 50));
        assert!(!may_eject(3, 1, 50));
        assert!(may_eject(4, 1, 50));
        assert!(!may_eject(4, 2, 50));
        assert!(!may_eject(10, 0, 0));
    }
}
