//! The gateway in front of real inference engines: llama.cpp's own HTTP
//! server (CPU, one thread each) serving a generated tiny llama model. What
//! the simulator cannot show: a real tokenizer and KV cache reporting cached
//! tokens, real SSE framing, and an HTTP server that closes keep-alive
//! connections on its own schedule.
//!
//! Needs the engine (`scripts/engine/setup.sh`, which `scripts/test.sh` runs).

mod common;

use agent_gateway_tools::engine::{Engine, EngineOptions, ModelShape, Workdir};
use agent_gateway_tools::loadgen::{self, BenchArgs};
use common::*;
use serde_json::{json, Value};
use std::net::SocketAddr;

/// Three llama.cpp replicas and a gateway in front of them.
struct EngineFleet {
    engines: Vec<Engine>,
    ids: Vec<String>,
    gw: Gateway,
    trace: std::path::PathBuf,
    _trace_dir: tempfile::TempDir,
    _work: Workdir,
}

impl EngineFleet {
    async fn start(replicas: usize) -> EngineFleet {
        Self::start_with(replicas, EngineOptions::default()).await
    }

    async fn start_with(replicas: usize, opts: EngineOptions) -> EngineFleet {
        Self::start_sections(replicas, opts, "").await
    }

    /// With `sections` (YAML) added to the gateway's config.
    async fn start_sections(replicas: usize, opts: EngineOptions, sections: &str) -> EngineFleet {
        let work = Workdir::new().expect("engine workdir");
        let model = work
            .model(&opts.python, ModelShape::TINY)
            .expect("model generated (is the engine installed? scripts/engine/setup.sh)");
        let engines: Vec<Engine> = (0..replicas)
            .map(|_| Engine::start(&work, &model, &opts).expect("llama.cpp server starts"))
            .collect();
        let ids: Vec<String> = (0..replicas).map(|i| format!("llama-{i}")).collect();
        let backends = engines
            .iter()
            .zip(&ids)
            .map(|(e, id)| (id.clone(), e.addr.parse::<SocketAddr>().unwrap(), 1))
            .collect();
        let tiers = [TierSpec {
            name: "default",
            default: true,
            models: &["tiny"],
            backends,
        }];
        let trace_dir = tempfile::tempdir().unwrap();
        let trace = trace_dir.path().join("trace.jsonl");
        // A slow probe on a busy 2-core box must not flip a backend.
        let extra = format!(
            "health:\n  path: /health\n  interval_ms: 500\n  timeout_ms: 3000\n{}trace:\n  path: \"{}\"\nload:\n  interval_ms: 200\n  timeout_ms: 2000\n{sections}",
            affinity_yaml(600),
            trace.display()
        );
        let gw = Gateway::start(&tiers, &extra).await;
        EngineFleet {
            engines,
            ids,
            gw,
            trace,
            _trace_dir: trace_dir,
            _work: work,
        }
    }

    fn engine_of(&mut self, backend: &str) -> &mut Engine {
        let i = self
            .ids
            .iter()
            .position(|id| id == backend)
            .expect("known backend");
        &mut self.engines[i]
    }

    /// Trace lines of one session, in order.
    async fn traced(&self, session: &str, expect: usize) -> Vec<Value> {
        let path = self.trace.clone();
        let lines = move || -> Vec<Value> {
            std::fs::read_to_string(&path)
                .unwrap_or_default()
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter(|v| v["session"] == session)
                .collect()
        };
        let ready = lines.clone();
        wait_until("trace lines written", || {
            let n = ready().len();
            async move { n >= expect }
        })
        .await;
        lines()
    }
}

/// An agent transcript: system prompt, then alternating user/assistant turns.
struct Transcript {
    messages: Vec<Value>,
}

impl Transcript {
    fn new(session: &str) -> Transcript {
        let system = format!(
            "You are a coding agent for session {session}. Read the file, run the test, fix the error and review the result. "
        )
        .repeat(12);
        Transcript {
            messages: vec![json!({"role": "system", "content": system})],
        }
    }

    fn body(&mut self, turn: usize, stream: bool) -> Value {
        self.messages.push(json!({"role": "user", "content": format!("turn {turn}: call the tool and read the result")}));
        let mut b = json!({"model": "tiny", "messages": self.messages, "max_tokens": 6});
        if stream {
            b["stream"] = json!(true);
            b["stream_options"] = json!({"include_usage": true});
        }
        b
    }

    fn answered(&mut self, text: &str) {
        self.messages
            .push(json!({"role": "assistant", "content": text}));
    }
}

fn cached_tokens(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_stays_on_one_engine_and_its_cache_is_reused() {
    let fleet = EngineFleet::start(3).await;
    let c = client();
    let mut t = Transcript::new("pinned");
    let mut backends = Vec::new();
    for turn in 0..4 {
        let r = chat(
            &c,
            &fleet.gw,
            &[("x-session-id", "pinned")],
            &t.body(turn, false),
        )
        .await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        let v = r.json();
        let meta = &v["x_agent_serve"];
        assert_eq!(meta["backend"].as_str(), r.backend.as_deref());
        assert_eq!(meta["affinity_hit"], json!(turn > 0));
        assert_eq!(meta["session"], "pinned");
        let cached = cached_tokens(&v["usage"]);
        if turn == 0 {
            assert_eq!(cached, 0, "a cold engine has nothing cached");
        } else {
            // The engine itself says it reused the transcript: nearly all of the prompt.
            let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
            assert!(
                cached * 10 > prompt * 8,
                "turn {turn}: {cached} of {prompt} cached"
            );
        }
        t.answered(v["choices"][0]["message"]["content"].as_str().unwrap_or(""));
        backends.push(r.backend.unwrap());
    }
    assert!(backends.iter().all(|b| *b == backends[0]), "{backends:?}");

    let lines = fleet.traced("pinned", 4).await;
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[0]["cached_tokens"], 0);
    for l in &lines[1..] {
        assert_eq!(l["backend"].as_str(), Some(backends[0].as_str()));
        assert_eq!(l["affinity_hit"], true);
        assert!(l["cached_tokens"].as_u64().unwrap() > 0, "{l}");
    }
    // The gateway's token counters read the same usage.
    let cached_total = fleet
        .gw
        .metric("agentserve_cached_prompt_tokens_total{")
        .await;
    assert!(cached_total > 0.0);
}

/// Read an SSE response to the end: (events, text, usage).
async fn read_stream(resp: reqwest::Response) -> (usize, String, Value) {
    let body = resp.text().await.expect("stream completes");
    let mut events = 0;
    let mut text = String::new();
    let mut usage = Value::Null;
    let mut done = false;
    for event in body.split("\n\n").filter(|e| !e.is_empty()) {
        let data = event.strip_prefix("data: ").expect("data events");
        events += 1;
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).expect("JSON event");
        if let Some(s) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(s);
        }
        if v["usage"].is_object() {
            usage = v["usage"].clone();
        }
    }
    assert!(done, "stream ends with [DONE]");
    (events, text, usage)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_turns_carry_the_engines_usage_through_the_gateway() {
    let fleet = EngineFleet::start(2).await;
    let c = client();
    let mut t = Transcript::new("streamed");
    for turn in 0..2 {
        let resp = c
            .post(fleet.gw.url("/v1/chat/completions"))
            .header("x-session-id", "streamed")
            .json(&t.body(turn, true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        assert!(resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"));
        assert_eq!(
            resp.headers()["x-agent-serve-affinity-hit"],
            if turn == 0 { "false" } else { "true" }
        );
        let (events, text, usage) = read_stream(resp).await;
        // Role, six tokens, finish, usage, [DONE]: each its own event.
        assert!(events >= 6, "{events} events");
        assert!(usage["prompt_tokens"].as_u64().unwrap() > 0);
        if turn == 1 {
            assert!(cached_tokens(&usage) > 0, "{usage}");
        }
        t.answered(&text);
    }
    let lines = fleet.traced("streamed", 2).await;
    assert!(
        lines[0]["prompt_tokens"].as_u64().unwrap() > 0,
        "{}",
        lines[0]
    );
    assert!(
        lines[1]["cached_tokens"].as_u64().unwrap() > 0,
        "{}",
        lines[1]
    );
}

/// llama.cpp closes a connection right after every streamed response although
/// it advertised keep-alive. Under concurrent streams the gateway now and then
/// takes such a connection from its pool in the moment before the close
/// arrives; before the replay each such request failed with 502
/// ("ConnectionClosed while reading response headers, bytes already read: 0").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_never_fail_on_a_connection_the_engine_closed() {
    let fleet = EngineFleet::start(1).await;
    let c = client();
    let url = fleet.gw.url("/v1/chat/completions");
    let workers = (0..8).map(|w| {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(async move {
            let mut t = Transcript::new(&format!("worker-{w}"));
            let body = t.body(0, true);
            let mut failed = Vec::new();
            for _ in 0..40 {
                let sent = c
                    .post(&url)
                    .header("x-session-id", format!("worker-{w}"))
                    .json(&body)
                    .send()
                    .await;
                match sent {
                    Ok(resp) if resp.status() == 200 => {
                        read_stream(resp).await;
                    }
                    Ok(resp) => failed.push(format!(
                        "{}: {}",
                        resp.status(),
                        resp.text().await.unwrap_or_default()
                    )),
                    Err(e) => failed.push(format!("no response: {e}")),
                }
            }
            failed
        })
    });
    let failed: Vec<_> = futures_util::future::join_all(workers)
        .await
        .into_iter()
        .flat_map(|r| r.expect("worker"))
        .collect();
    assert!(
        failed.is_empty(),
        "{} of 320 failed: {:?}",
        failed.len(),
        failed.first()
    );
    // The engine's closes were met and handled (re-sent, then the backend no
    // longer pooled), not absent: this test exercises the race.
    let retries = fleet.gw.metric("agentserve_upstream_retries_total{").await;
    assert!(
        retries >= 1.0,
        "no replay happened: the race was not exercised"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_engine_costs_its_sessions_one_rebind_and_clients_nothing() {
    let mut fleet = EngineFleet::start(3).await;
    let c = client();
    let sessions: Vec<String> = (0..6).map(|i| format!("agent-{i}")).collect();
    let mut transcripts: Vec<Transcript> = sessions.iter().map(|s| Transcript::new(s)).collect();
    let mut placed: Vec<Vec<String>> = vec![Vec::new(); sessions.len()];

    async fn round(
        c: &reqwest::Client,
        gw: &Gateway,
        sessions: &[String],
        transcripts: &mut [Transcript],
        placed: &mut [Vec<String>],
        turn: usize,
    ) {
        let bodies: Vec<Value> = transcripts
            .iter_mut()
            .map(|t| t.body(turn, false))
            .collect();
        let replies =
            futures_util::future::join_all(sessions.iter().zip(&bodies).map(|(s, b)| async move {
                chat(c, gw, &[("x-session-id", s.as_str())], b).await
            }))
            .await;
        for (i, r) in replies.into_iter().enumerate() {
            assert_eq!(
                r.status,
                200,
                "turn {turn}: {}",
                String::from_utf8_lossy(&r.body)
            );
            let v = r.json();
            transcripts[i].answered(v["choices"][0]["message"]["content"].as_str().unwrap_or(""));
            placed[i].push(r.backend.unwrap());
        }
    }

    // Two rounds, then the engine of session 0 dies, then two more rounds.
    let mut victim = String::new();
    let mut on_victim = 0;
    for turn in 0..4 {
        if turn == 2 {
            victim = placed[0][1].clone();
            on_victim = placed.iter().filter(|p| p[1] == victim).count();
            fleet.engine_of(&victim).kill();
        }
        round(
            &c,
            &fleet.gw,
            &sessions,
            &mut transcripts,
            &mut placed,
            turn,
        )
        .await;
    }
    for p in &placed {
        if p[1] == victim {
            // Moved once, then stays put on its new backend.
            assert_ne!(p[2], victim, "{p:?}");
            assert_eq!(p[3], p[2], "{p:?}");
        } else {
            assert!(
                p.iter().all(|b| *b == p[0]),
                "an unaffected session moved: {p:?}"
            );
        }
    }
    let broken = fleet.gw.metric("agentserve_affinity_broken_total{").await;
    assert_eq!(
        broken as usize, on_victim,
        "one rebind per session of the dead engine"
    );
}

/// Many sessions at 8 concurrent through the gateway: every request answered.
/// The same load straight to the engines is the baseline (printed, not
/// asserted: that is llama.cpp's behaviour, not ours).
/// Agent sessions sized for the tiny model, through `fleet`'s gateway.
fn tiny_workload(
    fleet: &EngineFleet,
    sessions: usize,
    turns: usize,
    concurrency: usize,
) -> BenchArgs {
    let mut a = BenchArgs::seed_study(&fleet.gw.url(""));
    a.model = "tiny".into();
    a.sessions = sessions;
    a.turns = turns;
    a.concurrency = concurrency;
    a.system_prompt_bytes = 1200;
    a.user_bytes = 100;
    a.max_tokens = 6;
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sessions_through_the_gateway_see_no_errors() {
    // Six slots an engine: each holds the conversations placed on it (16
    // over 3 engines), so a lost transcript is routing's doing, not slots
    // taken by other conversations on the same engine (with 4, an engine's
    // 5 or 6 conversations evict one another whatever the gateway does).
    let opts = EngineOptions {
        slots: 6,
        ..EngineOptions::default()
    };
    let fleet = EngineFleet::start_with(3, opts).await;
    let mut a = tiny_workload(&fleet, 16, 10, 8);
    a.label = "through the gateway".into();
    let through = loadgen::run(&a).await;

    let mut direct = a.clone();
    direct.url = fleet
        .engines
        .iter()
        .map(Engine::url)
        .collect::<Vec<_>>()
        .join(",");
    direct.label = "round robin, no gateway".into();
    direct.id_prefix = "direct".into();
    let baseline = loadgen::run(&direct).await;
    // The same workload with no session id at all, as the OpenAI SDKs send
    // it (other text, so it finds none of the runs before it cached).
    let mut keyless = a.clone();
    keyless.keyless = true;
    keyless.label = "no session id, through the gateway".into();
    keyless.id_prefix = "keyless".into();
    let keyless = loadgen::run(&keyless).await;
    println!(
        "{}",
        loadgen::report::comparison_table(&[through.clone(), keyless.clone(), baseline.clone()])
    );
    for r in [&through, &keyless] {
        assert_eq!(r.requests, 160, "{}", r.label);
        assert_eq!(r.errors, 0, "{}: the gateway failed requests", r.label);
        assert_eq!(r.same_backend_rate, 1.0, "{}", r.label);
        assert!(
            r.prefix_cache_hit_rate > baseline.prefix_cache_hit_rate,
            "{}",
            r.label
        );
    }
    for r in [&through, &keyless, &baseline] {
        println!(
            "{}: warm turns' prefix-cache hit {:.3}",
            r.label, r.warm_prefix_cache_hit_rate
        );
    }
    // From its second turn on, a conversation finds its transcript cached.
    assert!(
        keyless.warm_prefix_cache_hit_rate >= 0.8,
        "{}",
        keyless.warm_prefix_cache_hit_rate
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_engines_own_load_gauges_are_read_and_shown() {
    let fleet = EngineFleet::start(1).await;
    // llama.cpp's `llamacpp:requests_processing` / `requests_deferred`,
    // scraped from its /metrics, in the admin API and the gateway's gauges.
    let admin = fleet.gw.admin_url("/admin/backends");
    wait_until("a scrape of llama.cpp's /metrics", || {
        let admin = admin.clone();
        async move {
            let v: Value = match reqwest::get(&admin).await {
                Ok(r) => r.json().await.unwrap_or(Value::Null),
                Err(_) => Value::Null,
            };
            v["backends"][0]["engine"]["running"].is_u64()
                && v["backends"][0]["engine"]["waiting"].is_u64()
        }
    })
    .await;
    let running = "agentserve_backend_engine_requests{backend=\"llama-0\",state=\"running\",tier=\"default\"}";
    wait_until("the running gauge exported", || {
        let gw = &fleet.gw;
        // Present, and read from the engine (-1 until a scrape is in).
        async move {
            gw.metrics_text().await.lines().any(|l| {
                l.strip_prefix(running)
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .is_some_and(|v| v >= 0.0)
            })
        }
    })
    .await;
    assert_eq!(
        fleet
            .gw
            .metric("agentserve_load_scrape_failures_total{")
            .await,
        0.0
    );
    // Its own count of decode time (`llamacpp:tokens_predicted_seconds_total`
    // over `tokens_predicted_total`) teaches the decode speed from JSON
    // answers alone, which show none (their first byte follows their whole
    // decode): what of a JSON answer's wait was prefill is told so.
    let c = client();
    let mut t = Transcript::new("decode");
    for turn in 0..3 {
        let r = chat(
            &c,
            &fleet.gw,
            &[("x-session-id", "decode")],
            &t.body(turn, false),
        )
        .await;
        assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
        t.answered(
            r.json()["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or(""),
        );
    }
    wait_until("the decode speed read from the engine", || async {
        fleet.gw.admin_backend("llama-0").await["learned"]["decode_us_per_token"].as_f64()
            > Some(0.0)
    })
    .await;
}

/// Two tenants on real engines at three times their slots, admission on
/// (each engine's `max_in_flight` is its slots): nobody gets an error, the
/// gateway does the queueing (the engines' own queues stay short), and the
/// quiet tenant's turns are served beside the noisy one's. Its latency
/// against running alone is printed; the bound on it is a benchmark's
/// (`scripts/bench-admission.sh`), not a test's, on a noisy 2-core box.
/// `ENGINE_ADMISSION` replaces the admission section for a measurement
/// (`off`: none; `learned`: `enabled: true` alone); `NOISY_TURNS` gives the
/// noisy tenant's conversations that many turns (4: a five-second run, most
/// of it the gateway's start, before it has learned the engines).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_at_three_times_the_slots_see_no_errors_with_admission() {
    let opts = EngineOptions {
        slots: 2,
        ..EngineOptions::default()
    };
    let mode = std::env::var("ENGINE_ADMISSION").unwrap_or_default();
    let section = match mode.as_str() {
        "off" => "",
        "learned" => "admission:\n  enabled: true\n  max_wait_ms: 120000\n",
        _ => "admission:\n  enabled: true\n  max_in_flight: 2\n  max_prefilling: 1\n  max_wait_ms: 120000\n",
    };
    let fleet = EngineFleet::start_sections(3, opts, section).await;
    let mut quiet = tiny_workload(&fleet, 2, 6, 1);
    quiet.headers = vec![("authorization".into(), "Bearer sk-quiet".into())];
    quiet.label = "quiet alone".into();
    quiet.id_prefix = "quiet-alone".into();
    let alone = loadgen::run(&quiet).await;

    // 18 conversations at once: three times the fleet's 6 slots.
    let mut noisy = quiet.clone();
    noisy.sessions = 18;
    let noisy_turns = std::env::var("NOISY_TURNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    noisy.turns = noisy_turns;
    noisy.concurrency = 18;
    noisy.headers = vec![("authorization".into(), "Bearer sk-noisy".into())];
    noisy.label = "noisy".into();
    noisy.id_prefix = "noisy".into();
    let noisy_run = tokio::spawn(async move { loadgen::run(&noisy).await });
    wait_until("the noisy tenant to fill the engines", || async {
        let m = fleet.gw.metrics_text().await;
        let queued = metric_value(
            &m,
            "agentserve_admission_queued{class=\"normal\",tier=\"default\"}",
        );
        let running: f64 = m
            .lines()
            .filter(|l| l.starts_with("agentserve_backend_in_flight{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        queued >= 3.0 || (mode == "off" && running >= 6.0)
    })
    .await;
    quiet.label = "quiet beside noisy".into();
    quiet.id_prefix = "quiet-beside".into();
    let beside = loadgen::run(&quiet).await;
    let noisy = noisy_run.await.unwrap();
    println!(
        "{}",
        loadgen::report::comparison_table(&[alone.clone(), beside.clone(), noisy.clone()])
    );
    println!(
        "quiet TTFT p99 beside noisy / alone: {:.2}",
        beside.ttft.p99_ms / alone.ttft.p99_ms.max(1e-9)
    );
    for r in [&alone, &beside, &noisy] {
        assert_eq!(r.errors, 0, "{}: requests failed", r.label);
    }
    assert_eq!(noisy.requests, 18 * noisy_turns);
    if mode == "off" {
        return;
    }
    let m = fleet.gw.metrics_text().await;
    assert!(
        metric_value(&m, "agentserve_admission_admitted_total{class=\"normal\",path=\"queued\",tier=\"default\"}") > 0.0,
        "the gateway queued nothing: the engines did all the waiting"
    );
}
