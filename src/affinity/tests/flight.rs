use super::super::flight::*;
use super::super::hrw::{HrwHasher, KeyKind};
use super::super::{Affinity, Candidate, Choice, Reason, SessionRef};
use super::{fleet, go};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

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
