//! Engines' KV-cache events as the gateway's view of their caches
//! (`kv_events`), against simulated replicas that publish them as vLLM does
//! (ZeroMQ, msgpack, a replay socket): sessions named upstream, predictions
//! from the events, a batch lost and recovered, an engine restarted, and a
//! session its draining backend evicted moving on.
//! (`tests/vllm.rs` runs the same against real vLLM.)

mod common;

use common::*;
use serde_json::{json, Value};

/// An append-only agent conversation (each turn extends the last prompt).
struct Conversation {
    messages: Vec<Value>,
}

impl Conversation {
    fn new(name: &str) -> Conversation {
        let system =
            format!("You are agent {name}; read the file, run the test and fix it. ").repeat(12);
        Conversation {
            messages: vec![json!({"role": "system", "content": system})],
        }
    }

    fn next(&mut self, turn: usize) -> Value {
        if turn > 0 {
            self.messages
                .push(json!({"role": "assistant", "content": format!("Done with step {turn}; the test passes now.")}));
        }
        self.messages.push(json!({"role": "user", "content": format!("Step {turn}: the tool printed an error on line {}. Fix it.", turn * 11)}));
        json!({"model": "qwen3-8b", "messages": self.messages, "max_tokens": 4})
    }
}

async fn kv_of(gw: &Gateway, id: &str) -> Value {
    gw.admin_backend(id).await["kv_events"].clone()
}

/// A turn of `session` through `gw` to the engine `backend`, returned once
/// the engine's events for it (the blocks it stored) have reached the
/// gateway: they come after the answer, and a turn sent before them is routed
/// on what came before.
async fn turn(
    c: &reqwest::Client,
    gw: &Gateway,
    backend: &str,
    session: &str,
    body: &Value,
) -> Reply {
    let events = || async { kv_of(gw, backend).await["events"].as_u64().unwrap_or(0) };
    let before = events().await;
    let r = chat(c, gw, &[("x-session-id", session)], body).await;
    wait_until("the turn's events applied", || async {
        events().await > before
    })
    .await;
    r
}

async fn predictions(gw: &Gateway, source: &str, outcome: &str) -> f64 {
    gw.metric(&format!(
        "agentserve_kv_predictions_total{{outcome=\"{outcome}\",source=\"{source}\",tier=\"default\"}}"
    ))
    .await
}

/// A gateway in front of `sims`, each with its events; `extra`: YAML.
async fn gateway(sims: &[&SimBackend], extra: &str) -> Gateway {
    let tiers = [tier("default", true, &["qwen3-8b"], sims)];
    let dir = tempfile::tempdir().unwrap();
    let (port, metrics_port) = (free_port(), free_port_pair());
    let kv: Vec<_> = sims
        .iter()
        .map(|s| (s.id.as_str(), s.addr, sim_kv_events(s)))
        .collect();
    let extra = format!(
        "{FAST_HEALTH}{}  allow_explicit_target: true\n{extra}",
        affinity_yaml(600)
    );
    let yaml = with_kv_events(
        config_yaml(port, metrics_port, dir.path(), &tiers, &extra),
        &kv,
    );
    let gw = Gateway::start_yaml(dir, port, metrics_port, &yaml).await;
    for s in sims {
        wait_until("the engine's events followed", || async {
            kv_of(&gw, &s.id).await["exact"] == true
        })
        .await;
    }
    gw
}

const EVENTS: &[&str] = &["--kv-events", "127.0.0.1:0", "--block-size", "16"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_events_say_what_it_holds_through_a_lost_batch_and_a_restart() {
    let mut sim = SimBackend::start("ev-0", EVENTS);
    let gw = gateway(&[&sim], "").await;
    let c = client();

    // Sessions go upstream named by their binding key, not the client's id.
    let mut s = Conversation::new("s");
    for t in 0..3 {
        let r = turn(&c, &gw, "ev-0", "s", &s.next(t)).await;
        assert_eq!(r.status, 200);
    }
    let seen = sim.stats().await["last_headers"]["x-session-id"].clone();
    let seen = seen.as_str().expect("the engine got X-Session-ID");
    assert_eq!(seen.len(), 32, "{seen}");
    assert_ne!(seen, "s");
    // Its later turns were predicted from the events, rightly.
    gw.metric_reaches(
        "agentserve_kv_predictions_total{outcome=\"right\",source=\"events\",tier=\"default\"}",
        2.0,
    )
    .await;
    assert_eq!(predictions(&gw, "events", "wrong").await, 0.0);

    // A batch lost on the way is recovered from the replay socket: the
    // session whose blocks it stored is known, and predicted from them.
    sim.set_faults(json!({"drop_kv_batches": 1})).await;
    let mut d = Conversation::new("d");
    let r = chat(&c, &gw, &[("x-session-id", "d")], &d.next(0)).await;
    assert_eq!(r.status, 200);
    let mut e = Conversation::new("e");
    let r = chat(&c, &gw, &[("x-session-id", "e")], &e.next(0)).await;
    assert_eq!(r.status, 200);
    wait_until("the lost batch replayed", || async {
        kv_of(&gw, "ev-0").await["replayed_batches"] == 1
    })
    .await;
    assert_eq!(kv_of(&gw, "ev-0").await["exact"], true);
    let r = chat(&c, &gw, &[("x-session-id", "d")], &d.next(1)).await;
    assert_eq!(r.status, 200);
    gw.metric_reaches(
        "agentserve_kv_predictions_total{outcome=\"right\",source=\"events\",tier=\"default\"}",
        3.0,
    )
    .await;

    // The engine killed: what it held is forgotten before any turn reaches
    // it again; restarted on the same sockets, its events are followed again
    // and its empty cache predicted as empty.
    let held = kv_of(&gw, "ev-0").await["blocks_held"].as_u64().unwrap();
    assert!(held > 0);
    sim.kill();
    wait_until("the dead engine's holdings forgotten", || async {
        let kv = kv_of(&gw, "ev-0").await;
        kv["exact"] == false && kv["blocks_held"] == 0
    })
    .await;
    let (events, replay) = sim.kv.clone().unwrap();
    let (events, replay) = (
        events.trim_start_matches("tcp://").to_string(),
        replay.trim_start_matches("tcp://").to_string(),
    );
    sim.restart(&[
        "--kv-events",
        &events,
        "--kv-replay",
        &replay,
        "--block-size",
        "16",
    ]);
    wait_until("its events followed again", || async {
        kv_of(&gw, "ev-0").await["exact"] == true
    })
    .await;
    wait_until("the restarted engine healthy", || async {
        chat(&c, &gw, &[], &chat_body("qwen3-8b", 0)).await.status == 200
    })
    .await;
    let r = chat(&c, &gw, &[("x-session-id", "s")], &s.next(3)).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    gw.metric_reaches(
        "agentserve_kv_predictions_total{outcome=\"right\",source=\"events\",tier=\"default\"}",
        4.0,
    )
    .await;
    assert_eq!(predictions(&gw, "events", "wrong").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_its_draining_backend_evicted_moves_and_one_it_holds_stays() {
    let a = SimBackend::start("drain-a", EVENTS);
    let b = SimBackend::start("drain-b", EVENTS);
    let gw = gateway(&[&a, &b], "").await;
    let c = client();
    let mut conv = Conversation::new("kept");
    let first = chat(
        &c,
        &gw,
        &[
            ("x-session-id", "kept"),
            ("x-agent-serve-backend-id", "drain-a"),
        ],
        &conv.next(0),
    )
    .await;
    assert_eq!(first.status, 200);
    // Bound where it went? Its next turn, unnamed, says.
    let r = chat(&c, &gw, &[("x-session-id", "kept")], &conv.next(1)).await;
    let home = r.backend.clone().unwrap();
    let (home_sim, other) = if home == "drain-a" {
        (&a, "drain-b")
    } else {
        (&b, "drain-a")
    };
    // Drained without moving sessions: one whose cache is there stays.
    let drain = client()
        .post(gw.admin_url(&format!("/admin/backends/{home}/drain")))
        .json(&json!({"move_sessions": false}))
        .send()
        .await
        .unwrap();
    assert!(drain.status().is_success());
    let r = chat(&c, &gw, &[("x-session-id", "kept")], &conv.next(2)).await;
    assert_eq!(
        r.backend.as_deref(),
        Some(home.as_str()),
        "it holds the session: stay"
    );
    // Its engine empties its cache (vLLM's reset_prefix_cache): the
    // session holds nothing there, and moves off the draining backend.
    let reset = client()
        .post(home_sim.url("/reset_prefix_cache"))
        .send()
        .await
        .unwrap();
    assert!(reset.status().is_success());
    wait_until("the engine's clear seen", || async {
        kv_of(&gw, &home).await["blocks_held"] == 0
    })
    .await;
    let r = chat(&c, &gw, &[("x-session-id", "kept")], &conv.next(3)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.backend.as_deref(), Some(other), "evicted: it moves");
}
