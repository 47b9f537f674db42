//! Single-flight: the first request of a session places it, and the
//! session's other requests wait until that placement is real — the first
//! request reached its backend ([`crate::affinity::Lease::confirm`]) — or
//! given up (its lease dropped unconfirmed), then follow it or choose
//! afresh. The binding's pending state lives in the table; the waiting and
//! the waking live here.

use super::route::{Choice, Selection};
use super::table::BindingKey;
use std::time::Duration;
use tokio::sync::Notify;

const WAITER_SHARDS: usize = 64;

/// Why a wait for a placement ([`wait_for`]) returned without a selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitEnd {
    /// `candidates` was empty.
    NoCandidate,
    /// The client closed its connection while the request waited.
    ClientGone,
}

/// Where requests wait for a session's pending placement: a few shards of
/// wake-ups, keyed by the session.
pub struct Waiters {
    shards: Box<[Notify]>,
}

impl Default for Waiters {
    fn default() -> Self {
        Waiters {
            shards: (0..WAITER_SHARDS).map(|_| Notify::new()).collect(),
        }
    }
}

impl Waiters {
    /// Notified when a pending binding of `key` (or one sharing its shard)
    /// is confirmed or abandoned.
    pub fn of(&self, key: BindingKey) -> &Notify {
        &self.shards[(key as usize) % WAITER_SHARDS]
    }

    pub fn wake(&self, key: BindingKey) {
        self.of(key).notify_waiters();
    }
}

/// `select(join)`, waiting (at most `wait`) while another request of session
/// `key` is placing it: single-flight. Nearly every request is decided at
/// once; only one that has to wait registers as a waiter and reads the
/// clock. Out of patience, it follows the pending placement (`join`).
/// `client_gone` is polled while waiting; when it says the client left, the
/// wait ends with [`WaitEnd::ClientGone`].
pub async fn wait_for(
    waiters: &Waiters,
    key: BindingKey,
    owner: bool,
    wait: Duration,
    client_gone: impl Fn() -> bool,
    mut select: impl FnMut(bool) -> Option<Choice>,
) -> Result<Selection, WaitEnd> {
    let mut join = owner;
    match select(join) {
        Some(Choice::Go(sel)) => return Ok(sel),
        Some(Choice::Wait) => {}
        None => return Err(WaitEnd::NoCandidate),
    }
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let notified = waiters.of(key).notified();
        tokio::pin!(notified);
        // Register before asking, so a confirmation in between is not missed.
        notified.as_mut().enable();
        match select(join) {
            Some(Choice::Go(sel)) => return Ok(sel),
            Some(Choice::Wait) => {}
            None => return Err(WaitEnd::NoCandidate),
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            join = true;
            continue;
        }
        let poll = Duration::from_millis(25).min(deadline - now);
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(poll) => {
                if client_gone() {
                    return Err(WaitEnd::ClientGone);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::hrw::{HrwHasher, KeyKind};
    use super::super::tests::{fleet, go};
    use super::super::{Affinity, Candidate, Reason, SessionRef};
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    #[test]
    fn concurrent_first_requests_wait_for_the_first_placement() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let Some(Choice::Go(mut first)) = a.select_backend(&s, 0, &c, false) else {
            panic!("first request places the session");
        };
        assert!(matches!(
            a.select_backend(&s, 0, &c, false),
            Some(Choice::Wait)
        ));
        first.lease.as_mut().unwrap().confirm();
        let second = go(&a, &s, &c);
        assert!(second.affinity_hit);
        assert_eq!(second.backend, first.backend);
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiting_request_follows_the_first_placement_once_it_is_confirmed() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let wait = Duration::from_secs(3600);
        let mut first = a
            .select_waiting(&s, 0, &c, false, wait, || false)
            .await
            .expect("the first request places the session");
        let polls = Arc::new(AtomicU64::new(0));
        let waiter = {
            let (a, s, c, polls) = (Arc::clone(&a), s.clone(), c.clone(), Arc::clone(&polls));
            tokio::spawn(async move {
                a.select_waiting(&s, 0, &c, false, wait, || {
                    polls.fetch_add(1, Ordering::Relaxed);
                    false
                })
                .await
            })
        };
        // The second request is parked until the first reaches its backend:
        // an hour of (paused) time later it is still waiting, and has been
        // checking on its client all along.
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(!waiter.is_finished());
        assert!(polls.load(Ordering::Relaxed) >= 10, "it waited in its loop");
        first.lease.as_mut().unwrap().confirm();
        let second = waiter.await.unwrap().expect("follows the placement");
        assert!(second.affinity_hit);
        assert_eq!(second.backend, first.backend);
    }

    #[tokio::test]
    async fn a_waiter_out_of_patience_joins_the_pending_placement_or_leaves_with_its_client() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let wait = Duration::from_millis(100);
        let first = a
            .select_waiting(&s, 0, &c, false, wait, || false)
            .await
            .unwrap();
        // Never confirmed: after `wait` the second request goes where the first went.
        let second = a
            .select_waiting(&s, 0, &c, false, wait, || false)
            .await
            .expect("joins after the wait");
        assert_eq!(second.backend, first.backend);
        // A client that leaves while waiting ends the wait.
        let third = a.select_waiting(&s, 0, &c, false, Duration::from_secs(60), || true);
        assert_eq!(third.await.unwrap_err(), WaitEnd::ClientGone);
        assert_eq!(
            a.select_waiting(&s, 0, &[], false, wait, || false)
                .await
                .unwrap_err(),
            WaitEnd::NoCandidate
        );
    }

    #[test]
    fn a_waiter_stops_waiting_when_the_pending_backend_is_no_longer_a_candidate() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let Some(Choice::Go(first)) = a.select_backend(&s, 0, &c, false) else {
            panic!("first request places the session");
        };
        // Its backend goes down while its first request is still connecting.
        let rest: Vec<Candidate> = c
            .iter()
            .filter(|x| x.slot != first.backend)
            .cloned()
            .collect();
        let Some(Choice::Go(second)) = a.select_backend(&s, 0, &rest, false) else {
            panic!("no point waiting for a backend that is gone");
        };
        assert_ne!(second.backend, first.backend);
        assert_eq!(second.reason, Reason::Broken);
        // The first request gives up: the second one's binding stays.
        let (first_backend, second_backend) = (first.backend, second.backend);
        drop(first);
        let mut second = second;
        second.lease.as_mut().unwrap().confirm();
        drop(second);
        let third = go(&a, &s, &rest);
        assert!(third.affinity_hit);
        assert_eq!(third.backend, second_backend);
        assert_ne!(third.backend, first_backend);
    }

    #[test]
    fn an_abandoned_first_placement_lets_the_next_request_choose() {
        let h = HrwHasher::new("k");
        let a = Affinity::new(1000, Some(Duration::from_secs(60)));
        let c = fleet(&h, 3);
        let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
        let Some(Choice::Go(first)) = a.select_backend(&s, 0, &c, false) else {
            panic!();
        };
        drop(first); // client gone before the backend was reached
        assert!(a.table.is_empty());
        let next = go(&a, &s, &c);
        assert_eq!(next.reason, Reason::FirstTurn);
    }
}
