//! Session routing through the real gateway binary to simulated replicas:
//! stickiness, spread, the seed load study, tiers, TTL, metadata, streaming.

mod common;

use common::*;
use futures_util::StreamExt;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

#[tokio::test]
async fn turns_of_a_session_stick_and_sessions_spread() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let client = client();
    let mut placement: HashMap<String, String> = HashMap::new();
    for turn in 0..3 {
        for s in 0..30 {
            let sid = format!("session-{s}");
            let r = chat(
                &client,
                &gw,
                &[("x-session-id", &sid)],
                &chat_body("qwen3-8b", turn),
            )
            .await;
            assert_eq!(r.status, 200);
            let backend = r.backend.clone().expect("backend header");
            assert_eq!(
                r.sim_backend.as_deref(),
                Some(backend.as_str()),
                "header names the replica that served"
            );
            assert_eq!(
                r.hit.as_deref(),
                Some(if turn == 0 { "false" } else { "true" })
            );
            let first = placement.entry(sid.clone()).or_insert(backend.clone());
            assert_eq!(first, &backend, "{sid} moved on turn {turn}");
        }
    }
    let used: HashSet<&String> = placement.values().collect();
    assert_eq!(
        used.len(),
        3,
        "30 sessions spread over all 3 backends: {placement:?}"
    );
    gw.metric_reaches("agentserve_affinity_hits_total{tier=\"default\"}", 60.0)
        .await;
    gw.metric_reaches("agentserve_affinity_misses_total{tier=\"default\"}", 30.0)
        .await;
    assert_eq!(
        gw.metric("agentserve_affinity_broken_total{tier=\"default\"}")
            .await,
        0.0
    );
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        30.0
    );
}

/// Seed 000's load study: 12 sessions × 6 turns at concurrency 6 → 5/6 hits;
/// 72 single-turn sessions with fresh ids → 0 hits.
#[tokio::test]
async fn seed_load_study_hit_rates() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let gw = Arc::new(gw);
    let client = client();
    let sem = Arc::new(tokio::sync::Semaphore::new(6));
    let mut tasks = Vec::new();
    for s in 0..12 {
        let (gw, client, sem) = (gw.clone(), client.clone(), sem.clone());
        tasks.push(tokio::spawn(async move {
            let sid = format!("study-{s}");
            let mut hits = 0;
            let mut backends = HashSet::new();
            for turn in 0..6 {
                let _permit = sem.acquire().await.expect("semaphore");
                let r = chat(
                    &client,
                    &gw,
                    &[("x-session-id", &sid)],
                    &chat_body("qwen3-8b", turn),
                )
                .await;
                assert_eq!(r.status, 200);
                hits += (r.hit.as_deref() == Some("true")) as usize;
                backends.insert(r.sim_backend.expect("served"));
            }
            (hits, backends.len())
        }));
    }
    let mut total_hits = 0;
    for t in tasks {
        let (hits, distinct) = t.await.expect("session task");
        assert_eq!(distinct, 1, "all six turns on one backend");
        total_hits += hits;
    }
    assert_eq!(total_hits, 60, "12 × 5 warm turns");
    let hits = gw
        .metric("agentserve_affinity_hits_total{tier=\"default\"}")
        .await;
    let misses = gw
        .metric("agentserve_affinity_misses_total{tier=\"default\"}")
        .await;
    assert_eq!(hits / (hits + misses), 5.0 / 6.0);

    // Affinity "off": 72 single-turn sessions with fresh ids.
    for i in 0..72 {
        let sid = format!("fresh-{i}");
        let r = chat(
            &client,
            &gw,
            &[("x-session-id", &sid)],
            &chat_body("qwen3-8b", 0),
        )
        .await;
        assert_eq!(r.hit.as_deref(), Some("false"));
    }
    gw.metric_reaches("agentserve_affinity_hits_total{tier=\"default\"}", 60.0)
        .await;
    gw.metric_reaches(
        "agentserve_affinity_misses_total{tier=\"default\"}",
        12.0 + 72.0,
    )
    .await;
}

#[tokio::test]
async fn ttl_zero_stores_nothing_and_every_turn_misses() {
    let (_sims, gw) = fleet(3, &affinity_yaml(0)).await;
    let client = client();
    let mut seen = HashSet::new();
    for turn in 0..4 {
        let r = chat(
            &client,
            &gw,
            &[("x-session-id", "s")],
            &chat_body("qwen3-8b", turn),
        )
        .await;
        assert_eq!(r.hit.as_deref(), Some("false"));
        assert_eq!(r.json()["x_agent_serve"]["reason"], "affinity_disabled");
        seen.insert(r.backend.unwrap());
    }
    assert_eq!(seen.len(), 1, "still consistent-hashed without a table");
    gw.metric_reaches("agentserve_affinity_misses_total{tier=\"default\"}", 4.0)
        .await;
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        0.0
    );
}

#[tokio::test]
async fn idle_binding_expires_but_never_while_a_request_is_in_flight() {
    let (sims, gw) = fleet(3, &affinity_yaml(1)).await;
    let client = client();
    // Turn 1 streams and is held open by its backend past the TTL.
    for s in &sims {
        s.set_faults(json!({"hold_streams": true})).await;
    }
    let mut body = chat_body("qwen3-8b", 0);
    body["stream"] = json!(true);
    let resp = client
        .post(gw.url("/v1/chat/completions"))
        .header("x-session-id", "long-turn")
        .json(&body)
        .send()
        .await
        .expect("stream starts");
    let backend = resp.headers()["x-agent-serve-backend"]
        .to_str()
        .unwrap()
        .to_string();
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.expect("first event").expect("bytes");
    assert!(first.starts_with(b"data: "));
    // Twice the TTL passes while the stream is in flight (this wait is the
    // behaviour under test, not synchronisation).
    tokio::time::sleep(std::time::Duration::from_millis(2200)).await;
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        1.0
    );
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", "long-turn")],
        &chat_body("qwen3-8b", 1),
    )
    .await;
    assert_eq!(
        r.hit.as_deref(),
        Some("true"),
        "a leased binding must not expire"
    );
    assert_eq!(r.backend.as_deref(), Some(backend.as_str()));
    for s in &sims {
        s.release_streams().await;
    }
    while stream.next().await.is_some() {}
    // Idle now: the binding expires one TTL after the last request ended.
    wait_until("binding to expire and be swept", || async {
        gw.metric("agentserve_bindings{tier=\"default\"}").await == 0.0
    })
    .await;
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", "long-turn")],
        &chat_body("qwen3-8b", 2),
    )
    .await;
    assert_eq!(r.hit.as_deref(), Some("false"));
}

#[tokio::test]
async fn tier_from_header_then_model_then_default() {
    let a: Vec<SimBackend> = (0..2)
        .map(|i| SimBackend::start(&format!("small-{i}"), &[]))
        .collect();
    let b: Vec<SimBackend> = (0..2)
        .map(|i| SimBackend::start(&format!("big-{i}"), &[]))
        .collect();
    let gw = Gateway::start(
        &[
            tier("small", true, &["qwen3-8b"], &a.iter().collect::<Vec<_>>()),
            tier("big", false, &["qwen3-235b"], &b.iter().collect::<Vec<_>>()),
        ],
        &format!("{FAST_HEALTH}{}", affinity_yaml(1800)),
    )
    .await;
    let client = client();
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", "s1")],
        &chat_body("qwen3-235b", 0),
    )
    .await;
    assert_eq!(r.tier.as_deref(), Some("big"));
    assert!(r.sim_backend.unwrap().starts_with("big-"));
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", "s1"), ("x-agent-serve-tier", "small")],
        &chat_body("qwen3-235b", 0),
    )
    .await;
    assert_eq!(
        r.tier.as_deref(),
        Some("small"),
        "the header wins over the model"
    );
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", "s2")],
        &chat_body("unlisted-model", 0),
    )
    .await;
    assert_eq!(
        r.tier.as_deref(),
        Some("small"),
        "unknown model → default tier"
    );
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", "s2"), ("x-agent-serve-tier", "nope")],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "unknown_tier");
    // The same session id in two tiers is two bindings.
    assert_eq!(gw.metric("agentserve_bindings{tier=\"big\"}").await, 1.0);
    assert_eq!(gw.metric("agentserve_bindings{tier=\"small\"}").await, 2.0);
}

#[tokio::test]
async fn json_responses_carry_metadata_with_a_correct_length() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let client = client();
    // A session id that needs JSON escaping.
    let sid = r#"me"ta\x"#;
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", sid)],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    let declared: usize = r.headers["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(declared, r.body.len());
    let v = r.json();
    assert_eq!(v["x_agent_serve"]["backend"], r.backend.clone().unwrap());
    assert_eq!(v["x_agent_serve"]["affinity_hit"], false);
    assert_eq!(v["x_agent_serve"]["tier"], "default");
    assert_eq!(v["x_agent_serve"]["session"], sid);
    assert_eq!(v["x_agent_serve"]["reason"], "first_turn");
    assert_eq!(
        v["object"], "chat.completion",
        "backend fields are untouched"
    );
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", sid)],
        &chat_body("qwen3-8b", 1),
    )
    .await;
    assert_eq!(r.json()["x_agent_serve"]["reason"], "hit");
    // Usage is read into the token counters.
    let prompt = gw
        .metric(&format!(
            "agentserve_prompt_tokens_total{{backend=\"{}\",tier=\"default\"}}",
            r.backend.clone().unwrap()
        ))
        .await;
    assert!(prompt > 0.0);
    // (Counted as the request is logged, just after the client has it.)
    let cached = format!(
        "agentserve_cached_prompt_tokens_total{{backend=\"{}\",tier=\"default\"}}",
        r.backend.unwrap()
    );
    wait_until("the second turn reused the first turn's prefix", || async {
        gw.metric(&cached).await > 0.0
    })
    .await;
}

#[tokio::test]
async fn sse_events_are_not_buffered() {
    let (sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    for s in &sims {
        s.set_faults(json!({"hold_streams": true})).await;
    }
    let client = client();
    let mut body = chat_body("qwen3-8b", 0);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["max_tokens"] = json!(5);
    let resp = client
        .post(gw.url("/v1/chat/completions"))
        .header("x-session-id", "stream")
        .json(&body)
        .send()
        .await
        .expect("stream");
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    assert!(resp.headers().get("x-agent-serve-backend").is_some());
    let backend_id = resp.headers()["x-agent-serve-backend"]
        .to_str()
        .unwrap()
        .to_string();
    let sim = sims.iter().find(|s| s.id == backend_id).unwrap();
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.expect("an event").expect("bytes");
    assert!(first.starts_with(b"data: {"));
    // The backend has not finished: it is holding the stream after one token.
    assert_eq!(sim.stats().await["active_streams"], 1);
    sim.release_streams().await;
    let mut rest = first.to_vec();
    while let Some(chunk) = stream.next().await {
        rest.extend_from_slice(&chunk.expect("bytes"));
    }
    let text = String::from_utf8(rest).unwrap();
    assert!(
        text.ends_with("data: [DONE]\n\n"),
        "stream passes through unmodified"
    );
    assert!(!text.contains("x_agent_serve"));
    wait_until("usage from the final SSE chunk", || async {
        gw.metric(&format!(
            "agentserve_prompt_tokens_total{{backend=\"{backend_id}\",tier=\"default\"}}"
        ))
        .await
            > 0.0
    })
    .await;
}

#[tokio::test]
async fn with_prefix_routing_off_requests_without_a_session_are_served_unbound() {
    let off = format!("{}  prefix:\n    enabled: false\n", affinity_yaml(1800));
    let (_sims, gw) = fleet(3, &off).await;
    let client = client();
    let mut used = HashSet::new();
    for turn in 0..9 {
        let r = chat(&client, &gw, &[], &chat_body("qwen3-8b", turn)).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.hit.as_deref(), Some("false"));
        assert_eq!(r.json()["x_agent_serve"]["reason"], "no_session");
        used.insert(r.backend.unwrap());
    }
    assert_eq!(used.len(), 3, "idle backends tie; ties rotate");
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        0.0
    );
    assert_eq!(
        gw.metric("agentserve_affinity_misses_total{tier=\"default\"}")
            .await,
        0.0
    );
}

#[tokio::test]
async fn body_field_is_the_session_key_when_no_header_is_sent() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let client = client();
    let mut body = chat_body("qwen3-8b", 0);
    body["prompt_cache_key"] = json!("from-body");
    let first = chat(&client, &gw, &[], &body).await;
    assert_eq!(first.json()["x_agent_serve"]["session"], "from-body");
    let again = chat(&client, &gw, &[], &body).await;
    assert_eq!(again.hit.as_deref(), Some("true"));
    assert_eq!(again.backend, first.backend);
}

#[tokio::test]
async fn a_body_field_that_cannot_be_a_key_is_passed_over_not_refused() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let client = client();
    for (bad, why) in [
        (json!("x".repeat(300)), "over 256 bytes"),
        (json!(42), "a number"),
        (json!("a\u{1}b"), "a control character"),
    ] {
        let mut body = chat_body("qwen3-8b", 0);
        body["prompt_cache_key"] = bad;
        body["user"] = json!("next-field");
        let r = chat(&client, &gw, &[], &body).await;
        assert_eq!(r.status, 200, "{why}");
        assert_eq!(r.json()["x_agent_serve"]["session"], "next-field", "{why}");
    }
    // The same value in a header, which a client sets for the gateway: 400.
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", &"x".repeat(300))],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 400);
}

#[tokio::test]
async fn two_gateways_with_one_hash_key_agree() {
    let sims: Vec<SimBackend> = (0..5)
        .map(|i| SimBackend::start(&format!("b{i}"), &[]))
        .collect();
    let refs: Vec<&SimBackend> = sims.iter().collect();
    let extra = format!("{FAST_HEALTH}{}", affinity_yaml(1800));
    let g1 = Gateway::start(&[tier("default", true, &[], &refs)], &extra).await;
    let g2 = Gateway::start(&[tier("default", true, &[], &refs)], &extra).await;
    let client = client();
    for s in 0..40 {
        let sid = format!("shared-{s}");
        let a = chat(&client, &g1, &[("x-session-id", &sid)], &chat_body("m", 0)).await;
        let b = chat(&client, &g2, &[("x-session-id", &sid)], &chat_body("m", 0)).await;
        assert_eq!(a.backend, b.backend, "{sid}");
    }
}

#[tokio::test]
async fn a_request_id_is_echoed_or_made_and_goes_upstream() {
    let (sims, gw) = fleet(1, &affinity_yaml(600)).await;
    let c = client();
    let seen = || async { sims[0].stats().await["last_headers"]["x-request-id"].clone() };
    // The client's own: back in the answer, and upstream.
    let r = chat(&c, &gw, &[("x-request-id", "req-7f3a")], &chat_body("m", 0)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.headers["x-request-id"], "req-7f3a");
    assert_eq!(seen().await, "req-7f3a");
    // None sent: one is made, a different one each time.
    let mut made = HashSet::new();
    for turn in 0..2 {
        let r = chat(&c, &gw, &[], &chat_body("m", turn)).await;
        let id = r.headers["x-request-id"].to_str().unwrap().to_string();
        assert_eq!(id.len(), 32, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()));
        assert_eq!(seen().await, id.as_str());
        made.insert(id);
    }
    assert_eq!(made.len(), 2);
    // One that is not a short printable token is replaced.
    let long = "x".repeat(200);
    let r = chat(&c, &gw, &[("x-request-id", &long)], &chat_body("m", 0)).await;
    assert_eq!(r.headers["x-request-id"].len(), 32);
    // The gateway's own errors carry it too.
    let r = chat(
        &c,
        &gw,
        &[
            ("x-request-id", "req-bad"),
            ("x-session-id", &"s".repeat(300)),
        ],
        &chat_body("m", 0),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.headers["x-request-id"], "req-bad");
}

#[tokio::test]
async fn pingoras_error_lines_name_the_request_id() {
    let mut sim = SimBackend::start("vllm-0", &[]);
    // Health checks that never notice: the request meets the dead backend.
    let (mut gw, log_path) = Gateway::start_logging(
        &[tier("default", true, &[], &[&sim])],
        &format!("health:\n  interval_ms: 3600000\n{}", affinity_yaml(600)),
    )
    .await;
    sim.kill();
    let r = chat(
        &client(),
        &gw,
        &[("x-request-id", "req-in-the-log")],
        &chat_body("m", 0),
    )
    .await;
    assert_eq!(r.status, 502);
    assert_eq!(r.headers["x-request-id"], "req-in-the-log");
    // Stopped, its log complete (the log lives in its directory: not dropped).
    gw.stop();
    let text = std::fs::read_to_string(&log_path).unwrap();
    assert!(
        text.lines()
            .any(|l| l.contains("Fail to proxy") && l.contains("request id req-in-the-log")),
        "{text}"
    );
}
