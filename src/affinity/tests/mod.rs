//! The router's unit tests, and those of its parts that need the router
//! itself (single-flight).

mod flight;

use super::*;
use hrw::{HrwHasher, KeyKind};

/// Select as a dispatched request would: confirm the binding.
pub(super) fn go(a: &Arc<Affinity>, s: &SessionRef, c: &[Candidate]) -> Selection {
    match a.select_backend(s, 0, c, false) {
        Some(Choice::Go(mut sel)) => {
            if let Some(l) = sel.lease.as_mut() {
                l.confirm();
            }
            sel
        }
        other => panic!("expected a selection, got {other:?}"),
    }
}

pub(super) fn fleet(h: &HrwHasher, n: u32) -> Vec<Candidate> {
    (0..n)
        .map(|i| Candidate {
            slot: i,
            seed: h.backend_seed(&format!("b{i}")),
            weight: 1,
            ..Default::default()
        })
        .collect()
}

#[test]
fn a_fork_on_probation_goes_where_it_came_from_unless_that_is_over_its_bound() {
    let h = HrwHasher::new("k");
    let a = Affinity::new(1000, Some(Duration::from_secs(60)));
    let c = fleet(&h, 3);
    for i in 0..12 {
        let mut s = SessionRef::conversation(u128::from(i as u32) << 64 | 7);
        s.probation = true;
        let elsewhere = go(&a, &s, &c).backend;
        // The same conversation as a fork of one on another backend.
        s.forked_at = Some((elsewhere + 1) % 3);
        assert_eq!(go(&a, &s, &c).backend, (elsewhere + 1) % 3, "{i}");
    }
    // A backend over its bound takes no fork: 9 sessions bound there.
    let only_0: Vec<_> = c.iter().copied().filter(|c| c.slot == 0).collect();
    for i in 0..9 {
        let s = SessionRef::new(&h, KeyKind::Session, "t", &format!("s{i}"));
        drop(go(&a, &s, &only_0).lease);
    }
    let mut fork = SessionRef::conversation(99);
    fork.probation = true;
    fork.forked_at = Some(0);
    assert_ne!(go(&a, &fork, &c).backend, 0);
}

#[test]
fn with_no_room_anywhere_a_new_conversation_goes_where_fewest_wait_ahead_of_it() {
    let h = HrwHasher::new("k");
    let a = Affinity::new(1000, Some(Duration::from_secs(60)));
    let mut c = fleet(&h, 3);
    for (c, ahead) in c.iter_mut().zip([1, 0, 1]) {
        (c.full, c.ahead) = (true, ahead);
    }
    for i in 0..12 {
        let s = SessionRef::new(&h, KeyKind::Session, "t", &format!("s{i}"));
        assert_eq!(go(&a, &s, &c).backend, 1, "{i}");
    }
    // One with room still wins over every full one.
    c[2].full = false;
    let s = SessionRef::new(&h, KeyKind::Session, "t", "late");
    assert_eq!(go(&a, &s, &c).backend, 2);
}

#[test]
fn first_turn_misses_then_hits() {
    let h = HrwHasher::new("k");
    let a = Affinity::new(1000, Some(Duration::from_secs(60)));
    let c = fleet(&h, 3);
    let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
    let first = go(&a, &s, &c);
    assert!(!first.affinity_hit);
    assert_eq!(first.reason, Reason::FirstTurn);
    drop(first.lease);
    let second = go(&a, &s, &c);
    assert!(second.affinity_hit);
    assert_eq!(second.backend, first.backend);
}

#[test]
fn binding_beats_hrw_while_its_backend_is_a_candidate() {
    let h = HrwHasher::new("k");
    let a = Affinity::new(1000, Some(Duration::from_secs(60)));
    let all = fleet(&h, 4);
    let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
    let winner = go(&a, &s, &all).backend;
    // Bind while the winner is down...
    let without: Vec<_> = all.iter().copied().filter(|c| c.slot != winner).collect();
    let rebound = go(&a, &s, &without);
    assert_eq!(rebound.reason, Reason::Broken);
    assert_ne!(rebound.backend, winner);
    assert_eq!(rebound.version, 2);
    // ...and the binding holds after the winner comes back: no flapping.
    let back = go(&a, &s, &all);
    assert!(back.affinity_hit);
    assert_eq!(back.backend, rebound.backend);
}

#[test]
fn draining_takes_no_new_sessions_and_soft_mode_moves_off_it() {
    let h = HrwHasher::new("k");
    let a = Affinity::new(1000, Some(Duration::from_secs(60)));
    let mut c = fleet(&h, 3);
    let sessions: Vec<SessionRef> = (0..30)
        .map(|i| SessionRef::new(&h, KeyKind::Session, "t", &format!("s{i}")))
        .collect();
    let placed: Vec<u32> = sessions.iter().map(|s| go(&a, s, &c).backend).collect();
    c[0].draining = true;
    // Hard mode: existing sessions stay, new ones avoid the draining backend.
    for (s, &b) in sessions.iter().zip(&placed) {
        assert_eq!(go(&a, s, &c).backend, b);
    }
    for i in 0..30 {
        let s = SessionRef::new(&h, KeyKind::Session, "t", &format!("new{i}"));
        assert_ne!(go(&a, &s, &c).backend, 0);
    }
    // Soft mode: sessions on the draining backend move, counted as moves.
    a.set_policy(DefaultPolicy {
        mode: policy::Mode::Soft,
        ..DefaultPolicy::hard()
    });
    for (s, &b) in sessions.iter().zip(&placed) {
        let sel = go(&a, s, &c);
        if b == 0 {
            assert_eq!(sel.reason, Reason::Moved);
            assert_eq!(sel.moved, Some(MoveReason::Drain));
            assert_ne!(sel.backend, 0);
        } else {
            assert!(sel.affinity_hit);
        }
    }
}

/// A table whose bindings the cost-aware soft policy reviews.
fn cost_aware() -> Arc<Affinity> {
    let a = Affinity::new(1000, Some(Duration::from_secs(60)));
    a.set_policy(DefaultPolicy {
        mode: policy::Mode::Soft,
        soft: policy::SoftPolicy::Cost,
        soft_max_in_flight: 0,
        cost: policy::CostParams::default(),
    });
    a
}

#[test]
fn cost_moves_off_one_backend_are_spaced_not_a_herd() {
    let h = HrwHasher::new("k");
    let a = cost_aware();
    let mut c = fleet(&h, 2);
    let sessions: Vec<SessionRef> = (0..4)
        .map(|i| SessionRef::new(&h, KeyKind::Session, "t", &format!("s{i}")))
        .collect();
    for s in &sessions {
        // Placed while backend 0 was the only one; nothing cached there.
        drop(go(&a, s, &c[..1]));
        a.record_usage(s.key, 1000, Some(0));
    }
    // Backend 0 now has 2 s of prefill queued (20,000 tokens at the
    // 100 µs prior), backend 1 nothing: each session alone would leave,
    // but reviewed at the same moment only one may.
    c[0].queued_tokens = 20_000;
    let moves = |sessions: &[SessionRef]| -> Vec<u32> {
        sessions
            .iter()
            .map(|s| go(&a, s, &c))
            .filter(|sel| sel.reason == Reason::Moved)
            .map(|sel| sel.backend)
            .collect()
    };
    // The clock stands still: on a busy machine the reviews of one
    // moment could otherwise span the gap.
    a.frozen_ms.store(10_000, Ordering::Relaxed);
    assert_eq!(moves(&sessions), vec![1]);
    // Just short of the gap: still none; at the gap, one more.
    a.frozen_ms
        .store(10_000 + policy::MOVE_GAP_MS - 1, Ordering::Relaxed);
    assert_eq!(moves(&sessions[1..]), Vec::<u32>::new());
    a.frozen_ms
        .store(10_000 + policy::MOVE_GAP_MS, Ordering::Relaxed);
    assert_eq!(moves(&sessions[1..]), vec![1]);
}

#[test]
fn a_cost_move_goes_where_the_turn_starts_soonest() {
    let h = HrwHasher::new("k");
    let a = cost_aware();
    let mut c = fleet(&h, 3);
    // A session whose hash, between backends 1 and 2, prefers 1: where
    // first placement would send it.
    let s = (0..)
        .map(|i| SessionRef::new(&h, KeyKind::Session, "t", &format!("s{i}")))
        .find(|s| hrw::choose(s.hash, &c[1..]) == Some(0))
        .unwrap();
    drop(go(&a, &s, &c[..1]));
    a.record_usage(s.key, 1000, Some(0));
    // Backend 0 has 2 s of prefill queued, backend 1 1 s, backend 2 none.
    c[0].queued_tokens = 20_000;
    c[1].queued_tokens = 10_000;
    let sel = go(&a, &s, &c);
    assert_eq!(sel.moved, Some(MoveReason::Cost));
    assert_eq!(sel.backend, 2, "the backend its ΔQ was weighed against");
}

#[test]
fn a_session_leaves_a_backend_that_fails_it_though_it_may_not_be_ejected() {
    let h = HrwHasher::new("k");
    let a = Affinity::new(1000, Some(Duration::from_secs(60)));
    let mut c = fleet(&h, 3);
    let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
    let home = go(&a, &s, &c).backend;
    // Two of three fail every request; the cap keeps one of them in.
    for x in c.iter_mut().filter(|x| x.slot != 2) {
        x.failing = true;
    }
    let sel = go(&a, &s, &c);
    if home == 2 {
        assert!(sel.affinity_hit, "its backend works: it stays");
    } else {
        assert_eq!(sel.reason, Reason::Broken);
        assert_eq!(sel.backend, 2, "to the backend that works");
    }
    // New sessions go where requests work, too.
    for i in 0..20 {
        let n = SessionRef::new(&h, KeyKind::Session, "t", &format!("new{i}"));
        assert_eq!(go(&a, &n, &c).backend, 2);
    }
    // With every backend failing, nothing moves (nowhere better).
    c[2].failing = true;
    assert!(go(&a, &s, &c).affinity_hit);
}

#[test]
fn ttl_zero_stores_nothing() {
    let h = HrwHasher::new("k");
    let a = Affinity::new(1000, None);
    let c = fleet(&h, 3);
    let s = SessionRef::new(&h, KeyKind::Session, "t", "s1");
    for _ in 0..3 {
        let sel = go(&a, &s, &c);
        assert!(!sel.affinity_hit);
        assert_eq!(sel.reason, Reason::Disabled);
    }
    assert!(a.table.is_empty());
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
        let p = go(&a, &parent, &c);
        group.parent = Some(parent.key);
        let g = go(&a, &group, &c);
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
    assert!(a.select_backend(&s, 0, &[], false).is_none());
    assert!(a.table.is_empty());
}
