//! Bad and hostile input (SPEC §8): clear JSON errors, nothing bound, no body
//! truncated — including bodies far past Pingora's 64 KiB retry buffer.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;

/// Two tiers, so the gateway must read the body to find `model`.
async fn two_tiers(max_body: Option<u64>) -> (Vec<SimBackend>, Gateway) {
    let sims: Vec<SimBackend> = ["small-0", "small-1", "big-0"]
        .iter()
        .map(|id| SimBackend::start(id, &[]))
        .collect();
    let mut extra = format!("{FAST_HEALTH}{}", affinity_yaml(1800));
    let tiers = [
        tier("small", true, &["qwen3-8b"], &[&sims[0], &sims[1]]),
        tier("big", false, &["qwen3-235b"], &[&sims[2]]),
    ];
    let dir = tempfile::tempdir().unwrap();
    let (port, mport) = (free_port(), free_port_pair());
    let mut yaml = config_yaml(port, mport, dir.path(), &tiers, "");
    if let Some(limit) = max_body {
        yaml = yaml.replacen(
            "server:\n",
            &format!("server:\n  max_body_bytes: {limit}\n"),
            1,
        );
    }
    extra.insert_str(0, &yaml);
    let gw = Gateway::start_yaml(dir, port, mport, &extra).await;
    (sims, gw)
}

/// A chat body of about `bytes` bytes whose `model` comes last, as the
/// OpenAI Python client orders it.
fn big_body(model: &str, bytes: usize) -> Vec<u8> {
    let filler: String = (0..bytes)
        .map(|i| (b'a' + (i % 26) as u8) as char)
        .collect();
    let v =
        json!({"messages": [{"role": "user", "content": filler}], "max_tokens": 2, "model": model});
    serde_json::to_vec(&v).unwrap()
}

#[tokio::test]
async fn large_bodies_are_forwarded_byte_for_byte_and_model_still_picks_the_tier() {
    let (_sims, gw) = two_tiers(None).await;
    let client = client();
    for (size, model, tier) in [
        (2 * 1024 * 1024, "qwen3-235b", "big"),
        (2 * 1024 * 1024, "qwen3-8b", "small"),
        (64 * 1024 - 40, "qwen3-235b", "big"),
        (64 * 1024 + 1, "qwen3-235b", "big"),
        (100, "qwen3-235b", "big"),
    ] {
        let body = big_body(model, size);
        for session in [Some("s-big"), None] {
            let mut req = client
                .post(gw.url("/v1/chat/completions"))
                .header("content-type", "application/json")
                .body(body.clone());
            if let Some(s) = session {
                req = req.header("x-session-id", s);
            }
            let r = reply(req.send().await.unwrap()).await;
            assert_eq!(
                r.status,
                200,
                "{size} bytes: {}",
                String::from_utf8_lossy(&r.body)
            );
            assert_eq!(r.tier.as_deref(), Some(tier));
            let sent_len = r.headers["x-sim-body-len"]
                .to_str()
                .unwrap()
                .parse::<usize>()
                .unwrap();
            assert_eq!(sent_len, body.len(), "{size}: body length at the backend");
            assert_eq!(
                r.headers["x-sim-body-hash"].to_str().unwrap(),
                agent_gateway_tools::sim::body_hash(&body),
                "{size}: body bytes at the backend"
            );
        }
    }
}

#[tokio::test]
async fn bodies_without_pre_read_are_forwarded_whole_too() {
    // One tier and a session header: the gateway streams the body through.
    let sim = SimBackend::start("only", &[]);
    let gw = Gateway::start(
        &[tier("default", true, &[], &[&sim])],
        &format!("{FAST_HEALTH}{}", affinity_yaml(60)),
    )
    .await;
    let body = big_body("m", 3 * 1024 * 1024);
    let r = reply(
        client()
            .post(gw.url("/v1/chat/completions"))
            .header("x-session-id", "s")
            .body(body.clone())
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.headers["x-sim-body-hash"].to_str().unwrap(),
        agent_gateway_tools::sim::body_hash(&body)
    );
}

#[tokio::test]
async fn body_over_the_limit_is_a_413() {
    let (sims, gw) = two_tiers(Some(1024 * 1024)).await;
    let client = client();
    let body = big_body("qwen3-235b", 1024 * 1024 + 10);
    let r = reply(
        client
            .post(gw.url("/v1/chat/completions"))
            .header("x-session-id", "too-big")
            .body(body)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["error"]["code"], "request_too_large");
    assert_eq!(gw.metric("agentserve_bindings{tier=\"big\"}").await, 0.0);
    for s in &sims {
        assert_eq!(s.stats().await["requests"], 0, "nothing reached a backend");
    }
    // Chunked (no Content-Length) over the limit: refused as well.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..20).map(|_| Ok(vec![b' '; 64 * 1024])).collect();
    let r = client
        .post(gw.url("/v1/chat/completions"))
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
            chunks,
        )))
        .send()
        .await
        .expect(
            "an answer, not a reset (the gateway reads the rest of a refused body for a while)",
        );
    assert_eq!(r.status().as_u16(), 413);
}

#[tokio::test]
async fn chunked_bodies_that_must_be_read_are_forwarded_or_refused_never_truncated() {
    let (_sims, gw) = two_tiers(None).await;
    let client = client();
    // Small chunked body: read, routed by model, forwarded whole.
    let body = big_body("qwen3-235b", 10_000);
    let parts: Vec<Result<Vec<u8>, std::io::Error>> =
        body.chunks(3000).map(|c| Ok(c.to_vec())).collect();
    let r = reply(
        client
            .post(gw.url("/v1/chat/completions"))
            .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
                parts,
            )))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.tier.as_deref(), Some("big"));
    assert_eq!(
        r.headers["x-sim-body-hash"].to_str().unwrap(),
        agent_gateway_tools::sim::body_hash(&body)
    );
    // Chunked and past the retry buffer: refused with 411, not cut short.
    let body = big_body("qwen3-235b", 200_000);
    let parts: Vec<Result<Vec<u8>, std::io::Error>> =
        body.chunks(16_000).map(|c| Ok(c.to_vec())).collect();
    let r = reply(
        client
            .post(gw.url("/v1/chat/completions"))
            .body(reqwest::Body::wrap_stream(futures_util::stream::iter(
                parts,
            )))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 411);
    assert_eq!(r.json()["error"]["code"], "length_required");
}

#[tokio::test]
async fn bad_session_headers_are_400_and_never_bound() {
    let (_sims, gw) = two_tiers(None).await;
    let client = client();
    let long = "x".repeat(257);
    for (name, value) in [
        ("x-session-id", long.as_str()),
        ("x-dynamo-session-id", long.as_str()),
        ("x-parent-session-id", long.as_str()),
    ] {
        let r = chat(&client, &gw, &[(name, value)], &chat_body("qwen3-8b", 0)).await;
        assert_eq!(r.status, 400, "{name}");
        let v = r.json();
        assert_eq!(v["error"]["code"], "invalid_session_header");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().unwrap().contains(name));
    }
    // Exactly 256 bytes is fine.
    let ok = "y".repeat(256);
    assert_eq!(
        chat(
            &client,
            &gw,
            &[("x-session-id", &ok)],
            &chat_body("qwen3-8b", 0)
        )
        .await
        .status,
        200
    );

    // Control characters and disagreeing duplicates, over a raw socket. (A
    // byte HTTP itself forbids, like \x01, is refused earlier by Pingora's
    // parser with a bare 400; a tab is legal HTTP, so it reaches our check.)
    for (raw_headers, json_error) in [
        ("x-session-id: a\tb\r\n", true),
        ("x-session-id: one\r\nx-session-id: two\r\n", true),
        ("x-session-id: a\x01b\r\n", false),
    ] {
        let body = br#"{"model":"qwen3-8b","messages":[]}"#;
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{raw_headers}connection: close\r\n\r\n",
            body.len()
        );
        let mut s = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        s.write_all(req.as_bytes()).unwrap();
        s.write_all(body).unwrap();
        let mut resp = String::new();
        s.read_to_string(&mut resp).unwrap();
        assert!(resp.starts_with("HTTP/1.1 400"), "{raw_headers:?} → {resp}");
        if json_error {
            assert!(
                resp.contains("invalid_session_header"),
                "{raw_headers:?} → {resp}"
            );
        }
    }
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"small\"}").await,
        1.0,
        "only the valid 256-byte id"
    );
}

#[tokio::test]
async fn garbage_requests_do_not_take_the_gateway_down() {
    let (_sims, gw) = two_tiers(None).await;
    let junk: Vec<Vec<u8>> = vec![
        b"GARBAGE\r\n\r\n".to_vec(),
        b"POST / HTTP/1.1\r\ncontent-length: -5\r\n\r\n".to_vec(),
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{not".to_vec(),
        vec![0xff; 10_000],
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-agent-serve-tier: \xff\xfe\r\ncontent-length: 2\r\n\r\n{}".to_vec(),
        b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}".to_vec(),
    ];
    for j in junk {
        let mut s = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
            .unwrap();
        // The gateway may close before reading all of it: a reset is an answer too.
        let _ = s.write_all(&j);
        let _ = s.shutdown(std::net::Shutdown::Write);
        let mut answer = Vec::new();
        let _ = s.read_to_end(&mut answer);
        let answer = String::from_utf8_lossy(&answer);
        let status = answer.split(' ').nth(1).unwrap_or("none");
        assert!(
            answer.starts_with("HTTP/1.1 4") && ["400", "404"].contains(&status),
            "{:?} → {answer:?}",
            String::from_utf8_lossy(&j[..j.len().min(60)])
        );
        // A request whose framing is broken cannot be followed by another.
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer:?}"
        );
    }
    // Still serving, and a malformed JSON body gets the gateway's own 400.
    let client = client();
    let r = chat(
        &client,
        &gw,
        &[("x-session-id", "after")],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 200);
    let r = reply(
        client
            .post(gw.url("/v1/chat/completions"))
            .header("x-session-id", "bad-json")
            .body("{\"model\": ")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 400);
    let e: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(e["error"]["code"], "invalid_body", "{e}");
}

/// The prompt tokens the engine found cached for a request, sent with
/// tenant `key` as the raw JSON `body`.
async fn cached_for(gw: &Gateway, key: &str, body: String) -> u64 {
    let r = client()
        .post(gw.url("/v1/chat/completions"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .expect("reaches the gateway");
    let r = reply(r).await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("the engine's cached tokens")
}

#[tokio::test]
async fn with_cache_salt_one_tenants_prompts_never_find_anothers_cached_blocks() {
    let (dir, keys) = write_keys(&[("sk-a", "acme", ""), ("sk-b", "bravo", "")]);
    let prompt = |salt: &str| {
        let mut body = chat_body("qwen3-8b", 0);
        if !salt.is_empty() {
            body["cache_salt"] = json!(salt);
        }
        body.to_string()
    };
    for salted in [true, false] {
        let extra = format!(
            "{}auth:\n  keys_file: \"{}\"\n  required: true\n  cache_salt: {}\n",
            affinity_yaml(1800),
            keys.display(),
            if salted { "tenant" } else { "off" }
        );
        let (sims, gw) = fleet(1, &extra).await;
        assert_eq!(cached_for(&gw, "sk-a", prompt("")).await, 0);
        // The pair that shows the salt reaches the cache: a's own prompt
        // is found again.
        assert!(cached_for(&gw, "sk-a", prompt("")).await > 0);
        let a_salt = sims[0].stats().await["last_cache_salt"].clone();
        let b_cached = cached_for(&gw, "sk-b", prompt("")).await;
        if !salted {
            assert!(b_cached > 0, "unsalted, b finds a's blocks");
            assert!(a_salt.is_null(), "nothing added: {a_salt}");
            continue;
        }
        assert_eq!(b_cached, 0, "b found a's blocks");
        let a_salt = a_salt.as_str().expect("a salt went upstream").to_string();
        // b naming a's salt, as a member or spelled with an escape.
        assert_eq!(cached_for(&gw, "sk-b", prompt(&a_salt)).await, 0);
        // Spelled with an escape, where a parser keeping the last of
        // repeated members would take b's: refused.
        let escaped = prompt("").replacen('{', &format!("{{\"cache\\u005fsalt\":\"{a_salt}\","), 1);
        let r = client()
            .post(gw.url("/v1/chat/completions"))
            .header("authorization", "Bearer sk-b")
            .body(escaped)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        // b's own blocks are b's.
        assert!(cached_for(&gw, "sk-b", prompt("")).await > 0);
        // A body the gateway cannot read is not sent unsalted.
        let r = client()
            .post(gw.url("/v1/chat/completions"))
            .header("authorization", "Bearer sk-b")
            .body(r#"["model", "qwen3-8b"]"#)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400);
        assert!(r.text().await.unwrap().contains("cache_salt"));
    }
    drop(dir);
}

/// Every spelling of the prompt paths that an engine's server reads as one
/// (percent-escapes, dot segments, doubled or trailing slashes, other
/// case, `;` parameters) is either refused before any engine is asked or
/// carries its tenant's salt: nothing of tenant a's prompt is found cached
/// for tenant b. The simulated engine decodes paths as vLLM's server does.
#[tokio::test]
async fn every_spelling_of_a_prompt_path_is_salted_or_refused() {
    let (dir, keys) = write_keys(&[("sk-a", "acme", ""), ("sk-b", "bravo", "")]);
    let extra = format!(
        "{}auth:\n  keys_file: \"{}\"\n  required: true\n  cache_salt: tenant\n",
        affinity_yaml(1800),
        keys.display()
    );
    let (sims, gw) = fleet(1, &extra).await;
    // One prompt of a's per spelling, nothing shared from the first block.
    let prompt = |i: usize| {
        json!({"model": "qwen3-8b", "max_tokens": 4, "messages": [
            {"role": "system", "content": format!("prompt {i}: {}", "Review the diff. ".repeat(30))},
            {"role": "user", "content": "go"}]})
        .to_string()
    };
    for i in 0..24 {
        assert_eq!(cached_for(&gw, "sk-a", prompt(i)).await, 0);
        assert!(
            cached_for(&gw, "sk-a", prompt(i)).await > 0,
            "a's own is found"
        );
    }
    // b's salt, as b's requests carry it.
    cached_for(&gw, "sk-b", prompt(99)).await;
    let b_salt = sims[0].stats().await["last_cache_salt"].clone();
    assert!(b_salt.is_string(), "{b_salt}");
    let spellings = [
        ("/v1/chat/completion%73", true),
        ("/v1/%63hat/completions", true),
        ("/v1/chat/%63ompletions/", true),
        ("/v1/chat/completions/", true),
        ("/v1/chat/completions/.", true),
        ("//v1/chat/completions", true),
        ("/v1//chat//completions", true),
        ("/v1/./chat/completions", true),
        ("/v1/x/../chat/completions", true),
        ("/v1/chat/%2e/completions", true),
        ("/v1/%2E%2E/v1/chat/completions", true),
        ("/v1/chat/completions?x=1", true),
        ("/v1/chat%2Fcompletions", false),
        ("/v1/chat%2fcompletions", false),
        ("/v1/chat/completions%2f", false),
        ("/v1/chat/completions.", false),
        ("/v1/chat/completions%2E", false),
        ("/v1/chat/completions;x=1", false),
        ("/v1/chat;a/completions", false),
        ("/v1/chat/completions%3B", false),
        ("/v1/chat/completion%2573", false),
        ("/v1/chat/completions%00", false),
        ("/V1/CHAT/COMPLETIONS", false),
        ("/v1/Chat/Completions", false),
    ];
    assert_eq!(spellings.len(), 24);
    let asked = || async { sims[0].stats().await["api_requests"].as_u64().unwrap() };
    let mut cached_for_b = 0;
    for (i, (path, served)) in spellings.into_iter().enumerate() {
        let before = asked().await;
        let auth = "authorization: Bearer sk-b\r\n";
        let (status, answer) = post_raw_path(gw.port, path, auth, &prompt(i)).await;
        if served {
            assert_eq!(status, 200, "{path}: {answer}");
            let stats = sims[0].stats().await;
            assert_eq!(stats["last_cache_salt"], b_salt, "{path}: not b's salt");
            cached_for_b += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
        } else {
            assert_eq!(status, 400, "{path}: {answer}");
            assert_eq!(answer["error"]["code"], "invalid_path", "{path}");
            assert_eq!(asked().await, before, "{path}: the engine was asked");
        }
    }
    assert_eq!(cached_for_b, 0, "tokens of a's prompts cached for b");
    // Responses over WebSocket: turns in frames the gateway does not salt.
    let before = asked().await;
    let r = client()
        .get(gw.url("/v1/responses"))
        .header("authorization", "Bearer sk-b")
        .header("connection", "Upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(asked().await, before, "the engine was asked");
    drop(dir);
}
