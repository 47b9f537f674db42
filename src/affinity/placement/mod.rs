//! First placement: which backend a session without a live binding gets.
//!
//! One trait, one file per algorithm. Each sees the backends that may take
//! new sessions (`open`) and the load of each under the configured measure
//! ([`LoadMeasure`]), and returns an index into `open`.
//!
//! - [`bounded_hrw`] (the default): the session's rendezvous order, skipping
//!   backends above `balance_factor` × their share of the load ("consistent
//!   hashing with bounded loads"). With balanced load it is exactly HRW, so
//!   gateways agree; an overloaded or refilling fleet evens out.
//! - [`hrw`]: plain rendezvous hashing, load-blind.
//! - [`least_loaded`]: the least loaded backend, HRW breaking ties.
//! - [`round_robin`]: the next backend in turn (what a sticky-table proxy does).

pub mod bounded_hrw;
pub mod first;
pub mod hrw;
pub mod least_loaded;
pub mod round_robin;

use super::candidate::Candidate;
pub use first::FirstPlacement;

/// What counts as a backend's load for placement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadMeasure {
    /// Live bindings, and new keyless conversations on probation there:
    /// the sessions that will send it their next turns.
    Sessions,
    /// Requests in flight through this gateway, or the engine's own running +
    /// waiting count when scraped and larger (it also sees other gateways).
    Requests,
    /// Sessions plus requests: where work is committed and where it queues.
    Combined,
}

impl LoadMeasure {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "sessions" => LoadMeasure::Sessions,
            "requests" => LoadMeasure::Requests,
            "combined" => LoadMeasure::Combined,
            _ => return None,
        })
    }

    /// `c`'s load, given its live bindings.
    pub fn of(self, c: &Candidate, bindings: u64) -> u64 {
        let requests = c.in_flight.max(c.engine_requests);
        let sessions = bindings + c.probation;
        match self {
            LoadMeasure::Sessions => sessions,
            LoadMeasure::Requests => requests,
            LoadMeasure::Combined => sessions + requests,
        }
    }
}

/// Which algorithm places first turns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstKind {
    BoundedHrw,
    Hrw,
    LeastLoaded,
    RoundRobin,
}

impl FirstKind {
    pub const NAMES: &'static str = "bounded_hrw | hrw | least_loaded | round_robin";

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "bounded_hrw" => FirstKind::BoundedHrw,
            "hrw" => FirstKind::Hrw,
            "least_loaded" => FirstKind::LeastLoaded,
            "round_robin" => FirstKind::RoundRobin,
            _ => return None,
        })
    }
}

/// The algorithm `kind` names; `bounded` holds bounded HRW's settings.
pub fn build(kind: FirstKind, bounded: bounded_hrw::BoundedHrw) -> Box<dyn FirstPlacement> {
    match kind {
        FirstKind::BoundedHrw => Box::new(bounded),
        FirstKind::Hrw => Box::new(hrw::Hrw),
        FirstKind::LeastLoaded => Box::new(least_loaded::LeastLoaded),
        FirstKind::RoundRobin => Box::new(round_robin::RoundRobin::default()),
    }
}

#[cfg(test)]
pub(crate) mod testing {
    use crate::affinity::candidate::Candidate;

    pub fn open(n: u32) -> Vec<Candidate> {
        (0..n)
            .map(|slot| Candidate {
                slot,
                seed: crate::affinity::hrw::mix(0x5eed ^ slot as u64),
                weight: 1,
                ..Default::default()
            })
            .collect()
    }
}
