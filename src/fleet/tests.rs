//! The store's invariant, rule by rule, against the real Redis these
//! machines run on 127.0.0.1:6379 (each test under its own key prefix).
use super::bindings::*;
use super::store::{SharedStore, StoreConfig, StoreKind, StoreTls, Stored, StoredMoves};
use crate::affinity::shared::TierBackends;
use crate::affinity::{Affinity, Binding};
use std::sync::Arc;
use std::time::Duration;

struct TestTier(Vec<&'static str>);

impl TierBackends for TestTier {
    fn name(&self) -> &str {
        "default"
    }
    fn index(&self) -> u16 {
        0
    }
    fn backend_id(&self, slot: u32) -> Option<&str> {
        self.0.get(slot as usize).copied()
    }
    fn backend_slot(&self, id: &str) -> Option<u32> {
        self.0.iter().position(|b| *b == id).map(|i| i as u32)
    }
}

async fn store(test: &str) -> Arc<SharedStore> {
    let cfg = StoreConfig {
        kind: StoreKind::Redis,
        url: "redis://127.0.0.1:6379".into(),
        key_prefix: format!("agw-unit-{test}-{}:", std::process::id()),
        timeout: Duration::from_secs(2),
        revalidate: Duration::from_secs(60),
        tls: StoreTls::default(),
        required: false,
        heartbeat: Duration::from_secs(5),
    };
    let s = SharedStore::new(cfg, Arc::new(crate::metrics::Metrics::new())).unwrap();
    assert!(
        s.connect().await && s.ping().await,
        "Redis on 127.0.0.1:6379 (scripts/setup.sh installs it)"
    );
    s
}

fn stored(version: u32, backend: &str) -> Stored {
    Stored {
        version,
        backend: backend.into(),
        moves: StoredMoves::default(),
    }
}

/// A router holding `key` at `version` on `slot`, and what the store says.
async fn setup(
    test: &str,
    version: u32,
    slot: u32,
    in_store: Option<Stored>,
) -> (Arc<Affinity>, Arc<SharedStore>, Binding) {
    let a = Affinity::new(100, Some(Duration::from_secs(600)));
    let local = Binding {
        backend: slot,
        version,
        deadline_ms: a.now_ms() + 600_000,
        ..Binding::default()
    };
    assert!(a.adopt(7, local, false, a.now_ms()));
    let s = store(test).await;
    s.delete(7, None).await.unwrap();
    if let Some(v) = in_store {
        assert_eq!(s.create(7, "default", &v, 600_000).await.unwrap(), None);
    }
    (a, s, local)
}

const TIER: &[&str] = &["b0", "b1", "b2"];

#[tokio::test]
async fn a_newer_local_binding_is_written_over_an_older_stored_one() {
    let (a, s, local) = setup("newer-local", 2, 1, Some(stored(1, "b0"))).await;
    let known = InStore::Found(s.peek(7).await.unwrap().unwrap());
    let tier = TestTier(TIER.to_vec());
    assert_eq!(
        reconcile(&*a, &s, 7, &tier, local, known).await.unwrap(),
        None
    );
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(2, "b1")));
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((1, 2)));
    assert!(a.synced_ms(7).is_some_and(|t| t > 0), "in step now");
}

#[tokio::test]
async fn an_older_local_binding_takes_the_stored_one() {
    let (a, s, local) = setup("older-local", 1, 0, Some(stored(3, "b2"))).await;
    let known = InStore::Found(s.peek(7).await.unwrap().unwrap());
    let tier = TestTier(TIER.to_vec());
    assert_eq!(
        reconcile(&*a, &s, 7, &tier, local, known).await.unwrap(),
        Some(2)
    );
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((2, 3)));
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(3, "b2")), "untouched");
}

#[tokio::test]
async fn at_the_same_version_the_store_decided_the_race() {
    // Two gateways bound one new session at once: the store's wins.
    let (a, s, local) = setup("same-version", 1, 0, Some(stored(1, "b1"))).await;
    let tier = TestTier(TIER.to_vec());
    let r = reconcile(&*a, &s, 7, &tier, local, InStore::Absent).await;
    assert_eq!(
        r.unwrap(),
        Some(1),
        "create-if-absent answered with the store's"
    );
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((1, 1)));
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(1, "b1")));
}

#[tokio::test]
async fn a_stored_backend_this_gateway_lacks_is_neither_taken_nor_overwritten() {
    // Another gateway's reload added "b9" first.
    let (a, s, local) = setup("unknown-backend", 1, 0, Some(stored(5, "b9"))).await;
    let known = InStore::Found(s.peek(7).await.unwrap().unwrap());
    let tier = TestTier(TIER.to_vec());
    assert_eq!(
        reconcile(&*a, &s, 7, &tier, local, known).await.unwrap(),
        None
    );
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((0, 1)));
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(5, "b9")));
    assert!(a.synced_ms(7).is_some_and(|t| t > 0));
}

#[tokio::test]
async fn a_write_that_meets_a_newer_binding_takes_it() {
    // Ours is version 2, believed to be over an older copy; the store
    // meanwhile holds version 4 elsewhere: the compare-and-set refuses
    // and the newer binding is adopted.
    let (a, s, local) = setup("meets-newer", 2, 0, Some(stored(4, "b2"))).await;
    let tier = TestTier(TIER.to_vec());
    let r = reconcile(&*a, &s, 7, &tier, local, InStore::Older).await;
    assert_eq!(r.unwrap(), Some(2));
    assert_eq!(a.binding(7).map(|b| (b.backend, b.version)), Some((2, 4)));
    assert_eq!(s.peek(7).await.unwrap(), Some(stored(4, "b2")));
}

#[tokio::test]
async fn a_delete_leaves_a_newer_binding_and_takes_its_own() {
    let s = store("versioned-delete").await;
    s.delete(9, None).await.unwrap();
    assert_eq!(
        s.create(9, "default", &stored(3, "b1"), 600_000)
            .await
            .unwrap(),
        None
    );
    // A gateway forgetting its version 2 leaves the fleet's version 3.
    s.delete(9, Some((2, "b1"))).await.unwrap();
    assert_eq!(s.peek(9).await.unwrap(), Some(stored(3, "b1")));
    // A delete of version 3 on another backend is of a binding the session
    // had before it was bound anew (at version 3 again): this one stays.
    s.delete(9, Some((3, "b0"))).await.unwrap();
    assert_eq!(s.peek(9).await.unwrap(), Some(stored(3, "b1")));
    // Its own goes; the operator's delete takes any.
    s.delete(9, Some((3, "b1"))).await.unwrap();
    assert_eq!(s.peek(9).await.unwrap(), None);
    assert_eq!(
        s.create(9, "default", &stored(5, "b2"), 600_000)
            .await
            .unwrap(),
        None
    );
    s.delete(9, None).await.unwrap();
    assert_eq!(s.peek(9).await.unwrap(), None);
}

/// A seat in the fleet's queue at `backend`: class normal, weight 1, not
/// counted as prefilling.
fn normal_seat(backend: &str, id: u64, tenant: u64) -> crate::admission::fleet::Seat {
    crate::admission::fleet::Seat {
        backend: backend.into(),
        id,
        tenant,
        weight: 1,
        class: crate::admission::Class::Normal,
        counted: false,
        tokens: 0,
        idle_elsewhere: Vec::new(),
    }
}

/// Tenant 0xa's seat at `backend` counted as prefilling 1,000 tokens.
fn prefill_seat(backend: &str, id: u64) -> crate::admission::fleet::Seat {
    crate::admission::fleet::Seat {
        counted: true,
        tokens: 1000,
        ..normal_seat(backend, id, 0xa)
    }
}

/// A request about to be placed reads each backend as the fleet's queue
/// has it now: the fleet's counts, and the waiters its order would serve
/// before this request (by class, then its tenant's share when it came).
#[tokio::test]
async fn a_placement_read_counts_the_waiters_served_before_the_asker() {
    use crate::admission::fleet::{Ahead, Asker, Caps, FleetSlots, Handed, Placing, Seen};
    use crate::admission::Class;
    let s = store("placing").await;
    let caps = Caps {
        limit: 1,
        ..Default::default()
    };
    let (noisy, quiet) = (0xa, 0xb);
    let seat = |id, tenant| normal_seat("b0", id, tenant);
    // The noisy tenant runs one request at b0 and two wait; then the quiet
    // tenant's first waits.
    let (handed, _) = s.acquire(&seat(1, noisy), caps).await.unwrap();
    assert!(matches!(handed, Handed::Slot { .. }));
    for (id, tenant) in [(2, noisy), (3, noisy), (4, quiet)] {
        let (handed, _) = s.acquire(&seat(id, tenant), caps).await.unwrap();
        assert_eq!(handed, Handed::None);
    }
    let asker = |tenant, class| Asker {
        tenant,
        weight: 1,
        class,
    };
    let read = s
        .placing(&[("b0", 1), ("b1", 1)], &asker(quiet, Class::Normal), None)
        .await
        .unwrap();
    let idle = Placing {
        prefill: Ahead::default(),
        seen: Seen::default(),
        ahead: 0,
        claims: 0,
        full: false,
    };
    // The quiet tenant's next: behind its own first and the noisy
    // tenant's first waiter (which came when the noisy one ran one, as
    // the quiet one waits one now), not its second; nobody at b1.
    let busy = Seen {
        running: 1,
        waiting: 3,
    };
    assert_eq!(read.backends[0].seen, busy);
    assert_eq!(read.backends[0].ahead, 2);
    assert!(read.backends[0].full);
    assert_eq!(read.backends[1], idle);
    assert_eq!(read.claimed, None, "no claim asked for");
    let ahead = |tenant, class| {
        let s = Arc::clone(&s);
        async move {
            let who = asker(tenant, class);
            let read = s.placing(&[("b0", 1)], &who, None).await;
            read.unwrap().backends[0].ahead
        }
    };
    // The noisy tenant's next: behind all three; an interactive request:
    // behind none.
    assert_eq!(ahead(noisy, Class::Normal).await, 3);
    assert_eq!(ahead(noisy, Class::Interactive).await, 0);
    // A tenant with nothing there: behind the quiet tenant's first only,
    // which came when its tenant had nothing there either.
    assert_eq!(ahead(0xc, Class::Normal).await, 1);
}

/// Requests placed one after another, each before the last has joined the
/// queue, see each other's claims: with no room anywhere they spread
/// instead of all taking the backend that looked least queued; a seat
/// asking for its slot takes its claim back.
#[tokio::test]
async fn placement_claims_spread_a_burst_placed_before_any_has_queued() {
    use crate::admission::fleet::{Asker, Caps, FleetSlots, Handed};
    use crate::admission::Class;
    let s = store("claims").await;
    let caps = Caps {
        limit: 1,
        ..Default::default()
    };
    let seat = |backend, id| normal_seat(backend, id, 0xa);
    // Every backend runs one (its limit); b0 has one waiter, b1 and b2 two.
    let mut id = 100;
    for (backend, n) in [("b0", 2), ("b1", 3), ("b2", 3)] {
        for _ in 0..n {
            id += 1;
            s.acquire(&seat(backend, id), caps).await.unwrap();
        }
    }
    // A burst of that tenant's new conversations.
    let burst = Asker {
        tenant: 0xa,
        weight: 1,
        class: Class::Normal,
    };
    let backends = [("b0", 1), ("b1", 1), ("b2", 1)];
    let mut went = Vec::new();
    for claim in 1..=6 {
        let read = s.placing(&backends, &burst, Some(claim)).await.unwrap();
        went.push(read.claimed.expect("no room anywhere: the read decides"));
    }
    // Without claims all six would read b0 as least queued (1 ahead
    // against 2). With them: b0 until it has as many ahead as the others,
    // then the least in turn, ties to the first asked.
    assert_eq!(went, [0, 0, 1, 2, 0, 1]);
    let read = s.placing(&backends, &burst, None).await.unwrap();
    assert_eq!(read.backends[0].claims, 3);
    assert_eq!(read.backends[0].ahead, 4);
    // The first claim's seat asks for its slot at b0: its claim becomes
    // its place in the queue, not a second one.
    let (handed, seen) = s.acquire(&seat("b0", 1), caps).await.unwrap();
    assert_eq!(handed, Handed::None);
    assert_eq!(seen.waiting, 2);
    let read = s.placing(&backends, &burst, None).await.unwrap();
    assert_eq!((read.backends[0].claims, read.backends[0].ahead), (2, 4));
    // With one backend's room left, the read claims it; a second read
    // finds none there.
    let read = s.placing(&[("b3", 1), ("b1", 1)], &burst, Some(7)).await;
    assert_eq!(read.unwrap().claimed, Some(0));
    let read = s.placing(&[("b3", 1)], &burst, None).await.unwrap();
    assert!(read.backends[0].full, "its one slot is claimed");
}

/// Two gateways' votes on how prefills run at one engine make one tally,
/// and the cap in force for both follows it, whatever cap each learned
/// alone: one gateway's stray "side by side" flips no more than it would
/// for a lone gateway that had seen both gateways' answers.
#[tokio::test]
async fn the_fleets_votes_on_prefills_are_one_tally_that_sets_every_gateways_cap() {
    use crate::admission::fleet::{CapSource, Caps, FleetSlots, Handed};
    use crate::admission::learn::{SERIAL_VOTES, VOTES_MAX};
    let (a, b) = (store("tally").await, store("tally").await);
    // The tally starts one vote further from "side by side" than a lone
    // gateway's first vote does; votes from either gateway count on it,
    // within its bounds.
    assert_eq!(a.vote("b0", false).await.unwrap(), SERIAL_VOTES);
    assert_eq!(b.vote("b0", true).await.unwrap(), SERIAL_VOTES + 1);
    for _ in 0..3 {
        a.vote("b0", true).await.unwrap();
    }
    assert_eq!(b.vote("b0", false).await.unwrap(), VOTES_MAX - 1);
    // Gateway b learned alone that prefills run side by side (no cap), and
    // says so: the tally says they queue, and b's second prefill waits.
    let side_by_side = Caps {
        limit: 8,
        prefilling: 0,
        cap_source: CapSource::Voted,
    };
    let seat = |id| prefill_seat("b0", id);
    let (first, _) = b.acquire(&seat(1), side_by_side).await.unwrap();
    assert!(matches!(first, Handed::Slot { .. }));
    // A cap of one lets one probe by (its answer votes), and no more.
    let (second, _) = b.acquire(&seat(2), side_by_side).await.unwrap();
    assert!(matches!(second, Handed::Probe { .. }), "{second:?}");
    let (third, _) = b.acquire(&seat(3), side_by_side).await.unwrap();
    assert_eq!(
        third,
        Handed::None,
        "one prefill at a time, as the fleet voted"
    );
    // Votes that they run side by side bring the tally under the line:
    // no cap for anyone, so the waiter goes at the next call.
    while a.vote("b0", false).await.unwrap() >= SERIAL_VOTES {}
    let (third, _) = b.take(&seat(3), side_by_side).await.unwrap();
    assert!(matches!(third, Handed::Slot { .. }), "{third:?}");
}

/// Two gateways place new conversations at once, each on the backend its
/// read found idle: the one that asks second, finding the other's prefill
/// started there since its read while another backend is still idle,
/// takes neither slot nor place (it is placed again). Served as ever: one
/// whose read already counted that prefill, one whose own gateway's
/// prefill it is, and one with no idle backend left to go to.
#[tokio::test]
async fn a_new_conversation_raced_to_an_idle_backend_takes_no_slot_there() {
    use crate::admission::fleet::{Ahead, Asker, Caps, FleetSlots, Handed, Seat};
    use crate::admission::Class;
    let (a, b) = (store("raced").await, store("raced").await);
    let caps = Caps {
        limit: 4,
        ..Default::default()
    };
    let asker = Asker {
        tenant: 0xa,
        weight: 1,
        class: Class::Normal,
    };
    let seat = |backend: &str, id, idle: &[&str]| Seat {
        idle_elsewhere: idle.iter().map(|b| (*b).into()).collect(),
        ..prefill_seat(backend, id)
    };
    // Both read b0 and b1 idle; a's conversation asks first and starts at b0.
    for s in [&a, &b] {
        let read = s
            .placing(&[("b0", 4), ("b1", 4)], &asker, None)
            .await
            .unwrap();
        assert_eq!(read.backends[0].prefill, Ahead::default());
    }
    let (first, _) = a.acquire(&seat("b0", 1, &["b1"]), caps).await.unwrap();
    assert!(matches!(first, Handed::Slot { .. }), "{first:?}");
    // a's own prefill there races none of a's.
    let (own, _) = a.acquire(&seat("b0", 2, &["b1"]), caps).await.unwrap();
    assert_eq!(
        own,
        Handed::Slot {
            ahead: Ahead::default()
        }
    );
    // b's finds a's prefill at b0, b1 still idle: no slot, nothing counted.
    let (second, seen) = b.acquire(&seat("b0", 3, &["b1"]), caps).await.unwrap();
    let Handed::Raced { ahead } = second else {
        panic!("raced, not {second:?}");
    };
    assert_eq!(ahead.tokens, 2000);
    assert_eq!((seen.running, seen.waiting), (2, 0));
    let read = b.placing(&[("b0", 4)], &asker, None).await.unwrap();
    assert_eq!(read.backends[0].seen.running, 2, "only a's requests run");
    // Placed on a read that saw a's prefill, it is served beside it.
    let (third, _) = b.acquire(&seat("b0", 4, &[]), caps).await.unwrap();
    assert!(
        matches!(third, Handed::Slot { ahead } if ahead.tokens == 2000),
        "{third:?}"
    );
    // Once b1 is busy too, there is nowhere better: served where placed.
    let (busy, _) = a.acquire(&seat("b1", 5, &[]), caps).await.unwrap();
    assert!(matches!(busy, Handed::Slot { .. }), "{busy:?}");
    let (fourth, _) = b.acquire(&seat("b0", 6, &["b1"]), caps).await.unwrap();
    assert!(matches!(fourth, Handed::Slot { .. }), "{fourth:?}");
}

/// Before the fleet's first vote on prefills at an engine, one probe is
/// out at a time over the fleet, as for a lone gateway: a second goes only
/// once the first one's request has ended (and voted), however long ago
/// the first went. A probe a second while the first probes' answers were
/// still coming sent a burst in two prefills at a time.
#[tokio::test]
async fn one_probe_is_out_at_a_time_over_the_fleet() {
    use crate::admission::fleet::{CapSource, Caps, Ended, FleetSlots, Handed};
    let (a, b) = (store("probe-out").await, store("probe-out").await);
    let caps = Caps {
        limit: 8,
        prefilling: 1,
        cap_source: CapSource::Unvoted,
    };
    let seat = |id| prefill_seat("b0", id);
    let (first, _) = a.acquire(&seat(1), caps).await.unwrap();
    assert!(matches!(first, Handed::Slot { .. }), "{first:?}");
    let (probe, _) = b.acquire(&seat(2), caps).await.unwrap();
    assert!(matches!(probe, Handed::Probe { .. }), "{probe:?}");
    // The probe's prefill is over, its answer still coming; a's first
    // request still prefills. Long after the probe went (its time
    // forgotten), another request comes: it waits.
    let ended = |ran, probe| Ended {
        ran,
        prefilling: !ran,
        tokens: 1000,
        probe,
    };
    b.release("b0", 0xa, ended(false, false), caps)
        .await
        .unwrap();
    let probed_at = format!("{}adm:b0:p", a.config().key_prefix);
    let mut c = redis::Client::open("redis://127.0.0.1:6379")
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    redis::cmd("DEL")
        .arg(&probed_at)
        .query_async::<()>(&mut c)
        .await
        .unwrap();
    let (third, seen) = a.acquire(&seat(3), caps).await.unwrap();
    assert_eq!(third, Handed::None, "a probe is still out");
    assert_eq!(seen.waiting, 1);
    // The probe's request ends: the waiter goes as the next probe.
    b.release("b0", 0xa, ended(true, true), caps).await.unwrap();
    let (third, _) = a.take(&seat(3), caps).await.unwrap();
    assert!(matches!(third, Handed::Probe { .. }), "{third:?}");
}
