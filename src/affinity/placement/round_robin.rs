//! The next backend in turn, whatever its load or the session: the first
//! request of a "round robin + sticky table" proxy (HAProxy, nginx).

use super::first::FirstPlacement;
use crate::affinity::candidate::Candidate;
use std::sync::atomic::{AtomicUsize, Ordering};

#[derive(Default)]
pub struct RoundRobin {
    next: AtomicUsize,
}

impl FirstPlacement for RoundRobin {
    fn place(&self, _session: u64, open: &[Candidate], _load: &[u64]) -> Option<usize> {
        if open.is_empty() {
            return None;
        }
        Some(self.next.fetch_add(1, Ordering::Relaxed) % open.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affinity::placement::testing::open;

    #[test]
    fn cycles_through_the_open_backends() {
        let rr = RoundRobin::default();
        let o = open(3);
        let picks: Vec<_> = (0..6).map(|s| rr.place(s, &o, &[0; 3]).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        assert_eq!(rr.place(0, &[], &[]), None);
    }
}
