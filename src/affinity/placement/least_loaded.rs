//! The least loaded backend (load per unit of weight); ties go to the
//! session's HRW order, so equal fleets still spread by hash.

use super::first::FirstPlacement;
use crate::affinity::candidate::Candidate;
use crate::affinity::hrw;

pub struct LeastLoaded;

impl FirstPlacement for LeastLoaded {
    fn place(&self, session: u64, open: &[Candidate], load: &[u64]) -> Option<usize> {
        let per_weight = |i: usize| load[i] as f64 / open[i].weight.max(1) as f64;
        let min = (0..open.len()).map(per_weight).min_by(f64::total_cmp)?;
        hrw::choose_where(session, open, |i| per_weight(i) <= min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affinity::placement::testing::open;

    #[test]
    fn takes_the_least_loaded_and_breaks_ties_by_hash() {
        let o = open(3);
        assert_eq!(LeastLoaded.place(1, &o, &[5, 2, 9]), Some(1));
        assert_eq!(LeastLoaded.place(1, &o, &[0, 0, 0]), hrw::choose(1, &o));
        let mut heavy = o.clone();
        heavy[0].weight = 4;
        // 8 per 4 units of weight is less than 3 per 1.
        assert_eq!(LeastLoaded.place(1, &heavy, &[8, 3, 3]), Some(0));
    }
}
