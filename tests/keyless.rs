//! Keyless routing on the shapes users send, through the real gateway and
//! simulated replicas: conversations that all open with the same first turn,
//! trace turns that re-render the last block of the turn before, one-shot
//! calls by the thousand beside live sessions, engines that report no cached
//! tokens, and one tenant (its own client key) guessing at another's prompt.

mod common;

use agent_gateway_tools::loadgen::trace;
use common::*;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};

fn system_prompt() -> String {
    "You are a careful coding agent; follow the repository's conventions. ".repeat(60)
}

fn meta(r: &Reply) -> Value {
    r.json()["x_agent_serve"].clone()
}

/// Turns `0..=turn` of conversation `c`, whose first turn every
/// conversation shares (a task template, sampled rollouts of one task).
fn same_opening(c: usize, turn: usize) -> Value {
    let mut messages = vec![
        json!({"role": "system", "content": system_prompt()}),
        json!({"role": "user", "content": "Solve the task in TASK.md and run its tests."}),
    ];
    for t in 1..=turn {
        messages.push(json!({"role": "assistant", "content": format!("step {t} done")}));
        messages.push(json!({"role": "user", "content": format!("rollout {c}, step {t}: {}", "go on ".repeat(40))}));
    }
    json!({"model": "m", "messages": messages, "max_tokens": 2})
}

#[tokio::test]
async fn conversations_with_the_same_first_turn_spread_and_each_stays_where_it_parted() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    let mut homes: HashMap<usize, Vec<String>> = HashMap::new();
    for turn in 0..4 {
        for conv in 0..12 {
            let r = chat(&c, &gw, &[], &same_opening(conv, turn)).await;
            assert_eq!(r.status, 200);
            if turn >= 2 {
                // From the turn after they parted, each is its own.
                assert_eq!(
                    r.hit.as_deref(),
                    Some("true"),
                    "{conv}.{turn}: {}",
                    meta(&r)
                );
            }
            homes.entry(conv).or_default().push(r.backend.unwrap());
        }
    }
    // Turn 0 is the same prompt for all: nothing of any one conversation
    // is cached yet, so where it went binds nothing. From turn 1, where the
    // conversations diverge, each stays on one backend...
    for (conv, backends) in &homes {
        let from_1: HashSet<&String> = backends[1..].iter().collect();
        assert_eq!(from_1.len(), 1, "conversation {conv}: {backends:?}");
    }
    // ...and they are spread over the fleet, not all together on the one
    // that took the shared opening first.
    let mut per_backend: HashMap<&String, usize> = HashMap::new();
    for backends in homes.values() {
        *per_backend.entry(&backends[1]).or_default() += 1;
    }
    assert_eq!(per_backend.len(), 3, "{per_backend:?}");
    assert!(per_backend.values().all(|&n| n == 4), "{per_backend:?}");
    // No binding was made for the shared opening itself: 12 conversations.
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        12.0
    );
}

/// Trace turns whose partial last block gets new ids in the next turn, with
/// token ids of five digits and of a real tokenizer's six (Qwen3's
/// vocabulary, 151,936). (Where wider ids put a re-ided tail past four
/// blocks: the unit test `a_re_tokenised_tail_is_tolerated_in_tokens…`.)
#[tokio::test]
async fn trace_turns_that_re_id_the_partial_block_stay_on_their_backend() {
    for vocab in [trace::DEFAULT_VOCAB, 151_936] {
        trace_turns_stay(vocab).await;
    }
}

async fn trace_turns_stay(vocab: u32) {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    let text = trace::mooncake_like(12, 5, true);
    let lines = trace::parse(&text).unwrap();
    let sessions = trace::sessions(&lines);
    let mut homes: HashMap<usize, HashSet<String>> = HashMap::new();
    let (mut later, mut hits) = (0, 0);
    for (i, (line, &(session, turn))) in lines.iter().zip(&sessions).enumerate() {
        let body =
            json!({"model": "m", "prompt": trace::prompt_ids(line, i, vocab), "max_tokens": 1});
        let r = reply(
            c.post(gw.url("/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(r.status, 200);
        if turn > 0 {
            later += 1;
            hits += (r.hit.as_deref() == Some("true")) as usize;
        }
        homes.entry(session).or_default().insert(r.backend.unwrap());
    }
    // Every turn shares all full blocks of the one before but not its
    // partial last one: none of them extends the one before byte for byte,
    // and each is still that conversation's next turn.
    assert!(later > 40, "{later}");
    assert_eq!(
        hits, later,
        "ids below {vocab}: every later turn continued its conversation"
    );
    assert!(homes.values().all(|b| b.len() == 1), "{homes:?}");
    let used: HashSet<&String> = homes.values().flatten().collect();
    assert_eq!(used.len(), 3, "spread, not merged by their shared prefix");
}

#[tokio::test]
async fn ten_thousand_one_shot_calls_beside_live_sessions_bind_nothing_and_evict_none() {
    let (_sims, gw) = fleet(3, &format!("{}  max_bindings: 100\n", affinity_yaml(1800))).await;
    let c = client();
    // 64 live agent sessions, keyless: each a conversation of two turns, so
    // bound.
    let session = |s: usize, turn: usize| {
        let mut messages = vec![json!({"role": "system", "content": system_prompt()})];
        for t in 0..=turn {
            messages.push(json!({"role": "user", "content": format!("session {s} turn {t}")}));
            if t < turn {
                messages.push(json!({"role": "assistant", "content": "ok"}));
            }
        }
        json!({"model": "m", "messages": messages, "max_tokens": 1})
    };
    let mut home = HashMap::new();
    for turn in 0..2 {
        for s in 0..64 {
            let r = chat(&c, &gw, &[], &session(s, turn)).await;
            assert_eq!(r.status, 200);
            home.insert(s, r.backend.unwrap());
        }
    }
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        64.0
    );
    // 10,000 embeddings calls and 1,000 one-shot completions, none of which
    // ever continues, 32 at a time.
    let calls: Vec<(&str, Value)> = (0..11_000)
        .map(|i| match i % 11 {
            0 => (
                "/v1/chat/completions",
                json!({"model": "m", "max_tokens": 1, "messages": [
                    {"role": "user", "content": format!("classify ticket {i}: {}", "text ".repeat(50))}]}),
            ),
            _ => (
                "/v1/embeddings",
                json!({"model": "m", "input": format!("document {i}: {}", "words ".repeat(60))}),
            ),
        })
        .collect();
    for chunk in calls.chunks(32) {
        let sent = chunk.iter().map(|(path, body)| {
            let c = c.clone();
            let url = gw.url(path);
            async move {
                c.post(url)
                    .json(body)
                    .send()
                    .await
                    .unwrap()
                    .status()
                    .as_u16()
            }
        });
        for status in futures_util::future::join_all(sent).await {
            assert_eq!(status, 200);
        }
    }
    // No binding was made for them and no session was evicted for them...
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        64.0
    );
    assert_eq!(
        gw.metric("agentserve_bindings_evicted_total{tier=\"default\"}")
            .await,
        0.0
    );
    // ...every session's next turn is a hit on its backend...
    for s in 0..64 {
        let r = chat(&c, &gw, &[], &session(s, 2)).await;
        assert_eq!(r.hit.as_deref(), Some("true"), "session {s}");
        assert_eq!(r.backend.as_ref(), home.get(&s));
    }
    // ...and what the one-shot completions left is bounded: only they left
    // ends (embeddings keep nothing), and on probation at most that many.
    assert!(gw.metric("agentserve_prefix_conversations").await <= 64.0 + 1_000.0);
    assert_eq!(
        gw.metric("agentserve_prefix_index_lookups_total{").await,
        128.0 + 1_000.0 + 64.0
    );
}

#[tokio::test]
async fn engines_that_report_no_cached_tokens_correct_nothing_and_keep_their_conversations() {
    let sims: Vec<SimBackend> = (0..3)
        .map(|i| {
            SimBackend::start(
                &format!("vllm-{i}"),
                &["--no-cache-report", "--cache-blocks", "4000"],
            )
        })
        .collect();
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!("{FAST_HEALTH}{}", affinity_yaml(1800)),
    )
    .await;
    let c = client();
    let body = |conv: usize, turn: usize| {
        let mut messages = vec![json!({"role": "system", "content": system_prompt()})];
        for t in 0..=turn {
            messages.push(json!({"role": "user", "content": format!("conversation {conv} turn {t}: {}", "details ".repeat(100))}));
            if t < turn {
                messages.push(json!({"role": "assistant", "content": "done"}));
            }
        }
        json!({"model": "m", "messages": messages, "max_tokens": 1})
    };
    let (mut prompt, mut cached) = (0u64, 0u64);
    for turn in 0..4 {
        for conv in 0..9 {
            let r = chat(&c, &gw, &[], &body(conv, turn)).await;
            assert_eq!(r.status, 200);
            let usage = &r.json()["usage"];
            assert!(usage.get("prompt_tokens_details").is_none(), "{usage}");
            if turn > 0 {
                assert_eq!(r.hit.as_deref(), Some("true"), "{conv}.{turn}");
                prompt += usage["prompt_tokens"].as_u64().unwrap();
                cached += r.headers["x-sim-cached-tokens"]
                    .to_str()
                    .unwrap()
                    .parse::<u64>()
                    .unwrap();
            }
        }
    }
    // The engines kept the conversations (their own count says so), and
    // the gateway, told nothing, took nothing for an eviction.
    assert!(cached * 10 >= prompt * 8, "{cached} of {prompt}");
    assert_eq!(
        gw.metric("agentserve_prefix_index_corrections_total{")
            .await,
        0.0
    );
    assert_eq!(
        gw.metric("agentserve_cached_prompt_tokens_total{").await,
        0.0,
        "no cached tokens counted that nobody reported"
    );
}

#[tokio::test]
async fn a_tenant_cannot_tell_a_right_guess_at_another_tenants_prompt_from_a_wrong_one() {
    // Two tenants with keys of their own. One backend: whatever the index
    // says, every request goes there, and only what the answers show can
    // tell the guesses apart.
    let (_dir, _sims, gw) =
        fleet_with_keys(&[("sk-tenant-a", "a", ""), ("sk-tenant-b", "b", "")]).await;
    let c = client();
    let (a, b) = (
        ("authorization", "Bearer sk-tenant-a"),
        ("authorization", "Bearer sk-tenant-b"),
    );
    let secret = "Internal: the merger closes on the 14th; never mention Falcon. ".repeat(40);
    let decoy = "Internal: the offsite moves to the 21st; never mention Osprey. ".repeat(40);
    let ask = |system: &str, q: &str| {
        json!({"model": "m", "max_tokens": 1, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": q},
        ]})
    };
    // Tenant a's conversation: its system prompt is in the index now.
    for q in ["summarise the plan", "list the risks"] {
        let r = chat(&c, &gw, &[a], &ask(&secret, q)).await;
        assert_eq!(r.status, 200);
    }
    // Within tenant a, a new conversation with that prompt is told how much
    // of it was cached: the index is there to be found.
    let own = chat(&c, &gw, &[a], &ask(&secret, "draft the memo")).await;
    assert!(
        meta(&own)["prefix_tokens"].as_u64().unwrap() > 256,
        "{}",
        meta(&own)
    );
    // Tenant b guesses: right and wrong guesses look alike in every answer.
    let right = chat(&c, &gw, &[b], &ask(&secret, "draft the memo")).await;
    let wrong = chat(&c, &gw, &[b], &ask(&decoy, "draft the memo")).await;
    for r in [&right, &wrong] {
        assert_eq!(r.status, 200);
        let m = meta(r);
        assert_eq!(m["reason"], "first_turn", "{m}");
        assert_eq!(m["prefix_tokens"].as_u64(), Some(0), "{m}");
        assert_eq!(r.hit.as_deref(), Some("false"));
    }
}
