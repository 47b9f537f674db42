//! First placement that sees load (bounded-load rendezvous hashing), against
//! real gateway and simulated-replica processes.

mod common;

use agent_gateway::affinity::hrw::{self, HrwHasher, KeyKind};
use common::*;
use serde_json::Value;
use std::collections::HashMap;

/// The gateway's plain-HRW choice among `ids` for a session, computed as it does.
fn hrw_top(session: &str, ids: &[&str]) -> usize {
    let h = HrwHasher::new(FLEET_KEY);
    let session = h.session_hash(KeyKind::Session, "default", session);
    hrw::choose(session, &hrw_candidates(ids)).unwrap()
}

/// Sessions whose plain-HRW backend would be `ids[want]`.
fn sessions_hashing_to(want: usize, ids: &[&str], n: usize, prefix: &str) -> Vec<String> {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .filter(|s| hrw_top(s, ids) == want)
        .take(n)
        .collect()
}

async fn first_turn(c: &reqwest::Client, gw: &Gateway, session: &str) -> String {
    let r = chat(
        c,
        gw,
        &[("x-session-id", session)],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 200);
    r.backend.expect("backend header")
}

const IDS: [&str; 3] = ["vllm-0", "vllm-1", "vllm-2"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_that_all_hash_to_one_backend_are_spread_within_the_bound() {
    let (_sims, gw) = fleet(3, &affinity_yaml(600)).await;
    let c = client();
    // Twelve sessions plain HRW would all put on vllm-0.
    let mut count: HashMap<String, usize> = HashMap::new();
    for s in sessions_hashing_to(0, &IDS, 12, "lumpy") {
        *count.entry(first_turn(&c, &gw, &s).await).or_default() += 1;
    }
    // Default bounded_hrw, factor 1: no backend above ⌈12 / 3⌉ = 4, so 4 each.
    assert!(count.values().all(|&n| n <= 4), "{count:?}");
    assert_eq!(count.values().sum::<usize>(), 12);
    // And the bindings gauge agrees with where they went.
    for (backend, n) in &count {
        let sample =
            format!("agentserve_backend_bindings{{backend=\"{backend}\",tier=\"default\"}}");
        wait_until("bindings gauge", || {
            let gw = &gw;
            let sample = sample.clone();
            async move { gw.metric(&sample).await as usize == *n }
        })
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_hrw_is_still_available_and_load_blind() {
    let (_sims, gw) = fleet(
        3,
        &format!("{}placement:\n  first: hrw\n", affinity_yaml(600)),
    )
    .await;
    let c = client();
    for s in sessions_hashing_to(0, &IDS, 6, "blind") {
        assert_eq!(first_turn(&c, &gw, &s).await, "vllm-0");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_back_from_the_dead_takes_new_sessions_first() {
    let (mut sims, gw) = fleet(3, &affinity_yaml(600)).await;
    let c = client();
    let old: Vec<String> = (0..20).map(|i| format!("old-{i}")).collect();
    for s in &old {
        first_turn(&c, &gw, s).await;
    }
    sims[2].kill();
    wait_until("vllm-2 marked down", || {
        let gw = &gw;
        async move {
            gw.metric("agentserve_backend_healthy{backend=\"vllm-2\",tier=\"default\"}")
                .await
                == 0.0
        }
    })
    .await;
    // Every old session's next turn rebinds off the dead replica.
    for s in &old {
        assert_ne!(first_turn(&c, &gw, s).await, "vllm-2");
    }
    sims[2].restart(&[]);
    wait_until("vllm-2 healthy again", || {
        let gw = &gw;
        async move {
            gw.metric("agentserve_backend_healthy{backend=\"vllm-2\",tier=\"default\"}")
                .await
                == 1.0
        }
    })
    .await;
    // 20 sessions levelled on two replicas (10 each), capacity ⌈21 / 3⌉ = 7:
    // both are full, so new sessions go to the empty one — whatever their
    // hash — until it is level: the others accept only once ⌈(21 + k) / 3⌉ > 10.
    for i in 0..10 {
        assert_eq!(first_turn(&c, &gw, &format!("new-{i}")).await, "vllm-2");
    }
    // No old session moved back just because its old replica returned.
    for s in &old {
        assert_ne!(first_turn(&c, &gw, s).await, "vllm-2");
    }
    let admin: Value = reqwest::get(gw.admin_url("/admin/backends"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let bindings = |id: &str| {
        admin["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["id"] == id)
            .unwrap()["bindings"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(bindings("vllm-2"), 10);
    assert_eq!(bindings("vllm-0") + bindings("vllm-1"), 20);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_prefills_slower_takes_fewer_new_sessions() {
    // Two replicas that prefill 20 µs a token; vllm-0 runs 3× slower.
    let args = ["--prefill-us-per-token", "20"];
    let sims = [
        SimBackend::start("vllm-0", &args),
        SimBackend::start("vllm-1", &args),
    ];
    sims[0]
        .set_faults(serde_json::json!({"slowdown": 3.0}))
        .await;
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!(
            "{FAST_HEALTH}{}  allow_explicit_target: true\nplacement:\n  speed_aware: true\n",
            affinity_yaml(600)
        ),
    )
    .await;
    let c = client();
    // Each answers 6 requests of ~1,000 new tokens, one at a time: the
    // gateway learns their prefill costs (3× apart).
    for (sim, i) in sims.iter().flat_map(|s| (0..6).map(move |i| (s, i))) {
        let mut body = chat_body("qwen3-8b", 0);
        body["messages"][1]["content"] =
            Value::from(format!("{}-{i} ", sim.id).repeat(4000 / (sim.id.len() + 3)));
        let r = chat(&c, &gw, &[("x-agent-serve-backend-id", &sim.id)], &body).await;
        assert_eq!(r.status, 200);
    }
    wait_until("both costs learned", || async {
        let backends = gw.admin_backends().await;
        backends
            .iter()
            .all(|b| b["learned"]["prefill_us_per_token"].is_number())
    })
    .await;
    // 20 sessions whose plain-HRW choice would be half each: the slow one,
    // a quarter of the capacity, gets at most ⌈21 / 4⌉ = 6.
    let mut count: HashMap<String, usize> = HashMap::new();
    for i in 0..20 {
        *count
            .entry(first_turn(&c, &gw, &format!("new-{i}")).await)
            .or_default() += 1;
    }
    let slow = count.get("vllm-0").copied().unwrap_or(0);
    // Fewer than its plain-HRW half, yet its quarter share: not none.
    assert!((3..=6).contains(&slow), "{count:?}");
    assert_eq!(count.values().sum::<usize>(), 20);
}

/// Two replicas that prefill one request at a time, 2 ms a token (the
/// operator's prior says so, so the queue's head is timed at the right pace),
/// and a 16 KB first turn (about 4,000 tokens, 8 s of prefill: seconds
/// however busy the machine) in flight at vllm-0, where its session hashes.
/// Returns once it is queued there, with the handle of its answer.
async fn a_long_prefill_at_vllm_0() -> (
    [SimBackend; 2],
    Gateway,
    tokio::task::JoinHandle<reqwest::Result<reqwest::Response>>,
) {
    let args = ["--prefill-us-per-token", "2000", "--serial-prefill"];
    let sims = [
        SimBackend::start("vllm-0", &args),
        SimBackend::start("vllm-1", &args),
    ];
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!(
            "{FAST_HEALTH}{}  prior_prefill_us_per_token: 2000\n",
            affinity_yaml(600)
        ),
    )
    .await;
    let long = sessions_hashing_to(0, &TWO, 1, "long").remove(0);
    let mut body = chat_body("qwen3-8b", 0);
    body["messages"][1]["content"] = Value::from("a long document ".repeat(1000));
    let long_turn = {
        let (c, url) = (client(), gw.url("/v1/chat/completions"));
        tokio::spawn(async move {
            c.post(url)
                .header("x-session-id", long)
                .json(&body)
                .send()
                .await
        })
    };
    wait_until("the long prefill is queued at vllm-0", || async {
        gw.queued_prefill_tokens("vllm-0").await > 0
    })
    .await;
    (sims, gw, long_turn)
}

const TWO: [&str; 2] = ["vllm-0", "vllm-1"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_turn_goes_where_no_long_prefill_queues_among_balanced_backends() {
    let (_sims, gw, long_turn) = a_long_prefill_at_vllm_0().await;
    let c = client();
    // The bound sends the next session to vllm-1 (vllm-0 holds the only one).
    let short = sessions_hashing_to(0, &TWO, 1, "short").remove(0);
    assert_eq!(first_turn(&c, &gw, &short).await, "vllm-1");
    // One session each: both are within the bound, and this session hashes
    // to vllm-0. It goes to vllm-1, where nothing queues, not behind the
    // long prefill.
    let probe = sessions_hashing_to(0, &TWO, 1, "probe").remove(0);
    assert_eq!(first_turn(&c, &gw, &probe).await, "vllm-1");
    assert!(
        gw.queued_prefill_tokens("vllm-0").await > 0,
        "the long prefill was still queued when the probe was placed"
    );
    let r = long_turn.await.unwrap().unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-agent-serve-backend"], "vllm-0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_conversation_opening_on_a_document_goes_where_it_is_held_though_a_prefill_queues_there(
) {
    let (_sims, gw, long_turn) = a_long_prefill_at_vllm_0().await;
    let c = client();
    // One session each, both within the bound.
    let short = sessions_hashing_to(0, &TWO, 1, "short").remove(0);
    assert_eq!(first_turn(&c, &gw, &short).await, "vllm-1");
    // A new session that hashes to vllm-1, where nothing queues, opening
    // with the first half of the 16 KB prompt vllm-0 is prefilling (about
    // 2,000 tokens: 4 s of prefill against 8 s queued), then asking its own
    // question: it goes where its opening is, behind the queue, since
    // computing it again on vllm-1 is work the fleet pays every time.
    let reader = sessions_hashing_to(1, &TWO, 1, "reader").remove(0);
    let mut body = chat_body("qwen3-8b", 0);
    body["messages"][1]["content"] = Value::from(format!(
        "{}\nWhat does this document say about its own length?",
        "a long document ".repeat(500)
    ));
    let r = chat(&c, &gw, &[("x-session-id", &reader)], &body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.backend.as_deref(), Some("vllm-0"));
    let r = long_turn.await.unwrap().unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_turn_goes_one_session_over_the_bound_rather_than_behind_a_long_prefill() {
    let (_sims, gw, long_turn) = a_long_prefill_at_vllm_0().await;
    let c = client();
    // Sessions that all hash to vllm-0, one after another. The bound sends
    // the first to vllm-1, whose answers to its first five turns teach the
    // gateway vllm-1's cost per token (relief is not taken on the prior's
    // guesses alone). The second finds both within the bound (one session
    // each) and takes idle vllm-1. The third finds vllm-1 at the bound (2 of
    // ⌈4 / 2⌉) and only
    // vllm-0 within it, behind seconds of prefill: it goes one over, to
    // vllm-1. So does the fourth (3 of ⌈5 / 2⌉, again at the bound). A
    // subagent of the fourth joins its parent there, though vllm-1 is one
    // over (4 of ⌈6 / 2⌉): co-location stays the rule. The fifth session
    // would make vllm-1 two over (5 of ⌈7 / 2⌉): vllm-0 takes it, queue or
    // not. The bound holds to within one.
    let sessions = sessions_hashing_to(0, &TWO, 5, "relief");
    let mut went = vec![first_turn(&c, &gw, &sessions[0]).await];
    for turn in 1..5 {
        let r = chat(
            &c,
            &gw,
            &[("x-session-id", &sessions[0])],
            &chat_body("qwen3-8b", turn),
        )
        .await;
        assert_eq!(r.backend.as_deref(), Some("vllm-1"));
    }
    // (Learned as each answer's request ends, which may be just after the
    // client has read it.)
    wait_until("vllm-1's cost learned", || async {
        gw.admin_backend("vllm-1").await["learned"]["prefill_us_per_token"].is_number()
    })
    .await;
    for s in &sessions[1..4] {
        went.push(first_turn(&c, &gw, s).await);
    }
    let child = chat(
        &c,
        &gw,
        &[
            ("x-session-id", "relief-child"),
            ("x-parent-session-id", &sessions[3]),
        ],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(child.status, 200);
    assert_eq!(child.backend.as_deref(), Some("vllm-1"), "with its parent");
    assert!(
        gw.queued_prefill_tokens("vllm-0").await > 0,
        "the long prefill was still queued when the fifth session was placed"
    );
    // (The fifth's answer comes after the long prefill's.)
    went.push(first_turn(&c, &gw, &sessions[4]).await);
    assert_eq!(went, ["vllm-1", "vllm-1", "vllm-1", "vllm-1", "vllm-0"]);
    let r = long_turn.await.unwrap().unwrap();
    assert_eq!(r.status(), 200);
}

/// A JSON (non-streamed) answer's first byte comes after its whole decode:
/// its time to first byte must not teach the decode as prefill. Until a
/// stream taught the decode speed, a long one teaches nothing; after, its
/// decode is taken off.
#[tokio::test]
async fn a_json_answer_does_not_teach_its_decode_as_prefill() {
    // 100 µs a prompt token, 2 ms a generated one: 100 generated tokens
    // take twice a 1,000-token prefill.
    let sim = SimBackend::start(
        "vllm-0",
        &[
            "--prefill-us-per-token",
            "100",
            "--decode-us-per-token",
            "2000",
        ],
    );
    // Only answers teach the decode speed here: the engine's own counters
    // are not read (`load.scrape: false`).
    let gw = Gateway::start(
        &[tier("default", true, &[], &[&sim])],
        &format!("{}load:\n  scrape: false\n", affinity_yaml(600)),
    )
    .await;
    let c = client();
    let body = |i: usize, max_tokens: u64, stream: bool| {
        let mut b = chat_body("qwen3-8b", 0);
        b["messages"][1]["content"] = Value::from(format!("probe-{i} ").repeat(4000 / 9));
        b["max_tokens"] = Value::from(max_tokens);
        if stream {
            b["stream"] = Value::from(true);
            b["stream_options"] = serde_json::json!({"include_usage": true});
        }
        b
    };
    let send = |b: Value| {
        let c = c.clone();
        let url = gw.url("/v1/chat/completions");
        async move {
            let r = c.post(url).json(&b).send().await.unwrap();
            assert_eq!(r.status(), 200);
            r.bytes().await.unwrap();
        }
    };
    for i in 0..4 {
        send(body(i, 100, false)).await;
    }
    // One streamed answer teaches the decode speed (and its prefill).
    send(body(10, 100, true)).await;
    let learned = || async { gw.admin_backend("vllm-0").await["learned"].clone() };
    wait_until("the stream taught the decode speed", || async {
        learned().await["decode_us_per_token"].is_number()
    })
    .await;
    assert_eq!(
        learned().await["responses"],
        1,
        "the long JSON answers taught nothing before the decode speed was known"
    );
    // Now JSON answers teach with their decode taken off.
    for i in 20..26 {
        send(body(i, 100, false)).await;
    }
    wait_until("the JSON answers taught", || async {
        learned().await["responses"] == 7
    })
    .await;
    let l = learned().await;
    let us = l["prefill_us_per_token"].as_f64().expect("learned");
    let decode = l["decode_us_per_token"].as_f64().unwrap();
    // The decode (200 ms) counted as prefill would read about 3x the cost.
    eprintln!("learned prefill {us} µs/token, decode {decode}");
    assert!(us < 200.0, "prefill {us} µs/token, decode {decode}: {l}");
}
