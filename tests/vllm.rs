//! The gateway in front of three real vLLM servers (its CPU build, a
//! generated tiny Llama; `scripts/engine/vllm-setup.sh`, which
//! `scripts/test.sh` runs). What neither the simulator nor llama.cpp shows:
//! vLLM's own cached-token reports, gauges, Responses store, and its
//! KV-cache events as the gateway's view of each engine's cache.
//!
//! One test, in phases, because three servers take minutes to start on a
//! 2-core box: the same conversations' warm-turn cached share on one server
//! alone, by direct round robin, and through the gateway (keyed, keyless,
//! a Responses chain); the engines' events current at the gateway and its
//! predictions from them; a server killed and started again; two tenants
//! whose prompts the gateway salts (`auth.cache_salt`).

mod common;

use agent_gateway_tools::vllm::{self, Vllm, VllmOptions};
use common::*;
use serde_json::{json, Value};
use std::time::Duration;

/// An agent's conversation: a system prompt of its own, then turns that
/// append to the transcript (as agents send them).
struct Conversation {
    messages: Vec<Value>,
}

impl Conversation {
    fn new(name: &str) -> Conversation {
        let system = format!(
            "You are the coding agent {name}. Read the file {name}.rs, run its test, fix the error and write the result. "
        )
        .repeat(6);
        Conversation {
            messages: vec![json!({"role": "system", "content": system})],
        }
    }

    fn body(&mut self, turn: usize) -> Value {
        self.messages.push(json!({"role": "user", "content": format!("Turn {turn}: the tool returned an error in line {}. Read it and call the tool again.", turn * 7)}));
        json!({"model": "tiny", "messages": self.messages, "max_tokens": 6})
    }

    fn answered(&mut self, v: &Value) {
        let text = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
        self.messages
            .push(json!({"role": "assistant", "content": text}));
    }
}

/// (prompt, cached) tokens of an answer's usage (chat or Responses).
fn usage(v: &Value) -> (u64, u64) {
    let u = &v["usage"];
    let prompt = u["prompt_tokens"].as_u64().or(u["input_tokens"].as_u64());
    let cached = u["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or(u["input_tokens_details"]["cached_tokens"].as_u64());
    (prompt.unwrap_or(0), cached.unwrap_or(0))
}

/// Warm turns' tokens: (prompt, cached), summed.
#[derive(Default, Debug, Clone, Copy)]
struct Warm {
    prompt: u64,
    cached: u64,
}

impl Warm {
    fn add(&mut self, (p, c): (u64, u64)) {
        self.prompt += p;
        self.cached += c;
    }

    fn share(&self) -> f64 {
        self.cached as f64 / self.prompt.max(1) as f64
    }
}

const CONVERSATIONS: usize = 6;
const TURNS: usize = 4;

/// Run the conversations named `tag`, turn by turn across them; each request
/// goes to `target(conversation, turn)`: (URL, headers). Returns the warm
/// turns' tokens and each conversation's backends (`x-agent-serve-backend`).
async fn converse(
    tag: &str,
    target: impl Fn(usize, usize) -> (String, Vec<(&'static str, String)>),
) -> (Warm, Vec<Vec<String>>) {
    let c = client();
    let mut convs: Vec<Conversation> = (0..CONVERSATIONS)
        .map(|i| Conversation::new(&format!("{tag}{i}")))
        .collect();
    let mut warm = Warm::default();
    let mut seen = vec![Vec::new(); CONVERSATIONS];
    for turn in 0..TURNS {
        for (i, conv) in convs.iter_mut().enumerate() {
            let (url, headers) = target(i, turn);
            let mut req = c.post(&url).json(&conv.body(turn));
            for (k, v) in &headers {
                req = req.header(*k, v);
            }
            let r = req.send().await.expect("answered");
            let status = r.status();
            let backend = r
                .headers()
                .get("x-agent-serve-backend")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let v: Value = r.json().await.expect("json");
            assert_eq!(status, 200, "{tag}{i} turn {turn}: {v}");
            if turn > 0 {
                warm.add(usage(&v));
            }
            seen[i].extend(backend);
            conv.answered(&v);
        }
    }
    (warm, seen)
}

async fn kv_of(gw: &Gateway, id: &str) -> Value {
    gw.admin_backend(id).await["kv_events"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_vllm_servers_behind_the_gateway() {
    assert!(
        vllm::installed(),
        "vLLM is not installed: run scripts/engine/vllm-setup.sh"
    );
    let work = tempfile::tempdir().unwrap();
    let model = vllm::model(work.path()).expect("model generated");
    let opts = VllmOptions::default();
    let mut servers: Vec<Vllm> = (0..3)
        .map(|i| {
            let log = work.path().join(format!("vllm-{i}.log"));
            Vllm::spawn(&model, &opts, &log).expect("vLLM starts")
        })
        .collect();
    for (i, s) in servers.iter_mut().enumerate() {
        if let Err(e) = s.wait_healthy(Duration::from_secs(600)) {
            // Three engines starting at once on a busy 2-core machine: one
            // engine core failed to initialise once in CI. Started again on
            // fresh ports, once; a second failure fails the test.
            eprintln!("vLLM {i} did not start ({e}); starting it again");
            let log = work.path().join(format!("vllm-{i}-again.log"));
            *s = Vllm::spawn(&model, &opts, &log).expect("vLLM starts");
            s.wait_healthy(Duration::from_secs(600))
                .expect("vLLM healthy");
        }
    }
    let ids: Vec<String> = (0..3).map(|i| format!("vllm-{i}")).collect();

    // 1. One server alone, and direct round robin over the three.
    let alone = servers[0].url("/v1/chat/completions");
    let (one, _) = converse("alone", |_, _| (alone.clone(), vec![])).await;
    let urls: Vec<String> = servers
        .iter()
        .map(|s| s.url("/v1/chat/completions"))
        .collect();
    let (rr, _) = converse("rr", |i, turn| (urls[(i + turn) % 3].clone(), vec![])).await;

    // 2. Through the gateway, each engine's events on.
    let backends = servers
        .iter()
        .zip(&ids)
        .map(|(s, id)| (id.clone(), s.addr().parse().unwrap(), 1))
        .collect();
    let tiers = [TierSpec {
        name: "default",
        default: true,
        models: &["tiny"],
        backends,
    }];
    let extra = format!(
        "health:\n  path: /health\n  interval_ms: 500\n  timeout_ms: 3000\n{}  allow_explicit_target: true\nload:\n  interval_ms: 200\n  timeout_ms: 2000\nadmission:\n  enabled: true\n",
        affinity_yaml(600)
    );
    let dir = tempfile::tempdir().unwrap();
    let (port, metrics_port) = (free_port(), free_port_pair());
    let kv: Vec<_> = servers
        .iter()
        .zip(&ids)
        .map(|(s, id)| (id.as_str(), s.addr().parse().unwrap(), s.kv_events_yaml()))
        .collect();
    let yaml = with_kv_events(
        config_yaml(port, metrics_port, dir.path(), &tiers, &extra),
        &kv,
    );
    let gw = Gateway::start_yaml(dir, port, metrics_port, &yaml).await;
    for id in &ids {
        wait_until("each engine's events followed", || async {
            kv_of(&gw, id).await["exact"] == true
        })
        .await;
    }
    let chat_url = gw.url("/v1/chat/completions");
    let (keyed, keyed_at) = converse("keyed", |i, _| {
        (
            chat_url.clone(),
            vec![("x-session-id", format!("keyed-{i}"))],
        )
    })
    .await;
    let (keyless, keyless_at) = converse("keyless", |_, _| (chat_url.clone(), vec![])).await;
    eprintln!(
        "warm-turn cached share: one server alone {:.3}, direct round robin {:.3}, gateway keyed {:.3}, keyless {:.3}",
        one.share(),
        rr.share(),
        keyed.share(),
        keyless.share()
    );
    for (kind, at) in [("keyed", &keyed_at), ("keyless", &keyless_at)] {
        for (i, b) in at.iter().enumerate() {
            assert_eq!(b.len(), TURNS, "{kind}{i}: {b:?}");
            assert!(b.iter().all(|x| *x == b[0]), "{kind}{i} split: {b:?}");
        }
    }
    for (kind, w) in [("keyed", keyed), ("keyless", keyless)] {
        assert!(
            w.share() >= 0.97 * one.share(),
            "{kind}: {:.3} of prompt tokens cached on warm turns, one server alone {:.3}",
            w.share(),
            one.share()
        );
    }

    // 3. A Responses chain: each follow-up at the server that stored the
    // response it follows, its transcript cached there.
    let c = client();
    let mut previous: Option<String> = None;
    let mut chain_at = Vec::new();
    let mut chain = Warm::default();
    for turn in 0..TURNS {
        let mut body = json!({"model": "tiny", "max_output_tokens": 6, "store": true,
            "input": format!("Turn {turn} of the chain: the tool said the build failed in module {turn}. ").repeat(8)});
        if let Some(p) = &previous {
            body["previous_response_id"] = json!(p);
        }
        let r = c
            .post(gw.url("/v1/responses"))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status();
        chain_at.extend(
            r.headers()
                .get("x-agent-serve-backend")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
        );
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "chain turn {turn}: {v}");
        if turn > 0 {
            chain.add(usage(&v));
        }
        previous = v["id"].as_str().map(str::to_string);
    }
    assert!(chain_at.iter().all(|b| *b == chain_at[0]), "{chain_at:?}");
    assert!(chain.share() > 0.5, "chain's warm turns cached {chain:?}");

    // 4. The gateway's view of the engines came from their events: every
    // server's is exact, and its predictions from them held.
    let metrics = reqwest::get(gw.metrics_url("/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let right = metric_value(
        &metrics,
        "agentserve_kv_predictions_total{outcome=\"right\",source=\"events\",tier=\"default\"}",
    );
    let wrong = metric_value(
        &metrics,
        "agentserve_kv_predictions_total{outcome=\"wrong\",source=\"events\",tier=\"default\"}",
    );
    eprintln!("predictions from events: {right} right, {wrong} wrong");
    assert!(
        right >= (2 * CONVERSATIONS) as f64,
        "{right} right, {wrong} wrong"
    );
    assert!(wrong * 10.0 <= right, "{right} right, {wrong} wrong");
    // The load scraper read each engine's own gauges.
    for b in gw.admin_backends().await {
        assert!(b["engine"]["running"].is_number(), "{b}");
        // Its decode speed, from its answers or its own
        // `vllm:inter_token_latency_seconds`.
        assert!(b["learned"]["decode_us_per_token"].is_number(), "{b}");
        assert!(b["kv_events"]["blocks_held"].as_u64() > Some(0), "{b}");
    }

    // 5. A server killed: what it held is forgotten at once; started again,
    // its events are followed again and its next turns are predicted from
    // them.
    let victim = keyed_at[0][0].clone();
    let v = ids.iter().position(|id| *id == victim).unwrap();
    servers[v].kill();
    wait_until("the killed server's holdings forgotten", || async {
        let kv = kv_of(&gw, &victim).await;
        kv["exact"] == false && kv["blocks_held"] == 0
    })
    .await;
    servers[v].start().expect("restarts");
    servers[v]
        .wait_healthy(Duration::from_secs(600))
        .expect("healthy again");
    wait_until(
        "its events followed again, and it healthy again",
        || async {
            let b = gw.admin_backends().await;
            let b = b.iter().find(|b| b["id"] == victim.as_str()).cloned();
            b.is_some_and(|b| b["kv_events"]["exact"] == true && b["healthy"] == true)
        },
    )
    .await;
    let before = kv_of(&gw, &victim).await["events"].as_u64().unwrap_or(0);
    let r = chat(
        &c,
        &gw,
        &[
            ("x-session-id", "after-restart"),
            ("x-agent-serve-backend-id", victim.as_str()),
        ],
        &Conversation::new("after").body(0),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.backend.as_deref(), Some(victim.as_str()));
    wait_until("events from the restarted server", || async {
        let kv = kv_of(&gw, &victim).await;
        kv["exact"] == true && kv["blocks_held"].as_u64() > Some(0)
            || kv["events"].as_u64() > Some(before)
    })
    .await;

    // 6. Two tenants, `auth.cache_salt: tenant`, one server: the same
    // prompt is cached for the tenant that sent it and never for the
    // other, whatever salt the other writes.
    let server = &servers[(v + 1) % 3];
    let (keys_dir, keys) = write_keys(&[("sk-acme", "acme", ""), ("sk-bravo", "bravo", "")]);
    let tiers = [TierSpec {
        name: "default",
        default: true,
        models: &["tiny"],
        backends: vec![(ids[(v + 1) % 3].clone(), server.addr().parse().unwrap(), 1)],
    }];
    let extra = format!(
        "health:\n  path: /health\n  interval_ms: 500\n  timeout_ms: 3000\n{}auth:\n  keys_file: \"{}\"\n  required: true\n  cache_salt: tenant\n",
        affinity_yaml(600),
        keys.display()
    );
    let dir = tempfile::tempdir().unwrap();
    let (port, metrics_port) = (free_port(), free_port_pair());
    let yaml = config_yaml(port, metrics_port, dir.path(), &tiers, &extra);
    let salted = Gateway::start_yaml(dir, port, metrics_port, &yaml).await;
    let system = "You are the auditor of ledger 7. Check every entry against the bank statement and list what differs. ".repeat(6);
    let ask = |key: &'static str, body: String| {
        let req = c
            .post(salted.url("/v1/chat/completions"))
            .header("authorization", format!("Bearer {key}"))
            .header("content-type", "application/json")
            .body(body);
        async move {
            let r = req.send().await.expect("answered");
            let status = r.status();
            let v: Value = r.json().await.expect("json");
            assert_eq!(status, 200, "{v}");
            usage(&v).1
        }
    };
    let prompt = |salt: Option<&str>| {
        let mut body = json!({"model": "tiny", "max_tokens": 4, "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Start with March."}]});
        if let Some(s) = salt {
            body["cache_salt"] = json!(s);
        }
        body.to_string()
    };
    let first = ask("sk-acme", prompt(None)).await;
    let again = ask("sk-acme", prompt(None)).await;
    let other = ask("sk-bravo", prompt(None)).await;
    // Both writing the same salt of their own.
    let own_a = ask("sk-acme", prompt(Some("team-1"))).await;
    let own_a2 = ask("sk-acme", prompt(Some("team-1"))).await;
    let same_b = ask("sk-bravo", prompt(Some("team-1"))).await;
    let b_again = ask("sk-bravo", prompt(None)).await;
    // The same prompt straight to the server, unsalted: nothing the
    // tenants sent is found (the salt reached the engine).
    let straight = |path: &str| {
        let req = c
            .post(server.url(path))
            .header("content-type", "application/json")
            .body(prompt(None));
        async move { req.send().await.unwrap().json::<Value>().await.unwrap() }
    };
    let direct = usage(&straight("/v1/chat/completions").await).1;
    eprintln!(
        "cache_salt: acme {first} then {again} cached; bravo, the same prompt, {other}; \
         both writing salt team-1: acme {own_a} then {own_a2}, bravo {same_b}; \
         bravo again {b_again}; unsalted, straight to the server, {direct}"
    );
    assert_eq!(first, 0, "the prompt is new to the server");
    assert!(
        again > 0 && own_a2 > 0 && b_again > 0,
        "each tenant's own prompt is cached again"
    );
    assert_eq!((other, same_b), (0, 0), "bravo found acme's blocks");
    assert_eq!(direct, 0, "an unsalted request found a tenant's blocks");
    // Spellings of the chat path that vLLM's server reads as its chat
    // endpoint (it decodes the path): each of acme's prompts, cached for
    // acme, sent by bravo under another spelling, is refused before vLLM or
    // salted as bravo's.
    let unsalted = straight("/v1/chat/completion%73").await;
    assert!(
        unsalted["choices"].is_array(),
        "vLLM reads the spelling as chat: {unsalted}"
    );
    let spelled = |i: usize| {
        json!({"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "system", "content": format!("Ledger {i}. {system}")},
            {"role": "user", "content": "Start with March."}]})
        .to_string()
    };
    let mut found = Vec::new();
    for (i, path) in [
        "/v1/chat/completion%73",
        "/v1/%63hat/completions",
        "/v1/chat/completions/",
        "//v1/chat//completions",
        "/v1/x/../chat/completions",
        "/v1/chat%2Fcompletions",
        "/v1/chat/completions;x",
        "/v1/Chat/Completions",
    ]
    .into_iter()
    .enumerate()
    {
        ask("sk-acme", spelled(i)).await;
        assert!(ask("sk-acme", spelled(i)).await > 0, "acme's own is cached");
        let auth = "authorization: Bearer sk-bravo\r\n";
        let (status, v) = post_raw_path(salted.port, path, auth, &spelled(i)).await;
        match status {
            200 => found.push((path, usage(&v).1)),
            400 => assert_eq!(v["error"]["code"], "invalid_path", "{path}: {v}"),
            other => panic!("{path}: {other} {v}"),
        }
    }
    eprintln!(
        "path spellings through the gateway, bravo's cached tokens of acme's prompts: {found:?}"
    );
    assert!(found.iter().all(|(_, cached)| *cached == 0), "{found:?}");
    assert!(
        found.len() >= 4,
        "the decodable spellings are served: {found:?}"
    );
    drop(keys_dir);
}
