//! Session affinity: which backend a session's request goes to.
//!
//! [`Affinity::select_backend`] is the whole policy: look the session's binding
//! up; keep it while its backend is a candidate (a hit); otherwise choose by
//! keyed rendezvous hashing and bind (a miss, and "broken" when a binding to a
//! backend that is no longer a candidate was replaced). It needs no network, so
//! unit tests and benchmarks drive it directly.

pub mod hrw;
pub mod session;
pub mod table;

use hrw::{HrwHasher, KeyKind, Scored};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use table::{Acquired, BindingKey, BindingTable, Decision};

/// One backend a request may go to: healthy, in the tier, not excluded.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    /// Stable process-wide backend number (see `upstream::Slots`).
    pub slot: u32,
    pub seed: u64,
    pub weight: u32,
}

impl Scored for Candidate {
    fn seed(&self) -> u64 {
        self.seed
    }
    fn weight(&self) -> u32 {
        self.weight
    }
}

/// A session as the policy sees it.
#[derive(Clone, Debug)]
pub struct SessionRef {
    pub key: BindingKey,
    pub hash: u64,
    /// For a subagent group: the parent session's binding, whose backend the
    /// group's first request prefers (the children share the parent's prefix).
    pub parent: Option<BindingKey>,
}

impl SessionRef {
    pub fn new(hasher: &HrwHasher, kind: KeyKind, tier: &str, id: &str) -> Self {
        SessionRef {
            key: hasher.fingerprint(kind, tier, id),
            hash: hasher.session_hash(kind, tier, id),
            parent: None,
        }
    }
}

/// Why a request went where it went (the `reason` of `x_agent_serve`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// The live binding was used.
    Hit,
    /// No binding existed.
    FirstTurn,
    /// The binding had expired.
    Expired,
    /// The binding's backend was down, removed or failed: rebound.
    Broken,
    /// Affinity is off (TTL 0): hashed, not stored.
    Disabled,
    /// The table is full of in-flight bindings: served unpinned.
    TableFull,
    /// The request carried no session key.
    NoSession,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Hit => "hit",
            Reason::FirstTurn => "first_turn",
            Reason::Expired => "expired",
            Reason::Broken => "broken",
            Reason::Disabled => "affinity_disabled",
            Reason::TableFull => "table_full",
            Reason::NoSession => "no_session",
        }
    }
}

/// The outcome of [`Affinity::select_backend`].
#[derive(Debug)]
pub struct Selection {
    /// Index into the candidates slice.
    pub index: usize,
    pub backend: u32,
    pub affinity_hit: bool,
    pub reason: Reason,
    pub version: u32,
    /// Held while the request is in flight; dropping it ends the lease.
    pub lease: Option<Lease>,
}

/// The binding table plus the clock and TTL it is read with.
pub struct Affinity {
    table: BindingTable,
    epoch: Instant,
    /// 0 disables affinity.
    ttl_ms: AtomicU64,
}

impl Affinity {
    pub fn new(max_bindings: usize, ttl: Option<Duration>) -> Arc<Self> {
        Arc::new(Affinity {
            table: BindingTable::new(max_bindings),
            epoch: Instant::now(),
            ttl_ms: AtomicU64::new(ttl.map_or(0, |d| d.as_millis() as u64)),
        })
    }

    pub fn set_ttl(&self, ttl: Option<Duration>) {
        self.ttl_ms
            .store(ttl.map_or(0, |d| d.as_millis() as u64), Ordering::Relaxed);
    }

    pub fn ttl(&self) -> Option<Duration> {
        match self.ttl_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    pub fn table(&self) -> &BindingTable {
        &self.table
    }

    /// Milliseconds since this table was created: the clock deadlines use.
    pub fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Convert a table deadline to wall-clock time remaining.
    pub fn remaining(&self, deadline_ms: u64) -> Duration {
        Duration::from_millis(deadline_ms.saturating_sub(self.now_ms()))
    }

    /// Choose the backend for `session` among `candidates` and lease its binding.
    ///
    /// `candidates` are the tier's backends that may take this request now
    /// (healthy, not excluded by an earlier connect failure). `None` when there
    /// is no candidate.
    pub fn select_backend(
        self: &Arc<Self>,
        session: &SessionRef,
        tier: u16,
        candidates: &[Candidate],
    ) -> Option<Selection> {
        if candidates.is_empty() {
            return None;
        }
        let ttl_ms = self.ttl_ms.load(Ordering::Relaxed);
        if ttl_ms == 0 {
            let index = hrw::choose(session.hash, candidates)?;
            return Some(Selection {
                index,
                backend: candidates[index].slot,
                affinity_hit: false,
                reason: Reason::Disabled,
                version: 0,
                lease: None,
            });
        }
        let now = self.now_ms();
        let position = |slot: u32| candidates.iter().position(|c| c.slot == slot);
        // Read the parent's binding before locking our own shard: two shard
        // locks are never held at once.
        let preferred = session
            .parent
            .and_then(|p| self.table.get(p, now))
            .and_then(|b| position(b.backend));
        let fresh = || preferred.or_else(|| hrw::choose(session.hash, candidates));

        let acquired = self
            .table
            .acquire(session.key, tier, now, |current| match current {
                Some(c) if position(c.backend).is_some() => Decision::Keep,
                _ => match fresh() {
                    Some(i) => Decision::Bind(candidates[i].slot),
                    None => Decision::Skip,
                },
            });
        let lease = || {
            Some(Lease {
                affinity: Arc::clone(self),
                key: session.key,
            })
        };
        let (backend, affinity_hit, reason, version, lease) = match acquired {
            Acquired::Kept { backend, version } => (backend, true, Reason::Hit, version, lease()),
            Acquired::Bound {
                backend,
                version,
                previous,
                expired,
            } => {
                let reason = if previous.is_some() {
                    Reason::Broken
                } else if expired {
                    Reason::Expired
                } else {
                    Reason::FirstTurn
                };
                (backend, false, reason, version, lease())
            }
            Acquired::Full { backend } => (backend, false, Reason::TableFull, 0, None),
            Acquired::Skipped => return None,
        };
        Some(Selection {
            index: position(backend)?,
            backend,
            affinity_hit,
            reason,
            version,
            lease,
        })
    }

    /// Forget a session's binding (admin delete, `x-dynamo-session-final`).
    pub fn forget(&self, key: BindingKey) -> bool {
        self.table.remove(key).is_some()
    }

    /// Remove expired bindings; returns how many.
    pub fn sweep(&self) -> usize {
        self.table.sweep(self.now_ms(), 4096)
    }
}

/// A request's hold on its binding; released on drop, so a finished, failed or
/// abandoned request (client gone) all end the lease the same way.
pub struct Lease {
    affinity: Arc<Affinity>,
    key: BindingKey,
}

impl Lease {
    pub fn key(&self) -> BindingKey {
        self.key
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({:032x})", self.key)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let a = &self.affinity;
        a.table
            .release(self.key, a.now_ms(), a.ttl_ms.load(Ordering::Relaxed));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet(h: &HrwHasher, n: u32) -> Vec<Candidate> {
        (0..n)
            .map(|i| Candidate {
                slot: i,
                seed: h.backend_seed(&format!("b{i}")),
                weight: 1,
            })
            .collect()
    }

    #[test]
    fn first_turn_misses_then_hits() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let first = a.select_backend(&s, 0, &c).unwrap();
        assert!(!first.affinity_hit);
        assert_eq!(first.reason, Reason::FirstTurn);
        drop(first.lease);
        let second = a.select_backend(&s, 0, &c).unwrap();
        assert!(second.affinity_hit);
        assert_eq!(second.backend, first.backend);
    }

    #[test]
    fn binding_beats_hrw_while_its_backend_is_a_candidate() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let all = fleet(&h, 4);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let winner = a.select_backend(&s, 0, &all).unwrap().backend;
        // Bind while the winner is down...
        let without: Vec<_> = all.iter().copied().filter(|c| c.slot != winner).collect();
        let b = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let rebound = a.select_backend(&b, 0, &without).unwrap();
        assert_eq!(rebound.reason, Reason::Broken);
        assert_ne!(rebound.backend, winner);
        // ...and the binding holds after the winner comes back: no flapping.
        let back = a.select_backend(&b, 0, &all).unwrap();
        assert!(back.affinity_hit);
        assert_eq!(back.backend, rebound.backend);
    }

    #[test]
    fn ttl_zero_stores_nothing() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, None);
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        for _ in 0..3 {
            let sel = a.select_backend(&s, 0, &c).unwrap();
            assert!(!sel.affinity_hit);
            assert_eq!(sel.reason, Reason::Disabled);
        }
        assert!(a.table().is_empty());
    }

    #[test]
    fn group_prefers_parent_backend() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 8);
        // Find a parent whose HRW backend differs from its group's.
        for i in 0..100 {
            let parent = SessionRef::new(&h, KeyKind::Session, "t", &format!("p{i}"));
            let mut group = SessionRef::new(&h, KeyKind::Group, "t", &format!("p{i}"));
            if hrw::choose(parent.hash, &c) == hrw::choose(group.hash, &c) {
                continue;
            }
            let p = a.select_backend(&parent, 0, &c).unwrap();
            group.parent = Some(parent.key);
            let g = a.select_backend(&group, 0, &c).unwrap();
            assert_eq!(g.backend, p.backend);
            return;
        }
        panic!("no parent with a differing group placement found");
    }

    #[test]
    fn no_candidates_no_selection() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(10, Some(Duration::from_secs(1)));
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s");
        assert!(a.select_backend(&s, 0, &[]).is_none());
        assert!(a.table().is_empty());
    }
}
