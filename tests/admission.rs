//! Admission (issue 29) end to end: a real gateway process in front of
//! simulated replicas whose streams it holds open (`hold_streams`), so a
//! backend's one slot stays taken until the test lets it go. What is
//! asserted is what a client sees: who is served when, the 429 and its
//! `Retry-After`, that a refused request never reached the engine, and 401s.

mod common;
use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};

/// One replica that runs one request at a time, behind a gateway with
/// admission on (`max_wait_ms` as given) and `extra` sections.
async fn one_slot(max_wait_ms: u64, extra: &str) -> (Vec<SimBackend>, Gateway) {
    fleet(
        1,
        &format!(
            "{}admission:\n  enabled: true\n  max_in_flight: 1\n  max_wait_ms: {max_wait_ms}\n{extra}",
            affinity_yaml(600)
        ),
    )
    .await
}

/// Start a stream that the replica holds open after its first token: it
/// keeps the backend's one slot until `release_streams`.
async fn hold_the_slot(
    gw: &Gateway,
    sim: &SimBackend,
    headers: &[(&str, &str)],
) -> impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>> {
    sim.set_faults(json!({"hold_streams": true})).await;
    let mut body = chat_body("qwen3-8b", 0);
    body["stream"] = json!(true);
    let mut req = client()
        .post(gw.url("/v1/chat/completions"))
        .header("x-session-id", "holder");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.json(&body).send().await.expect("stream starts");
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    let first = stream.next().await.expect("first event").expect("bytes");
    assert!(first.starts_with(b"data: "));
    stream
}

fn queued(class: &str) -> String {
    format!("agentserve_admission_queued{{class=\"{class}\",tier=\"default\"}}")
}

async fn engine_requests(sim: &SimBackend) -> u64 {
    sim.stats().await["requests"].as_u64().unwrap()
}

#[tokio::test]
async fn a_request_past_its_deadline_gets_429_with_retry_after_and_never_reaches_the_engine() {
    let (sims, gw) = one_slot(400, "").await;
    let mut held = hold_the_slot(&gw, &sims[0], &[]).await;
    let before = engine_requests(&sims[0]).await;
    let r = chat(
        &client(),
        &gw,
        &[("x-session-id", "late")],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 429, "{}", String::from_utf8_lossy(&r.body));
    let retry: u64 = r.headers["retry-after"].to_str().unwrap().parse().unwrap();
    assert!(retry >= 1);
    let e = r.json();
    assert_eq!(e["error"]["code"], "queue_timeout");
    assert_eq!(e["error"]["type"], "rate_limit_error");
    assert_eq!(
        engine_requests(&sims[0]).await,
        before,
        "a refused request must not reach the engine"
    );
    assert_eq!(
        gw.metric("agentserve_admission_rejected_total{class=\"normal\",reason=\"deadline\",tier=\"default\"}")
            .await,
        1.0
    );
    // A request's own, shorter deadline is kept too.
    let r = chat(
        &client(),
        &gw,
        &[("x-session-id", "late"), ("x-agent-serve-max-wait-ms", "1")],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 429);
    sims[0].release_streams().await;
    while held.next().await.is_some() {}
    // The slot is free again: served at once.
    let r = chat(
        &client(),
        &gw,
        &[("x-session-id", "late")],
        &chat_body("qwen3-8b", 1),
    )
    .await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn a_queued_request_is_served_when_the_slot_frees_and_a_client_that_leaves_leaves_the_queue()
{
    let (sims, gw) = one_slot(60_000, "").await;
    let mut held = hold_the_slot(&gw, &sims[0], &[]).await;
    // One client gives up while queued...
    let gone = tokio::spawn({
        let url = gw.url("/v1/chat/completions");
        async move {
            let _ = client()
                .post(url)
                .header("x-session-id", "impatient")
                .json(&chat_body("qwen3-8b", 0))
                .send()
                .await;
        }
    });
    wait_until("the impatient request to queue", || async {
        gw.metric(&queued("normal")).await == 1.0
    })
    .await;
    gone.abort();
    let _ = gone.await;
    wait_until("the queue to let it go", || async {
        gw.metric(&queued("normal")).await == 0.0
    })
    .await;
    assert_eq!(
        gw.metric("agentserve_admission_rejected_total{class=\"normal\",reason=\"client_gone\",tier=\"default\"}")
            .await,
        1.0
    );
    // ...another waits and is served once the slot is given back.
    let patient = tokio::spawn({
        let url = gw.url("/v1/chat/completions");
        async move {
            client()
                .post(url)
                .header("x-session-id", "patient")
                .json(&chat_body("qwen3-8b", 0))
                .send()
                .await
                .map(|r| r.status().as_u16())
        }
    });
    wait_until("the patient request to queue", || async {
        gw.metric(&queued("normal")).await == 1.0
    })
    .await;
    let before = engine_requests(&sims[0]).await;
    sims[0].release_streams().await;
    while held.next().await.is_some() {}
    assert_eq!(patient.await.unwrap().unwrap(), 200);
    assert_eq!(
        engine_requests(&sims[0]).await,
        before + 1,
        "the one that left never reached the engine"
    );
    assert_eq!(
        gw.metric("agentserve_admission_admitted_total{class=\"normal\",path=\"queued\",tier=\"default\"}")
            .await,
        1.0
    );
}

/// Queue one request per `(name, headers)` in turn, each only once the one
/// before it is waiting, then free the slot; the order they were served in.
async fn served_order(
    gw: &Gateway,
    sim: &SimBackend,
    holder: &[(&str, &str)],
    requests: Vec<(&'static str, Vec<(&'static str, String)>)>,
) -> Vec<&'static str> {
    let mut held = hold_the_slot(gw, sim, holder).await;
    let order = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, (name, headers)) in requests.into_iter().enumerate() {
        let url = gw.url("/v1/chat/completions");
        let order = std::sync::Arc::clone(&order);
        tasks.push(tokio::spawn(async move {
            let mut req = client()
                .post(url)
                .header("x-session-id", format!("req-{i}"))
                .json(&chat_body("qwen3-8b", i));
            for (k, v) in &headers {
                req = req.header(*k, v);
            }
            let status = req.send().await.expect("answered").status();
            assert_eq!(status, 200);
            order.lock().push(name);
        }));
        wait_until("the request to queue", || async {
            let m = gw.metrics_text().await;
            let total: f64 = ["interactive", "normal", "batch"]
                .iter()
                .map(|c| metric_value(&m, &queued(c)))
                .sum();
            total == (i + 1) as f64
        })
        .await;
    }
    sim.release_streams().await;
    while held.next().await.is_some() {}
    for t in tasks {
        t.await.unwrap();
    }
    let v = order.lock().clone();
    v
}

#[tokio::test]
async fn interactive_turns_go_before_normal_and_batch_that_came_first() {
    let (sims, gw) = one_slot(60_000, "").await;
    let p = |class: &str| vec![("x-agent-serve-priority", class.to_string())];
    let order = served_order(
        &gw,
        &sims[0],
        &[],
        vec![
            ("batch", p("batch")),
            ("normal", p("normal")),
            ("interactive", p("interactive")),
        ],
    )
    .await;
    assert_eq!(order, ["interactive", "normal", "batch"]);
    // A class that is not one is refused, not guessed.
    let r = chat(
        &client(),
        &gw,
        &[("x-agent-serve-priority", "urgent")],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["code"], "invalid_priority");
}

#[tokio::test]
async fn a_quiet_tenant_is_not_stuck_behind_a_noisy_tenants_queue() {
    let (sims, gw) = one_slot(60_000, "").await;
    let key = |k: &str| vec![("authorization", format!("Bearer {k}"))];
    let mut requests: Vec<(&'static str, Vec<(&'static str, String)>)> =
        (0..6).map(|_| ("noisy", key("sk-noisy"))).collect();
    requests.push(("quiet", key("sk-quiet")));
    let order = served_order(
        &gw,
        &sims[0],
        &[("authorization", "Bearer sk-noisy")],
        requests,
    )
    .await;
    let quiet_at = order.iter().position(|n| *n == "quiet").unwrap();
    // It came last, behind six of the noisy tenant's: without fair share it
    // would be served last; with it, it goes next but one at most.
    assert!(quiet_at <= 1, "served {order:?}");
}

#[tokio::test]
async fn client_keys_give_401_and_429_per_limit_and_reload_with_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.yaml");
    std::fs::write(
        &keys,
        keys_file(&[("sk-alpha-secret", "alpha", "    max_in_flight: 1\n")]),
    )
    .unwrap();
    let sims = [SimBackend::start("vllm-0", &[])];
    let (gw, log) = Gateway::start_logging(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!(
            "{FAST_HEALTH}{}auth:\n  keys_file: \"{}\"\n  required: true\n  upstream_authorization: strip\n",
            affinity_yaml(600),
            keys.display()
        ),
    )
    .await;
    let c = client();
    let body = chat_body("qwen3-8b", 0);
    // No key, a wrong key: 401.
    for headers in [vec![], vec![("authorization", "Bearer sk-alpha-secreT")]] {
        let r = chat(&c, &gw, &headers, &body).await;
        assert_eq!(r.status, 401);
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
    }
    // The key, as a bearer token or as x-api-key.
    let r = chat(&c, &gw, &[("x-api-key", "sk-alpha-secret")], &body).await;
    assert_eq!(r.status, 200);
    // Its tenant may run one request at a time: a second gets 429.
    let mut held = hold_the_slot(
        &gw,
        &sims[0],
        &[("authorization", "Bearer sk-alpha-secret")],
    )
    .await;
    let r = chat(
        &c,
        &gw,
        &[("authorization", "Bearer sk-alpha-secret")],
        &body,
    )
    .await;
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["code"], "rate_limit_exceeded");
    assert!(r.headers.contains_key("retry-after"));
    sims[0].release_streams().await;
    while held.next().await.is_some() {}

    // SIGHUP: a new key comes in, the old one goes.
    std::fs::write(&keys, keys_file(&[("sk-beta-secret", "beta", "")])).unwrap();
    gw.reload("success", 1.0).await;
    let r = chat(
        &c,
        &gw,
        &[("authorization", "Bearer sk-beta-secret")],
        &body,
    )
    .await;
    assert_eq!(r.status, 200);
    let r = chat(
        &c,
        &gw,
        &[("authorization", "Bearer sk-alpha-secret")],
        &body,
    )
    .await;
    assert_eq!(r.status, 401);
    // A keys file that does not load is refused, and the keys in force stay.
    std::fs::write(&keys, "keys: [{ key_sha256: nothex, tenant: x }]\n").unwrap();
    gw.reload("error", 1.0).await;
    let r = chat(
        &c,
        &gw,
        &[("authorization", "Bearer sk-beta-secret")],
        &body,
    )
    .await;
    assert_eq!(r.status, 200);

    // Tenants by name in metrics (counted as each request ends, just after
    // its answer went out); no key anywhere.
    wait_until("beta's requests counted", || async {
        gw.metric("agentserve_tenant_requests_total{tenant=\"beta\"}")
            .await
            >= 2.0
    })
    .await;
    let m = gw.metrics_text().await;
    assert_eq!(
        metric_value(
            &m,
            "agentserve_client_rejected_total{reason=\"max_in_flight\",tenant=\"alpha\"}"
        ),
        1.0,
        "{m}"
    );
    let admin: Value = c
        .get(gw.admin_url("/admin/admission"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(admin["tenants"], json!(["beta"]));
    let logged = std::fs::read_to_string(&log).unwrap();
    for secret in ["sk-alpha-secret", "sk-beta-secret"] {
        assert!(!m.contains(secret), "a key in the metrics");
        assert!(!logged.contains(secret), "a key in the log");
        assert!(
            !admin.to_string().contains(secret),
            "a key in the admin view"
        );
    }
}

/// The official OpenAI Python SDK, pointed at the gateway, sent a 429 with
/// `Retry-After` while the backend's slot is taken: it waits, retries and
/// completes, as its users expect.
#[tokio::test]
async fn the_openai_python_sdk_retries_a_429_and_completes() {
    let (sims, gw) = one_slot(300, "").await;
    let mut held = hold_the_slot(&gw, &sims[0], &[]).await;
    let script = r#"
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="sk-sdk", max_retries=8)
r = client.chat.completions.create(
    model="qwen3-8b",
    messages=[{"role": "user", "content": "hello"}],
    max_tokens=4,
    extra_headers={"x-session-id": "sdk-session"},
)
print("completed", r.choices[0].finish_reason)
"#;
    let python = agent_gateway_tools::engine::default_python();
    let sdk = tokio::process::Command::new(&python)
        .arg("-c")
        .arg(script)
        .arg(gw.url("/v1"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("{} (run scripts/setup.sh): {e}", python.display()));
    // Its first attempt is refused...
    wait_until("the SDK's first attempt to get its 429", || async {
        gw.metric("agentserve_admission_rejected_total{class=\"normal\",reason=\"deadline\",tier=\"default\"}")
            .await
            >= 1.0
    })
    .await;
    // ...then the slot frees, and its retry gets it.
    sims[0].release_streams().await;
    while held.next().await.is_some() {}
    let out = sdk.wait_with_output().await.unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.starts_with("completed"),
        "the SDK failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test]
async fn a_subagent_inherits_its_parents_class_unless_it_names_one() {
    let (sims, gw) = one_slot(60_000, "").await;
    // The parent session's turn says it is interactive.
    let r = chat(
        &client(),
        &gw,
        &[
            ("x-session-id", "lead"),
            ("x-agent-serve-priority", "interactive"),
        ],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 200);
    let h = |pairs: &[(&'static str, &str)]| -> Vec<(&'static str, String)> {
        pairs.iter().map(|(k, v)| (*k, v.to_string())).collect()
    };
    let order = served_order(
        &gw,
        &sims[0],
        &[],
        vec![
            ("normal", h(&[])),
            (
                "batch subagent",
                h(&[
                    ("x-parent-session-id", "lead"),
                    ("x-agent-serve-priority", "batch"),
                ]),
            ),
            ("subagent", h(&[("x-parent-session-id", "lead")])),
        ],
    )
    .await;
    assert_eq!(order, ["subagent", "normal", "batch subagent"]);
}

#[tokio::test]
async fn keys_reloaded_under_load_fail_no_request_of_a_key_that_stays() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.yaml");
    let with_b = keys_file(&[("sk-stays", "a", ""), ("sk-comes-and-goes", "b", "")]);
    let without_b = keys_file(&[("sk-stays", "a", "")]);
    std::fs::write(&keys, &without_b).unwrap();
    let (_sims, gw) = fleet(
        2,
        &format!(
            "{}admission:\n  enabled: true\n  max_in_flight: 2\nauth:\n  keys_file: \"{}\"\n  required: true\n",
            affinity_yaml(600),
            keys.display()
        ),
    )
    .await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load: Vec<_> = (0..4)
        .map(|i| {
            let (url, stop) = (gw.url("/v1/chat/completions"), std::sync::Arc::clone(&stop));
            tokio::spawn(async move {
                let c = client();
                let mut statuses = Vec::new();
                let mut turn = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let r = c
                        .post(&url)
                        .header("authorization", "Bearer sk-stays")
                        .header("x-session-id", format!("steady-{i}"))
                        .json(&chat_body("qwen3-8b", turn))
                        .send()
                        .await
                        .map(|r| r.status().as_u16());
                    statuses.push(r.unwrap_or(0));
                    turn += 1;
                }
                statuses
            })
        })
        .collect();
    let c = client();
    for round in 1..=6 {
        let adding = round % 2 == 1;
        std::fs::write(&keys, if adding { &with_b } else { &without_b }).unwrap();
        gw.reload("success", round as f64).await;
        let r = chat(
            &c,
            &gw,
            &[("authorization", "Bearer sk-comes-and-goes")],
            &chat_body("qwen3-8b", 0),
        )
        .await;
        assert_eq!(r.status, if adding { 200 } else { 401 }, "round {round}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut sent = 0;
    for t in load {
        let statuses = t.await.unwrap();
        sent += statuses.len();
        assert!(statuses.iter().all(|s| *s == 200), "{statuses:?}");
    }
    assert!(sent >= 4, "the load ran");
}

#[tokio::test]
async fn a_new_sessions_concurrent_requests_queue_together_not_behind_single_flight() {
    // Single-flight patience far beyond the test's: a second request of the
    // session must not wait for the first to connect while that one queues.
    let (sims, gw) = fleet(
        1,
        "affinity:\n  sticky_ttl_seconds: 600\n  hash_key: \"79257ee2c923c2f2f8da8c4964db8a06cbb7459dca11cb29c7c649bf35fcf99c\"\n  single_flight_wait_ms: 600000\nadmission:\n  enabled: true\n  max_in_flight: 1\n  max_wait_ms: 600000\n",
    )
    .await;
    let mut held = hold_the_slot(&gw, &sims[0], &[]).await;
    let send = |turn: usize| {
        let url = gw.url("/v1/chat/completions");
        tokio::spawn(async move {
            client()
                .post(url)
                .header("x-session-id", "lead")
                .header("x-parent-session-id", "fresh-parent")
                .json(&chat_body("qwen3-8b", turn))
                .send()
                .await
                .map(|r| r.status().as_u16())
        })
    };
    let first = send(0);
    wait_until("the first to queue", || async {
        gw.metric(&queued("normal")).await == 1.0
    })
    .await;
    let second = send(1);
    wait_until("the second to queue beside it", || async {
        gw.metric(&queued("normal")).await == 2.0
    })
    .await;
    sims[0].release_streams().await;
    while held.next().await.is_some() {}
    assert_eq!(first.await.unwrap().unwrap(), 200);
    assert_eq!(second.await.unwrap().unwrap(), 200);
}

// Issue 36: a tenant cannot dodge what its key grants.

/// A keys file in a fresh directory, and the `auth` section naming it
/// (keys optional: clients without one are served too).
fn keys_section(entries: &[(&str, &str, &str)]) -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.yaml");
    std::fs::write(&keys, keys_file(entries)).unwrap();
    let section = format!("auth:\n  keys_file: \"{}\"\n", keys.display());
    (dir, section)
}

#[tokio::test]
async fn a_keys_class_is_a_ceiling_its_header_can_lower_it_never_raise_it() {
    let (_keys, auth) = keys_section(&[
        ("sk-batch", "bulk", "    priority: batch\n"),
        ("sk-plain", "plain", ""),
        ("sk-person", "desk", "    priority: interactive\n"),
    ]);
    let (sims, gw) = one_slot(60_000, &auth).await;
    let h = |key: &str, class: Option<&str>| {
        let mut v = vec![("authorization", format!("Bearer {key}"))];
        if let Some(c) = class {
            v.push(("x-agent-serve-priority", c.to_string()));
        }
        v
    };
    let order = served_order(
        &gw,
        &sims[0],
        &[],
        vec![
            // First in line, and claiming to be a person waiting.
            (
                "batch key says interactive",
                h("sk-batch", Some("interactive")),
            ),
            (
                "plain key says interactive",
                h("sk-plain", Some("interactive")),
            ),
            ("interactive key says batch", h("sk-person", Some("batch"))),
            ("interactive key", h("sk-person", None)),
        ],
    )
    .await;
    assert_eq!(
        order[..2],
        ["interactive key", "plain key says interactive"],
        "{order:?}"
    );
    let mut rest = order[2..].to_vec();
    rest.sort();
    assert_eq!(
        rest,
        ["batch key says interactive", "interactive key says batch"],
        "{order:?}"
    );
}

#[tokio::test]
async fn the_clients_key_never_reaches_the_engine_once_the_gateway_checks_keys() {
    let (_dir, sims, gw) = fleet_with_keys(&[("sk-own-secret", "acme", "")]).await;
    for header in [
        ("authorization", "Bearer sk-own-secret"),
        ("x-api-key", "sk-own-secret"),
    ] {
        let r = chat(&client(), &gw, &[header], &chat_body("qwen3-8b", 0)).await;
        assert_eq!(r.status, 200);
        let seen = &sims[0].stats().await["last_headers"];
        assert!(
            seen.get(header.0).is_none(),
            "{header:?} reached the engine: {seen}"
        );
    }
    // Without keys the gateway is not the one checking them: the client's
    // own goes on, as an engine started with --api-key needs.
    let (sims, gw) = fleet(1, &affinity_yaml(600)).await;
    let r = chat(
        &client(),
        &gw,
        &[("authorization", "Bearer sk-engine")],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        sims[0].stats().await["last_headers"]["authorization"],
        "Bearer sk-engine"
    );
}

/// A streamed chat request for `tokens` tokens, without
/// `stream_options.include_usage` (the SDKs' default: no usage comes back).
fn long_stream(turn: usize, tokens: u64) -> Value {
    let mut body = chat_body("qwen3-8b", turn);
    body["stream"] = json!(true);
    body["max_tokens"] = json!(tokens);
    body
}

#[tokio::test]
async fn streams_without_usage_are_charged_to_tokens_per_minute() {
    let (_dir, _sims, gw) =
        fleet_with_keys(&[("sk-metered", "metered", "    tokens_per_minute: 3000\n")]).await;
    let key = ("authorization", "Bearer sk-metered");
    // One conversation, turn after turn: from its second turn on the body
    // streams through unread (its max_tokens unknown up front), so only
    // what came back can charge it.
    let mut statuses = Vec::new();
    for turn in 0..4 {
        let r = chat(
            &client(),
            &gw,
            &[key, ("x-session-id", "metered-task")],
            &long_stream(turn, 2500),
        )
        .await;
        let text = String::from_utf8_lossy(&r.body);
        assert!(!text.contains("\"usage\":{"), "no usage came back: {text}");
        statuses.push(r.status);
    }
    assert_eq!(statuses[0], 200, "{statuses:?}");
    assert!(
        statuses.contains(&429),
        "10,000 tokens under 3,000 a minute: {statuses:?}"
    );
}

#[tokio::test]
async fn requests_sent_together_are_charged_before_they_are_answered() {
    let (_dir, _sims, gw) =
        fleet_with_keys(&[("sk-metered", "metered", "    tokens_per_minute: 3000\n")]).await;
    let sent: Vec<_> = (0..4)
        .map(|i| {
            let headers = [
                ("authorization", "Bearer sk-metered".to_string()),
                ("x-session-id", format!("together-{i}")),
            ];
            send_chat(&gw, &headers, &long_stream(i, 2500))
        })
        .collect();
    let mut statuses = Vec::new();
    for s in sent {
        statuses.push(s.await.unwrap());
    }
    assert!(statuses.contains(&200), "{statuses:?}");
    assert!(
        statuses.contains(&429),
        "four 2,500-token requests at once under 3,000 a minute: {statuses:?}"
    );
}

#[tokio::test]
async fn a_queued_turn_of_a_live_session_is_not_cut_for_the_time_it_waited() {
    let sims = [SimBackend::start("vllm-0", &[])];
    // A body must come at 8 KB/s after its first half second.
    let gw = Gateway::start_with(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        |_| "  body_min_rate_bytes_per_s: 8000\n  body_rate_grace_ms: 500\n".to_string(),
        &format!(
            "{FAST_HEALTH}{}admission:\n  enabled: true\n  max_in_flight: 1\n  max_wait_ms: 60000\n",
            affinity_yaml(600)
        ),
    )
    .await;
    let session = [("x-session-id", "long-context")];
    let r = chat(&client(), &gw, &session, &chat_body("qwen3-8b", 0)).await;
    assert_eq!(r.status, 200);
    let mut held = hold_the_slot(&gw, &sims[0], &[]).await;
    // Its next turn, 12 KB, sent at once, waits for the slot: as a live
    // binding's turn it waits with its body unread.
    let mut body = chat_body("qwen3-8b", 1);
    body["messages"][0]["content"] = json!("x".repeat(12 * 1024));
    let turn = send_chat(&gw, &[("x-session-id", "long-context".into())], &body);
    wait_until("the turn to queue", || async {
        metric_value(&gw.metrics_text().await, &queued("normal")) == 1.0
    })
    .await;
    // Three seconds in the queue: at 8 KB/s, 24 KB of body time.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    sims[0].release_streams().await;
    while held.next().await.is_some() {}
    assert_eq!(turn.await.unwrap(), 200);
}

#[tokio::test]
async fn fair_share_charges_what_the_engine_will_compute_not_what_it_holds() {
    let (sims, gw) = one_slot(60_000, "").await;
    // A long conversation the backend holds: its next turn adds a line.
    let transcript: String = (0..3000).map(|i| format!("fact{i} ")).collect();
    let mut body = chat_body("qwen3-8b", 0);
    body["messages"][0]["content"] = json!(transcript);
    let r = chat(&client(), &gw, &[("x-session-id", "deep")], &body).await;
    assert_eq!(r.status, 200);
    let mut next = body.clone();
    next["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "and one more"}));
    // Queued first: the deep conversation's warm turn (thousands of tokens,
    // nearly all held), then a new tenant's cold 300-token question. Each
    // tenant is new here, so the one that asks the engine for less goes
    // first.
    let mut held = hold_the_slot(&gw, &sims[0], &[]).await;
    let order = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut cold = chat_body("qwen3-8b", 7);
    cold["messages"][0]["content"] = json!((0..300).map(|i| format!("q{i} ")).collect::<String>());
    let mut tasks = Vec::new();
    for (i, (name, session, key, body)) in [
        ("warm turn", "deep", "Bearer agent", next),
        ("cold question", "fresh", "Bearer chat", cold),
    ]
    .into_iter()
    .enumerate()
    {
        let (url, order) = (gw.url("/v1/chat/completions"), order.clone());
        tasks.push(tokio::spawn(async move {
            let r = client()
                .post(url)
                .header("x-session-id", session)
                .header("authorization", key)
                .json(&body)
                .send()
                .await
                .expect("answered");
            assert_eq!(r.status(), 200);
            order.lock().push(name);
        }));
        wait_until("the request to queue", || async {
            metric_value(&gw.metrics_text().await, &queued("normal")) == (i + 1) as f64
        })
        .await;
    }
    sims[0].release_streams().await;
    while held.next().await.is_some() {}
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*order.lock(), ["warm turn", "cold question"]);
}

// Issue 36: admission that works out of the box.

async fn admission_view(gw: &Gateway) -> Value {
    reqwest::get(gw.admin_url("/admin/admission"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

#[tokio::test]
async fn turned_on_with_nothing_else_it_learns_what_the_engine_runs_and_queues_the_rest_here() {
    // An engine that runs two requests at once and queues the rest.
    let sims = [SimBackend::start("vllm-0", &["--max-batch", "2"])];
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!(
            "{FAST_HEALTH}{}admission:\n  enabled: true\nload:\n  interval_ms: 100\n",
            affinity_yaml(600)
        ),
    )
    .await;
    sims[0].set_faults(json!({"hold_streams": true})).await;
    // Eight streams at once, each held open after its first token.
    let stream = |i: usize| {
        let mut body = chat_body("qwen3-8b", i);
        body["stream"] = json!(true);
        body
    };
    let streams: Vec<_> = (0..8)
        .map(|i| send_chat(&gw, &[("x-session-id", format!("burst-{i}"))], &stream(i)))
        .collect();
    // The gateway finds the engine queueing and learns its two.
    wait_until("the limit learned", || async {
        let v = admission_view(&gw).await;
        v["backends"][0]["max_in_flight"] == 2
    })
    .await;
    let v = admission_view(&gw).await;
    assert_eq!(v["backends"][0]["limit_source"], "learned", "{v}");
    sims[0].release_streams().await;
    for s in streams {
        assert_eq!(s.await.unwrap(), 200);
    }
    // From then on the rest wait here, not inside the engine.
    sims[0].set_faults(json!({"hold_streams": true})).await;
    let streams: Vec<_> = (0..6)
        .map(|i| {
            send_chat(
                &gw,
                &[("x-session-id", format!("after-{i}"))],
                &stream(10 + i),
            )
        })
        .collect();
    wait_until("four waiting in the gateway", || async {
        admission_view(&gw).await["queued"] == 4
    })
    .await;
    assert_eq!(sims[0].stats().await["waiting"], 0);
    sims[0].release_streams().await;
    for s in streams {
        assert_eq!(s.await.unwrap(), 200);
    }
}

/// One replica (`args`), its gauges as `faults` make them, behind a gateway
/// with admission on (and `admission` lines added) that reads them every
/// 100 ms, once it has read them first (its learned limit in slow start).
async fn learning(args: &[&str], faults: &Value, admission: &str) -> (Vec<SimBackend>, Gateway) {
    let sims = vec![SimBackend::start("vllm-0", args)];
    sims[0].set_faults(faults.clone()).await;
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!(
            "{FAST_HEALTH}{}admission:\n  enabled: true\n{admission}load:\n  interval_ms: 100\n",
            affinity_yaml(600)
        ),
    )
    .await;
    wait_until("the first gauges read", || async {
        admission_view(&gw).await["backends"][0]["max_in_flight"] != 0
    })
    .await;
    (sims, gw)
}

/// An engine with room for 16 that runs all 16 held streams, its gauges
/// honest or saying 100,000 wait whatever runs: learned admission lets all
/// 16 in side by side (it holds back only requests of its own that wait
/// inside the engine). Nothing completes meanwhile: the limit grows on the
/// gauges alone.
#[tokio::test]
async fn learned_admission_lets_an_engine_with_room_run_all_it_can() {
    for lie in [json!({}), json!({"gauge_waiting": 100_000})] {
        let (sims, gw) = learning(&["--max-batch", "16"], &lie, "").await;
        let mut faults = lie.clone();
        faults["hold_streams"] = json!(true);
        sims[0].set_faults(faults).await;
        let streams: Vec<_> = (0..16)
            .map(|i| {
                let mut body = chat_body("qwen3-8b", 100 + i);
                body["stream"] = json!(true);
                send_chat(&gw, &[("x-session-id", format!("room-{i}"))], &body)
            })
            .collect();
        wait_until(&format!("all 16 running in the engine ({lie})"), || async {
            sims[0].stats().await["running"] == 16
        })
        .await;
        assert_eq!(admission_view(&gw).await["queued"], 0, "{lie}");
        sims[0].release_streams().await;
        for s in streams {
            assert_eq!(s.await.unwrap(), 200);
        }
    }
}

/// Gauges that say this gateway's own requests queue inside the engine
/// (1 running, 10 waiting, whatever runs) on an engine with room for 16:
/// the limit they lower to 1 is checked against what the engine completes,
/// which doubles at twice the limit, and gives way: the engine ends up
/// running many at once.
#[tokio::test]
async fn a_limit_lying_gauges_lowered_gives_way_to_what_the_engine_completes() {
    let args = [
        "--max-batch",
        "16",
        "--prefill-us-per-token",
        "0",
        "--decode-us-per-token",
        "10000",
    ];
    let lie = json!({"gauge_running": 1, "gauge_waiting": 10});
    let (sims, gw) = learning(&args, &lie, "  max_wait_ms: 60000\n").await;
    // Rounds of 16 short streams (16 tokens, 160 ms), one after another.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = {
        let (stop, url) = (stop.clone(), gw.url("/v1/chat/completions"));
        tokio::spawn(async move {
            let mut round = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let sent: Vec<_> = (0..16)
                    .map(|i| {
                        let mut body = chat_body("qwen3-8b", round * 16 + i);
                        body["stream"] = json!(true);
                        let req = client().post(&url).json(&body);
                        tokio::spawn(async move {
                            let r = req.send().await?;
                            let status = r.status().as_u16();
                            r.bytes().await.map(|_| status)
                        })
                    })
                    .collect();
                for s in sent {
                    assert_eq!(s.await.unwrap().expect("answered"), 200);
                }
                round += 1;
            }
        })
    };
    wait_until("12 running at once in the engine", || async {
        sims[0].stats().await["running"].as_u64().unwrap_or(0) >= 12
    })
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    load.await.unwrap();
    assert!(
        admission_view(&gw).await["backends"][0]["max_in_flight"]
            .as_u64()
            .unwrap()
            >= 12
    );
}

#[tokio::test]
async fn answers_that_do_not_stream_do_not_hold_the_prefill_slot_through_their_decode() {
    // Slow decode: each answer takes about two seconds after its prefill.
    let sims = [SimBackend::start(
        "vllm-0",
        &["--decode-us-per-token", "100000"],
    )];
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!(
            "{FAST_HEALTH}{}admission:\n  enabled: true\n  max_in_flight: 4\n  max_prefilling: 1\n  max_wait_ms: 60000\n",
            affinity_yaml(600)
        ),
    )
    .await;
    // A live session's turn, whose body streams through unread, and two
    // new conversations, whose bodies are read to place them: none streams.
    let r = chat(
        &client(),
        &gw,
        &[("x-session-id", "live")],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 200);
    let mut answers = Vec::new();
    for (i, sid) in ["live", "new-1", "new-2"].into_iter().enumerate() {
        let mut body = chat_body("qwen3-8b", 1 + i);
        body["max_tokens"] = json!(20);
        answers.push(send_chat(&gw, &[("x-session-id", sid.into())], &body));
    }
    // One at a time prefills, but all three decode together.
    wait_until("three answers decoding at once", || async {
        sims[0].stats().await["running"] == 3
    })
    .await;
    for a in answers {
        assert_eq!(a.await.unwrap(), 200);
    }
}

#[tokio::test]
async fn http2_streams_reset_while_queued_leave_the_queue_and_never_go_upstream() {
    let pki = Pki::new();
    let certs = tempfile::tempdir().unwrap();
    pki.leaf(certs.path(), "gw.test");
    let sims = [SimBackend::start("vllm-0", &[])];
    let tls_port = free_port();
    let d = certs.path().display();
    let gw = Gateway::start_with(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        |_| {
            format!(
                "  tls:\n    listen: [\"127.0.0.1:{tls_port}\"]\n    h2: true\n    certificates:\n      - {{ cert: \"{d}/gw.test.pem\", key: \"{d}/gw.test.key\", server_names: [gw.test] }}\n"
            )
        },
        &format!(
            "{FAST_HEALTH}{}admission:\n  enabled: true\n  max_in_flight: 1\n  max_wait_ms: 60000\n  max_queued: 100\n",
            affinity_yaml(600)
        ),
    )
    .await;
    let mut held = hold_the_slot(&gw, &sims[0], &[]).await;
    let sent_before = engine_requests(&sims[0]).await;
    // One HTTP/2 connection: a hundred streams queue, then all are reset;
    // fifteen times over.
    let h2 = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(pki.ca_pem.as_bytes()).unwrap())
        .resolve("gw.test", ([127, 0, 0, 1], tls_port).into())
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let url = format!("https://gw.test:{tls_port}/v1/chat/completions");
    for wave in 0..15 {
        let streams: Vec<_> = (0..100)
            .map(|i| {
                let req = h2
                    .post(&url)
                    .header("x-session-id", format!("reset-{wave}-{i}"))
                    .json(&chat_body("qwen3-8b", i));
                tokio::spawn(async move { req.send().await })
            })
            .collect();
        wait_until("a hundred streams queued", || async {
            admission_view(&gw).await["queued"] == 100
        })
        .await;
        for s in &streams {
            s.abort();
        }
        wait_until("the reset streams gone from the queue", || async {
            admission_view(&gw).await["queued"] == 0
        })
        .await;
    }
    // Another client is queued, not refused, and served once the slot frees.
    let other = send_chat(
        &gw,
        &[("x-session-id", "patient".into())],
        &chat_body("qwen3-8b", 1),
    );
    wait_until("the other client queued", || async {
        admission_view(&gw).await["queued"] == 1
    })
    .await;
    sims[0].release_streams().await;
    while held.next().await.is_some() {}
    assert_eq!(other.await.unwrap(), 200);
    // Of the 1,500 reset streams, none reached the engine.
    assert_eq!(engine_requests(&sims[0]).await, sent_before + 1);
}

/// Two replicas running one request each; sessions of the first one's, one
/// of them holding its slot with a stream, two more turns queued for it.
/// Returns the replicas, the gateway, the held stream and the queued turns.
async fn queued_for_the_first(
    server_lines: &str,
    extra: &str,
) -> (
    Vec<SimBackend>,
    Gateway,
    impl futures_util::Stream<Item = reqwest::Result<bytes::Bytes>>,
    Vec<tokio::task::JoinHandle<(u16, String)>>,
) {
    let (sims, gw) = fleet_serving(
        2,
        server_lines,
        &format!(
            "{FAST_HEALTH}{}admission:\n  enabled: true\n  max_in_flight: 1\n  max_wait_ms: 60000\n{extra}",
            affinity_yaml(600)
        ),
    )
    .await;
    // Sessions whose first turn went to vllm-0.
    let mut on_first = Vec::new();
    for i in 0..40 {
        let sid = format!("task-{i}");
        let r = chat(
            &client(),
            &gw,
            &[("x-session-id", &sid)],
            &chat_body("qwen3-8b", 0),
        )
        .await;
        if r.backend.as_deref() == Some("vllm-0") {
            on_first.push(sid);
        }
        if on_first.len() == 3 {
            break;
        }
    }
    assert_eq!(on_first.len(), 3, "three sessions on vllm-0");
    sims[0].set_faults(json!({"hold_streams": true})).await;
    let mut body = chat_body("qwen3-8b", 1);
    body["stream"] = json!(true);
    let resp = client()
        .post(gw.url("/v1/chat/completions"))
        .header("x-session-id", &on_first[0])
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-agent-serve-backend"], "vllm-0");
    let mut held = resp.bytes_stream();
    held.next().await.expect("first event").expect("bytes");
    let mut turns = Vec::new();
    for sid in &on_first[1..] {
        let (url, sid) = (gw.url("/v1/chat/completions"), sid.clone());
        turns.push(tokio::spawn(async move {
            let r = client()
                .post(url)
                .header("x-session-id", &sid)
                .json(&chat_body("qwen3-8b", 1))
                .send()
                .await
                .expect("answered");
            let backend = r.headers()["x-agent-serve-backend"]
                .to_str()
                .unwrap()
                .to_string();
            (r.status().as_u16(), backend)
        }));
    }
    wait_until("two turns queued for vllm-0", || async {
        admission_view(&gw).await["queued"] == 2
    })
    .await;
    (sims, gw, held, turns)
}

#[tokio::test]
async fn requests_queued_for_a_backend_marked_down_are_served_by_another() {
    let (sims, _gw, _held, turns) = queued_for_the_first("", "").await;
    let sent = engine_requests(&sims[0]).await;
    // Its health checks fail: the gateway can tell, and its waiters go on.
    sims[0]
        .set_faults(json!({"hold_streams": true, "unhealthy": true}))
        .await;
    for t in turns {
        assert_eq!(t.await.unwrap(), (200, "vllm-1".to_string()));
    }
    assert_eq!(engine_requests(&sims[0]).await, sent, "none sent to vllm-0");
    sims[0].release_streams().await;
}

#[tokio::test]
async fn requests_queued_for_a_backend_a_reload_removes_are_served_by_another() {
    let (sims, gw, _held, turns) = queued_for_the_first("", "").await;
    let sent = engine_requests(&sims[0]).await;
    let yaml = std::fs::read_to_string(&gw.config_path).unwrap();
    let kept: String = yaml
        .lines()
        .filter(|l| !l.contains("id: \"vllm-0\""))
        .map(|l| format!("{l}\n"))
        .collect();
    assert_ne!(kept.len(), yaml.len());
    std::fs::write(&gw.config_path, kept).unwrap();
    gw.reload("success", 1.0).await;
    for t in turns {
        assert_eq!(t.await.unwrap(), (200, "vllm-1".to_string()));
    }
    assert_eq!(engine_requests(&sims[0]).await, sent, "none sent to vllm-0");
    sims[0].release_streams().await;
}

#[tokio::test]
async fn requests_queued_for_a_backend_that_dies_are_served_by_another() {
    let (mut sims, _gw, _held, turns) = queued_for_the_first("", "").await;
    // Killed with a request running and two waiting for its slot: the slot
    // its crash frees, and what health checks then say, send them on.
    sims[0].kill();
    for t in turns {
        assert_eq!(t.await.unwrap(), (200, "vllm-1".to_string()));
    }
}

#[tokio::test]
async fn requests_queued_for_a_backend_that_hangs_are_served_by_another() {
    // A backend is ejected at its first failure; reads time out after 2 s.
    let (sims, _gw, _held, turns) = queued_for_the_first(
        "  read_timeout_ms: 2000\n",
        "outlier:\n  consecutive_failures: 1\n",
    )
    .await;
    let sent = engine_requests(&sims[0]).await;
    // It stops answering (its health checks still pass): once the request
    // running there times out and it is ejected, the gateway can tell.
    sims[0]
        .set_faults(json!({"hold_streams": true, "hang": true}))
        .await;
    for t in turns {
        assert_eq!(t.await.unwrap(), (200, "vllm-1".to_string()));
    }
    assert_eq!(engine_requests(&sims[0]).await, sent, "none sent to vllm-0");
    sims[0].set_faults(json!({})).await;
    sims[0].release_streams().await;
}

#[tokio::test]
async fn turned_on_it_prefills_one_at_a_time_only_where_the_engine_queues_prefills() {
    // Two engines that each take 100 ms to prefill a 1,000-token prompt:
    // one prefills one prompt at a time, the other several side by side.
    let prefill = [
        "--prefill-us-per-token",
        "100",
        "--decode-us-per-token",
        "100",
    ];
    let serial = SimBackend::start("serial", &[&prefill[..], &["--serial-prefill"]].concat());
    let beside = SimBackend::start("beside", &prefill);
    let gw = Gateway::start(
        &[
            tier("one-at-a-time", true, &["m-serial"], &[&serial]),
            tier("side-by-side", false, &["m-beside"], &[&beside]),
        ],
        &format!(
            "{FAST_HEALTH}{}admission:\n  enabled: true\n  max_wait_ms: 60000\nload:\n  interval_ms: 100\n",
            affinity_yaml(600)
        ),
    )
    .await;
    let backend = |v: &Value, id: &str| {
        v["backends"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["id"] == id)
            .cloned()
            .unwrap()
    };
    // Rounds of four new conversations at once on each, their prompts
    // distinct (nothing cached), until both engines have been told apart.
    let mut round = 0;
    let decided = loop {
        let v = admission_view(&gw).await;
        let (s, b) = (backend(&v, "serial"), backend(&v, "beside"));
        let votes = |b: &Value| b["prefill_votes"].as_i64().unwrap();
        if votes(&s) >= 3 && votes(&b) <= 0 || round == 20 {
            break (s, b);
        }
        let sends: Vec<_> = ["m-serial", "m-beside"]
            .into_iter()
            .flat_map(|model| (0..4).map(move |i| (model, i)))
            .map(|(model, i)| {
                let mut body = chat_body(model, 0);
                let doc: String = (0..500)
                    .map(|w| format!("{model}-{round}-{i}-{w:03} "))
                    .collect();
                body["messages"][0]["content"] = json!(&doc[..4_000]);
                body["stream"] = json!(true);
                send_chat(
                    &gw,
                    &[("x-session-id", format!("{model}-{round}-{i}"))],
                    &body,
                )
            })
            .collect();
        for s in sends {
            assert_eq!(s.await.unwrap(), 200);
        }
        round += 1;
    };
    let (s, b) = decided;
    // The engine that queues prefills gets one at a time; the other none.
    assert_eq!(s["prefill_source"], "learned", "{s}");
    assert_eq!(s["max_prefilling"], 1, "after {round} rounds: {s}");
    assert_eq!(b["prefill_source"], "learned", "{b}");
    assert_eq!(b["max_prefilling"], 0, "after {round} rounds: {b}");
}

/// One replica at 1 ms a token behind a gateway whose only key,
/// `sk-metered`, has 1,000 tokens a minute (`auth` lines added as given).
async fn metered(auth: &str) -> (tempfile::TempDir, SimBackend, Gateway) {
    let (dir, keys) = write_keys(&[("sk-metered", "metered", "    tokens_per_minute: 1000\n")]);
    let sim = SimBackend::start("vllm-0", &["--decode-us-per-token", "1000"]);
    let gw = Gateway::start(
        &[tier("default", true, &[], &[&sim])],
        &format!(
            "{FAST_HEALTH}{}auth:\n  keys_file: \"{}\"\n  required: true\n{auth}",
            affinity_yaml(1800),
            keys.display()
        ),
    )
    .await;
    (dir, sim, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_spends_its_tenants_tokens_while_it_runs() {
    // 1,000 tokens a minute; a session's later turn streams 3,000 tokens
    // without usage, its body unread (its max_tokens unknown up front).
    let (_dir, _sim, gw) = metered("").await;
    let key = ("authorization", "Bearer sk-metered");
    let session = ("x-session-id", "long-answers");
    let first = chat(&client(), &gw, &[key, session], &chat_body("qwen3-8b", 0)).await;
    assert_eq!(first.status, 200);
    let resp = client()
        .post(gw.url("/v1/chat/completions"))
        .header(key.0, key.1)
        .header(session.0, session.1)
        .json(&long_stream(1, 3000))
        .send()
        .await
        .expect("stream starts");
    assert_eq!(resp.status(), 200);
    let mut stream = resp.bytes_stream();
    // Ten short requests of the key, one each 250 tokens of the stream
    // from its 300th: sent while it runs.
    let (mut events, mut next_at, mut statuses) = (0, 300, Vec::new());
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("bytes");
        events += chunk.windows(5).filter(|w| w == b"data:").count();
        if events >= next_at && statuses.len() < 10 {
            let id = format!("short-{}", statuses.len());
            let r = chat(
                &client(),
                &gw,
                &[key, ("x-session-id", id.as_str())],
                &chat_body("qwen3-8b", 0),
            )
            .await;
            statuses.push(r.status);
            next_at += 250;
        }
    }
    assert!(events >= 3000, "{events} events");
    assert_eq!(statuses.len(), 10, "sent during the stream");
    let served = statuses.iter().filter(|&&s| s == 200).count();
    println!("{served} of 10 served during the stream: {statuses:?}");
    assert!(served <= 1, "{served} of 10 served: {statuses:?}");
    assert!(
        statuses.iter().all(|&s| s == 200 || s == 429),
        "{statuses:?}"
    );
}

/// `auth.stream_over_limit: cut`: a stream that spends its tenant's
/// `tokens_per_minute` past zero (counted at what it used, not at its
/// `max_tokens`) ends there with an SSE error event. (The default, `finish`, runs it to its end: see
/// `a_stream_spends_its_tenants_tokens_while_it_runs`.)
#[tokio::test]
async fn a_stream_past_its_tenants_tokens_is_cut_where_the_operator_says_so() {
    let (_dir, _sim, gw) = metered("  stream_over_limit: cut\n").await;
    let key = ("authorization", "Bearer sk-metered");
    let resp = client()
        .post(gw.url("/v1/chat/completions"))
        .header(key.0, key.1)
        .json(&long_stream(0, 3000))
        .send()
        .await
        .expect("stream starts");
    assert_eq!(resp.status(), 200);
    // The response ends where it is cut (its connection with it).
    let text = read_until_cut(resp).await;
    let events = text.matches("\"delta\"").count();
    println!("{events} tokens streamed before the cut");
    assert!((500..1_500).contains(&events), "{events} tokens streamed");
    let tail = text.rsplit("\n\n").find(|e| !e.is_empty()).unwrap_or("");
    assert!(
        tail.starts_with("event: error\ndata: "),
        "ends with {tail:?}"
    );
    let error: Value = serde_json::from_str(&tail["event: error\ndata: ".len()..]).unwrap();
    assert_eq!(error["error"]["code"], "rate_limit_exceeded", "{error}");
    // Counted where a tenant's refusals are, and its tokens settled at
    // what it used: the tenant may go on as its budget refills.
    let cut = "agentserve_client_rejected_total{reason=\"tokens_per_minute\",tenant=\"metered\"}";
    assert_eq!(gw.metric(cut).await, 1.0);
}

/// JSON answers without `max_tokens` (the SDKs' default; the engine decides
/// how long, here 16 tokens at 62.5 ms: a second each), on an engine that
/// runs eight side by side and prefills in no time: their first byte
/// follows their whole decode, and that second is never learned as
/// prefill. The engine's own count of decode time says what it was (before
/// issue 61 nothing did and 16 tokens were taken as negligible: thousands of
/// µs a token of prefill learned, and learned admission queued requests
/// behind that phantom prefill, rounds up to 19× slower than with admission
/// off).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_answers_decode_is_never_learned_as_prefill() {
    let sim = SimBackend::start(
        "vllm-0",
        &[
            "--max-batch",
            "8",
            "--prefill-us-per-token",
            "0",
            "--decode-us-per-token",
            "62500",
        ],
    );
    let gw = Gateway::start(
        &[tier("default", true, &[], &[&sim])],
        &format!(
            "{FAST_HEALTH}{}admission:\n  enabled: true\n  max_wait_ms: 120000\nload:\n  interval_ms: 100\n",
            affinity_yaml(600)
        ),
    )
    .await;
    for round in 0..3 {
        let sends: Vec<_> = (0..8)
            .map(|i| {
                let mut body = chat_body("m", round);
                body.as_object_mut().unwrap().remove("max_tokens");
                body["messages"][1]["content"] = json!(format!("round {round} question {i}"));
                send_chat(&gw, &[], &body)
            })
            .collect();
        for s in sends {
            assert_eq!(s.await.unwrap(), 200);
        }
    }
    let learned = gw.admin_backend("vllm-0").await["learned"].clone();
    let decode = learned["decode_us_per_token"].as_f64().unwrap_or(0.0);
    assert!((50_000.0..80_000.0).contains(&decode), "{learned}");
    // The prompts are ~130 tokens: a second taken as prefill would be
    // thousands of µs a token.
    let prefill = learned["prefill_us_per_token"].as_f64().unwrap_or(0.0);
    assert!(prefill < 1_000.0, "{learned}");
}
