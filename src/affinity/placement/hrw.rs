//! Plain rendezvous hashing: the session's top-scoring backend, load-blind.

use super::first::FirstPlacement;
use crate::affinity::candidate::Candidate;
use crate::affinity::hrw;

pub struct Hrw;

impl FirstPlacement for Hrw {
    fn place(&self, session: u64, open: &[Candidate], _load: &[u64]) -> Option<usize> {
        hrw::choose(session, open)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affinity::placement::testing::open;

    #[test]
    fn ignores_load() {
        let o = open(3);
        let top = hrw::choose(7, &o).unwrap();
        let mut load = vec![0; 3];
        load[top] = 1_000;
        assert_eq!(Hrw.place(7, &o, &load), Some(top));
    }
}
