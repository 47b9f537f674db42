//! Prefix-aware routing through the real gateway and simulated replicas:
//! conversations without a session id are bound by their prompt, a new
//! binding goes where its prefix is cached, malformed bodies bind nothing,
//! and `affinity.prefix.enabled: false` is the behaviour before.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};

/// 8 KiB shared by every conversation, as an agent framework's system prompt.
fn system_prompt() -> String {
    "You are a careful coding agent; follow the repository's conventions. ".repeat(120)
}

/// A growing transcript: turns `0..=turn` of conversation `c`.
fn transcript(c: usize, turn: usize) -> Value {
    let mut messages = vec![json!({"role": "system", "content": system_prompt()})];
    for t in 0..=turn {
        messages.push(json!({"role": "user", "content": format!("conversation {c}, turn {t}: {}", "details ".repeat(200))}));
        if t < turn {
            messages.push(json!({"role": "assistant", "content": format!("done with {c}.{t}")}));
        }
    }
    json!({"model": "m", "messages": messages, "max_tokens": 2})
}

fn meta(r: &Reply) -> Value {
    r.json()["x_agent_serve"].clone()
}

fn usage(r: &Reply) -> (u64, u64) {
    let u = &r.json()["usage"];
    (
        u["prompt_tokens"].as_u64().unwrap_or(0),
        u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0),
    )
}

#[tokio::test]
async fn conversations_without_a_session_id_stay_on_one_backend_and_find_their_cache() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    let mut homes: HashMap<usize, HashSet<String>> = HashMap::new();
    let mut sessions = HashSet::new();
    for turn in 0..4 {
        for conv in 0..12 {
            let r = chat(&c, &gw, &[], &transcript(conv, turn)).await;
            assert_eq!(r.status, 200);
            let m = meta(&r);
            let session = m["session"]
                .as_str()
                .expect("an implicit session")
                .to_string();
            assert!(session.starts_with("prompt-"), "{session}");
            if turn == 0 {
                assert!(
                    sessions.insert(session),
                    "conversation {conv} has its own name"
                );
                assert_eq!(r.hit.as_deref(), Some("false"));
            } else {
                assert_eq!(r.hit.as_deref(), Some("true"), "{conv}.{turn}: {m}");
                assert_eq!(m["reason"], "hit");
                // The backend kept the transcript: all but this turn's new
                // message (and the sim's block rounding) was cached.
                let (prompt, cached) = usage(&r);
                assert!(
                    cached * 10 >= prompt * 8,
                    "{conv}.{turn}: {cached} of {prompt}"
                );
            }
            homes.entry(conv).or_default().insert(r.backend.unwrap());
        }
    }
    assert!(homes.values().all(|b| b.len() == 1), "{homes:?}");
    // A system prompt every conversation shares pulled none of them together:
    // bounded-load placement spread them 4/4/4.
    let mut per_backend: HashMap<String, usize> = HashMap::new();
    for b in homes.values() {
        *per_backend
            .entry(b.iter().next().unwrap().clone())
            .or_default() += 1;
    }
    assert_eq!(per_backend.len(), 3, "{per_backend:?}");
    assert!(per_backend.values().all(|&n| n == 4), "{per_backend:?}");
    gw.metric_reaches("agentserve_affinity_hits_total{tier=\"default\"}", 36.0)
        .await;
    gw.metric_reaches("agentserve_affinity_misses_total{tier=\"default\"}", 12.0)
        .await;
    assert!(gw.metric("agentserve_prefix_index_entries").await > 0.0);
    // Every request was looked up (all samples, matched or not).
    assert_eq!(
        gw.metric("agentserve_prefix_index_lookups_total{").await,
        48.0
    );
}

#[tokio::test]
async fn a_new_session_goes_where_its_prompt_is_cached() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    // Six sessions, two a backend; one of them runs three turns...
    for other in 1..6 {
        let sid = format!("other-{other}");
        let r = chat(&c, &gw, &[("x-session-id", &sid)], &transcript(other, 0)).await;
        assert_eq!(r.status, 200);
    }
    let mut home = None;
    for turn in 0..3 {
        let r = chat(
            &c,
            &gw,
            &[("x-session-id", "original")],
            &transcript(0, turn),
        )
        .await;
        assert_eq!(r.status, 200);
        home = r.backend;
    }
    let home = home.unwrap();
    // ...then the client retries its next turn under a fresh id (a restarted
    // agent, a fork): a new binding, placed where the transcript's prefix is
    // although its hash may say otherwise.
    let r = chat(&c, &gw, &[("x-session-id", "fresh")], &transcript(0, 3)).await;
    assert_eq!(r.backend.as_deref(), Some(home.as_str()));
    let m = meta(&r);
    assert_eq!(m["reason"], "prefix", "{m}");
    assert!(m["prefix_tokens"].as_u64().unwrap() > 2_000, "{m}");
    let (prompt, cached) = usage(&r);
    assert!(cached * 10 >= prompt * 7, "{cached} of {prompt}");
}

#[tokio::test]
async fn a_body_that_is_no_prompt_routes_least_busy_and_binds_nothing() {
    let (sims, gw) = fleet(2, &affinity_yaml(1800)).await;
    let c = client();
    let post = |body: &[u8]| {
        c.post(gw.url("/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body.to_vec())
            .send()
    };
    // What is not a JSON object gets the gateway's own 400, and no engine
    // sees it.
    for (body, why) in [
        (&b"not json at all"[..], "the body is not valid JSON"),
        (
            br#"{"model":"m","messages":[{"role":"user","#,
            "the body is not valid JSON",
        ),
        (br#"[1,2]"#, "the body must be a JSON object"),
    ] {
        let r = post(body).await.unwrap();
        assert_eq!(r.status(), 400);
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["code"], "invalid_body", "{e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(message.starts_with(why), "{message}");
    }
    for s in &sims {
        assert_eq!(
            s.stats().await["api_requests"],
            0,
            "{} saw a bad body",
            s.id
        );
    }
    // A JSON object with no prompt in it is the engine's to judge.
    let r = post(br#"{"model":"m","messages":"nope"}"#).await.unwrap();
    assert!(
        r.status().is_client_error(),
        "the sim refuses it: {}",
        r.status()
    );
    assert_eq!(
        r.headers()["x-agent-serve-affinity-hit"],
        "false",
        "no binding to hit"
    );
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        0.0
    );
    assert_eq!(gw.metric("agentserve_prefix_index_entries").await, 0.0);
}

#[tokio::test]
async fn prompts_of_token_ids_are_conversations_too() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    let mut homes: HashMap<usize, HashSet<String>> = HashMap::new();
    for turn in 1..=4usize {
        for conv in 0..6usize {
            // A 1,024-token prefix every conversation shares, then its own.
            let mut ids: Vec<u32> = (1..=1024).collect();
            ids.extend((0..turn * 300).map(|i| 10_000 + (conv * 5_000 + i) as u32));
            let r = c
                .post(gw.url("/v1/completions"))
                .json(&json!({"model": "m", "prompt": ids, "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            let r = reply(r).await;
            assert_eq!(r.status, 200);
            if turn > 1 {
                assert_eq!(r.hit.as_deref(), Some("true"), "{conv}.{turn}");
            }
            homes.entry(conv).or_default().insert(r.backend.unwrap());
        }
    }
    assert!(homes.values().all(|b| b.len() == 1), "{homes:?}");
    let used: HashSet<_> = homes.values().flatten().collect();
    assert_eq!(used.len(), 3, "spread, not merged by their shared prefix");
}

#[tokio::test]
async fn a_first_turn_is_queued_as_its_prompt_less_what_its_backend_holds() {
    // One replica slow enough (2 ms a token) that a prefill is seen in
    // progress however busy the machine.
    let sims = [SimBackend::start(
        "vllm-0",
        &["--prefill-us-per-token", "2000"],
    )];
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!("{FAST_HEALTH}{}", affinity_yaml(600)),
    )
    .await;
    let c = client();
    let system = "Shared instructions for every conversation. ".repeat(24);
    let body = |user: String| {
        json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]})
    };
    // One conversation computes the system prompt...
    assert_eq!(chat(&c, &gw, &[], &body("hi".into())).await.status, 200);
    // ...and another's first turn, with 4 KB of its own, is queued while it
    // prefills as its prompt (its messages, at 4 bytes a token) less what
    // the index says the backend holds.
    let second = body("a fresh question ".repeat(240));
    // The canonical prompt: the messages' JSON without its brackets, and a
    // separator after the system message.
    let bytes = serde_json::to_vec(&second["messages"]).unwrap().len() as u64 - 1;
    let turn = {
        let (c, url, second) = (client(), gw.url("/v1/chat/completions"), second.clone());
        tokio::spawn(async move { reply(c.post(url).json(&second).send().await.unwrap()).await })
    };
    wait_until("the second first turn is queued", || async {
        gw.queued_prefill_tokens("vllm-0").await > 0
    })
    .await;
    let queued = gw.queued_prefill_tokens("vllm-0").await;
    let r = turn.await.unwrap();
    assert_eq!(r.status, 200);
    let held = meta(&r)["prefix_tokens"].as_u64().unwrap();
    assert!(held >= 256, "the system prompt's blocks: {held}");
    assert_eq!(queued, bytes / 4 - held);
}

#[tokio::test]
async fn a_keyed_first_turn_is_served_whole_when_its_prompt_cannot_be_read() {
    // Bodies read to route may hold 64 KiB together here.
    let sims = [
        SimBackend::start("vllm-0", &[]),
        SimBackend::start("vllm-1", &[]),
    ];
    let gw = Gateway::start_with(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        |_| "  preread_budget_bytes: 65536\n".to_string(),
        &format!("{FAST_HEALTH}{}", affinity_yaml(600)),
    )
    .await;
    let c = client();
    let big = transcript(1, 60); // about 110 KiB
    let bytes = serde_json::to_vec(&big).unwrap();
    assert!(bytes.len() > 100_000);
    // Over the budget: routed without reading its prompt (never refused as
    // busy, as a body the tier or the key must come from would be).
    let r = chat(&c, &gw, &[("x-session-id", "over-budget")], &big).await;
    assert_eq!(r.status, 200);
    assert!(meta(&r).get("prefix_tokens").is_none(), "{}", meta(&r));
    let (prompt, _) = usage(&r);
    // Past 64 KiB the sim counted it all: nothing was cut at the retry buffer.
    assert!(prompt * 4 > 100_000, "whole body forwarded: {prompt}");
    // Chunked, of unknown length and over Pingora's 64 KiB retry buffer: not
    // read either (it could not be forwarded whole), not refused with 411.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        bytes.chunks(16 * 1024).map(|c| Ok(c.to_vec())).collect();
    let r = c
        .post(gw.url("/v1/chat/completions"))
        .header("x-session-id", "chunked")
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .unwrap();
    let r = reply(r).await;
    assert_eq!(r.status, 200);
    assert!(meta(&r).get("prefix_tokens").is_none());
    let (prompt, _) = usage(&r);
    // Past 64 KiB the sim counted it all: nothing was cut at the retry buffer.
    assert!(prompt * 4 > 100_000, "whole body forwarded: {prompt}");
}
