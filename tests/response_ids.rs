//! Stored responses across a fleet (issue 46): the ids the gateway issues
//! carry their route, so a follow-up by `previous_response_id` reaches the
//! replica that holds what it continues through any gateway, whatever
//! happened meanwhile (a race between two gateways, Redis gone, a flood of
//! other responses); and one tenant's ids open nothing of another's.
//! Real gateways, real simulated replicas that each keep their own
//! responses (as vLLM does), a real Redis.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;

/// Turn `turn` of chain `chain`: only its new input; the rest is stored.
fn turn_body(chain: usize, turn: usize, previous: Option<&str>, stream: bool) -> Value {
    let mut body = json!({
        "model": "m",
        "input": format!("chain {chain} turn {turn}: {}", "look at the failing test ".repeat(8)),
        "max_output_tokens": 2,
        "stream": stream,
    });
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    body
}

/// The response id of a JSON answer, or of a stream's `response.created`.
fn response_id(r: &Reply) -> String {
    let text = String::from_utf8_lossy(&r.body);
    if let Some(data) = text.lines().find_map(|l| l.strip_prefix("data: ")) {
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], "response.created", "{text}");
        return v["response"]["id"].as_str().unwrap().to_string();
    }
    r.json()["id"].as_str().unwrap().to_string()
}

/// `r` is a 404 `previous_response_not_found` that no backend answered.
fn assert_refused(r: &Reply, what: &str) {
    assert_eq!(
        r.status,
        404,
        "{what}: {}",
        String::from_utf8_lossy(&r.body)
    );
    assert_eq!(r.json()["error"]["code"], "previous_response_not_found");
    assert_eq!(r.backend, None, "{what}: a backend was asked");
}

async fn post(gw: &Gateway, headers: &[(&str, &str)], body: &Value) -> Reply {
    let mut req = client().post(gw.url("/v1/responses")).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    reply(req.send().await.expect("the gateway answers")).await
}

/// `n` gateways in front of `sims`, sharing the store at `redis_port`,
/// with `extra` YAML (keys, limits) besides.
async fn gateways(sims: &[SimBackend], redis_port: u16, n: usize, extra: &str) -> Vec<Gateway> {
    let mut gws = Vec::new();
    for _ in 0..n {
        let gw = Gateway::start(
            &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
            &format!(
                "{FAST_HEALTH}{}  store:\n    kind: redis\n    url: \"redis://127.0.0.1:{redis_port}\"\n    timeout_ms: 200\n{extra}",
                affinity_yaml(1800)
            ),
        )
        .await;
        wait_until("the store connected", || async {
            gw.metric("agentserve_store_ops_total{").await > 0.0
                || gw.metric("agentserve_store_up").await == 1.0
        })
        .await;
        gws.push(gw);
    }
    gws
}

fn sims(n: usize) -> Vec<SimBackend> {
    (0..n)
        .map(|i| SimBackend::start(&format!("vllm-{i}"), &[]))
        .collect()
}

/// 24 chains of 6 turns, 6 chains at a time, each turn through the other
/// gateway than the turn before, JSON and streamed: every follow-up is
/// answered (the holder, found from the id alone, however soon after its
/// answer it is sent), and every chain stays on one replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chains_alternating_between_two_gateways_six_at_a_time_never_meet_a_404() {
    let redis = Redis::start_on(free_port());
    let sims = sims(3);
    let gws = std::sync::Arc::new(gateways(&sims, redis.port, 2, "").await);
    for stream in [false, true] {
        let mut tasks = Vec::new();
        for group in 0..6 {
            let gws = std::sync::Arc::clone(&gws);
            tasks.push(tokio::spawn(async move {
                let mut failed = Vec::new();
                let mut homes: HashMap<usize, Vec<String>> = HashMap::new();
                for chain in (group..24).step_by(6) {
                    let mut previous: Option<String> = None;
                    for turn in 0..6 {
                        let gw = &gws[(chain + turn) % 2];
                        let body = turn_body(chain, turn, previous.as_deref(), stream);
                        let r = post(gw, &[], &body).await;
                        if r.status != 200 {
                            failed.push(format!(
                                "{chain}.{turn}: {} {}",
                                r.status,
                                String::from_utf8_lossy(&r.body)
                            ));
                            break;
                        }
                        previous = Some(response_id(&r));
                        homes.entry(chain).or_default().push(r.sim_backend.unwrap());
                    }
                }
                (failed, homes)
            }));
        }
        for t in tasks {
            let (failed, homes) = t.await.unwrap();
            assert!(failed.is_empty(), "stream {stream}: {failed:?}");
            for (chain, h) in homes {
                assert!(h.iter().all(|b| *b == h[0]), "chain {chain} split: {h:?}");
            }
        }
    }
}

/// Redis gone: a follow-up through another gateway than the one that saw
/// its response answered still reaches the replica that holds it (nothing
/// of the route is kept anywhere but in the id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_store_gone_a_follow_up_through_the_other_gateway_reaches_its_holder() {
    let mut redis = Redis::start_on(free_port());
    let sims = sims(3);
    let gws = gateways(&sims, redis.port, 2, "").await;
    let mut firsts = Vec::new();
    for chain in 0..9 {
        let r = post(&gws[0], &[], &turn_body(chain, 0, None, false)).await;
        assert_eq!(r.status, 200);
        firsts.push((response_id(&r), r.sim_backend.unwrap()));
    }
    redis.stop();
    wait_until("the second gateway finds the store gone", || async {
        gws[1].metric("agentserve_store_up").await == 0.0
    })
    .await;
    for (chain, (id, home)) in firsts.iter().enumerate() {
        let r = post(&gws[1], &[], &turn_body(chain, 1, Some(id), chain % 2 == 1)).await;
        assert_eq!(
            r.status,
            200,
            "{chain}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.sim_backend.as_ref(), Some(home), "{chain}");
    }
}

/// With client keys: a tenant that presents another tenant's response id,
/// or one forged from it, is told there is no such response, and the
/// request reaches no backend; the owner's own follow-up works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenants_response_id_opens_nothing() {
    let redis = Redis::start_on(free_port());
    let sims = sims(3);
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.yaml");
    let digest = |k: &str| {
        use sha2::Digest;
        format!("{:x}", sha2::Sha256::digest(k.as_bytes()))
    };
    std::fs::write(
        &keys,
        format!(
            "keys:\n  - {{ key_sha256: {}, tenant: acme }}\n  - {{ key_sha256: {}, tenant: globex }}\n",
            digest("sk-acme"),
            digest("sk-globex")
        ),
    )
    .unwrap();
    let gws = gateways(
        &sims,
        redis.port,
        2,
        &format!(
            "auth:\n  keys_file: \"{}\"\n  required: true\n",
            keys.display()
        ),
    )
    .await;
    let (acme, globex) = (
        [("authorization", "Bearer sk-acme")],
        [("authorization", "Bearer sk-globex")],
    );
    let requests_before = |_: ()| async {
        let mut n = 0.0;
        for s in &sims {
            n += s.stats().await["requests"].as_f64().unwrap_or(0.0);
        }
        n
    };
    let mut ids = Vec::new();
    for chain in 0..12 {
        let r = post(&gws[chain % 2], &acme, &turn_body(chain, 0, None, false)).await;
        assert_eq!(r.status, 200);
        ids.push(response_id(&r));
    }
    let before = requests_before(()).await;
    for (chain, id) in ids.iter().enumerate() {
        let mut forged = id.clone().into_bytes();
        let at = forged.len() - 3;
        forged[at] = if forged[at] == b'A' { b'B' } else { b'A' };
        let forged = String::from_utf8(forged).unwrap();
        for presented in [id.as_str(), forged.as_str()] {
            let r = post(
                &gws[(chain + 1) % 2],
                &globex,
                &turn_body(chain, 1, Some(presented), false),
            )
            .await;
            assert_refused(&r, &format!("chain {chain}"));
        }
    }
    assert_eq!(requests_before(()).await, before, "no replica saw them");
    // The engine's own ids of acme's responses (the simulator's are
    // `resp_<replica><n>`, guessable as vLLM's are not, which makes this
    // the harder case): every one presented by globex in a body, and in
    // each path that names a stored response, reaches no replica.
    let asked = || async {
        let mut n = 0.0;
        for s in &sims {
            n += s.stats().await["api_requests"].as_f64().unwrap();
        }
        n
    };
    let asked_before = asked().await;
    let engine_ids: Vec<String> = (0..3)
        .flat_map(|i| (1..=24).map(move |n| format!("resp_vllm{i}{n:x}")))
        .collect();
    let mut refused = 0;
    for (i, engine) in engine_ids.iter().enumerate() {
        let gw = &gws[i % 2];
        let follow = post(gw, &globex, &turn_body(i, 1, Some(engine), false)).await;
        let by_path = |method: reqwest::Method, tail: &str| {
            client()
                .request(method, gw.url(&format!("/v1/responses/{engine}{tail}")))
                .header("authorization", "Bearer sk-globex")
        };
        let mut answers = vec![follow];
        for (method, tail) in [
            (reqwest::Method::GET, ""),
            (reqwest::Method::DELETE, ""),
            (reqwest::Method::GET, "/input_items"),
            (reqwest::Method::POST, "/cancel"),
        ] {
            answers.push(reply(by_path(method, tail).send().await.unwrap()).await);
        }
        for r in answers {
            assert_refused(&r, engine);
            refused += 1;
        }
    }
    assert_eq!(refused, engine_ids.len() * 5);
    assert_eq!(asked().await, asked_before, "no replica saw them");
    // Acme's responses are intact after globex's deletes: each is still
    // retrieved by its own id.
    for id in &ids {
        let r = reply(
            client()
                .get(gws[0].url(&format!("/v1/responses/{id}")))
                .header("authorization", "Bearer sk-acme")
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(r.status, 200, "{id}: {}", String::from_utf8_lossy(&r.body));
    }
    // The owner's follow-ups, through either gateway, are answered.
    for (chain, id) in ids.iter().enumerate() {
        let r = post(
            &gws[(chain + 1) % 2],
            &acme,
            &turn_body(chain, 1, Some(id), false),
        )
        .await;
        assert_eq!(
            r.status,
            200,
            "{chain}: {}",
            String::from_utf8_lossy(&r.body)
        );
    }
}

/// One client's flood of responses (with `max_bindings` far below it)
/// misroutes no live chain: nothing of a route is kept that a flood could
/// evict. `FLOOD=100000` for the long run; the gateway's memory stays
/// within 64 MiB of where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_responses_misroutes_no_live_chain() {
    let flood: usize = std::env::var("FLOOD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6_000);
    let sims = sims(3);
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!(
            "{FAST_HEALTH}affinity:\n  sticky_ttl_seconds: 1800\n  hash_key: \"6ca32cd571e4bf0a0bafed739a373699046a3912ab91e742c9abfd1ab0fc0ae2\"\n  max_bindings: 2000\n"
        ),
    )
    .await;
    let mut chains = Vec::new();
    for chain in 0..30 {
        let r = post(&gw, &[], &turn_body(chain, 0, None, false)).await;
        assert_eq!(r.status, 200);
        chains.push((response_id(&r), r.sim_backend.unwrap()));
    }
    let rss = |pid: u32| {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap();
        kb * 1024
    };
    let before = rss(gw.pid());
    // The flood, 32 at a time: one-shot responses, each stored somewhere.
    let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let url = gw.url("/v1/responses");
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (next, url) = (std::sync::Arc::clone(&next), url.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            let mut failed = 0;
            while next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) < flood {
                let body = json!({"model": "m", "input": "x", "max_output_tokens": 1});
                match c.post(&url).json(&body).send().await {
                    Ok(r) if r.status() == 200 => {
                        let _ = r.bytes().await;
                    }
                    _ => failed += 1,
                }
            }
            failed
        }));
    }
    let mut failed = 0;
    for t in tasks {
        failed += t.await.unwrap();
    }
    assert_eq!(failed, 0, "the flood was served");
    let grown = rss(gw.pid()).saturating_sub(before);
    for (chain, (id, home)) in chains.iter().enumerate() {
        let r = post(&gw, &[], &turn_body(chain, 1, Some(id), false)).await;
        assert_eq!(
            r.status,
            200,
            "{chain}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(r.sim_backend.as_ref(), Some(home), "{chain} misrouted");
    }
    eprintln!("flood of {flood}: RSS grew {} KiB", grown / 1024);
    assert!(grown < 64 << 20, "memory bounded: grew {grown} bytes");
}

/// A stored response retrieved by the id the gateway issued, through a
/// gateway that never saw it answered: asked of its holder by the engine's
/// own id, and answered with the gateway's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_response_is_retrieved_by_its_id_through_any_gateway() {
    let redis = Redis::start_on(free_port());
    let sims = sims(3);
    let gws = gateways(&sims, redis.port, 2, "").await;
    let first = post(&gws[0], &[], &turn_body(7, 0, None, false)).await;
    let id = response_id(&first);
    let r = reply(
        client()
            .get(gws[1].url(&format!("/v1/responses/{id}")))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    assert_eq!(r.sim_backend, first.sim_backend);
    assert_eq!(r.json()["id"], id.as_str());
}

/// Rotating the fleet's secret: ids issued under the old key still reach
/// their holder after a restart with the new key and the old one retired;
/// without the old key listed they open nothing (404, no replica asked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_issued_under_a_retired_key_still_reach_their_holder() {
    let sims = sims(3);
    const K2: &str = "9b1f04c3e7a25d86f0e4b1a7c39d52e8a6f1c0b7d49e3a25f8c6b0d1e7a43f92";
    let start = |affinity: String| {
        let sims = &sims;
        async move {
            Gateway::start(
                &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
                &format!("{FAST_HEALTH}{affinity}"),
            )
            .await
        }
    };
    let k1 = start(affinity_yaml(1800)).await;
    let mut issued = Vec::new();
    for chain in 0..12 {
        let r = post(&k1, &[], &turn_body(chain, 0, None, false)).await;
        assert_eq!(r.status, 200);
        issued.push((response_id(&r), r.sim_backend.clone()));
    }
    drop(k1);
    let rotated = start(
        affinity_yaml(1800).replace(FLEET_KEY, K2)
            + &format!("  retired_hash_keys: [\"{FLEET_KEY}\"]\n"),
    )
    .await;
    for (chain, (id, home)) in issued.iter().enumerate() {
        let r = post(&rotated, &[], &turn_body(chain, 1, Some(id), false)).await;
        assert_eq!(
            r.status,
            200,
            "{chain}: {}",
            String::from_utf8_lossy(&r.body)
        );
        assert_eq!(&r.sim_backend, home, "{chain}");
    }
    drop(rotated);
    let forgot = start(affinity_yaml(1800).replace(FLEET_KEY, K2)).await;
    for (chain, (id, _)) in issued.iter().enumerate() {
        let r = post(&forgot, &[], &turn_body(chain, 2, Some(id), false)).await;
        assert_refused(&r, &format!("chain {chain}"));
    }
}
