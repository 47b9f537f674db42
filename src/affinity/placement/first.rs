//! The one trait every first-placement algorithm implements.

use crate::affinity::candidate::Candidate;

/// A first-placement algorithm.
pub trait FirstPlacement: Send + Sync {
    /// Index into `open` for a session hashing to `session`; `load[i]` is
    /// `open[i]`'s load. `None` only when `open` is empty.
    fn place(&self, session: u64, open: &[Candidate], load: &[u64]) -> Option<usize>;

    /// Whether `open[i]` is already above what this algorithm itself may
    /// fill (its balance bound; algorithms without one never are). A
    /// subagent group leaves its parent's backend only for this.
    fn overloaded(&self, _i: usize, _open: &[Candidate], _load: &[u64]) -> bool {
        false
    }
}
