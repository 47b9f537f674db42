//! Sick backends and hostile clients (issue 9): passive health ejects a
//! backend that fails real requests while its health endpoint says 200, a hung
//! backend times out, slow clients are cut with a 408, connections are
//! capped, pipelined requests are all answered. Real gateway and replica
//! processes, raw sockets where a well-behaved client library would not do it.

mod common;

use common::*;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

const SESSION: &str = "x-session-id";

/// One replica behind a gateway whose `server` section gets the `server` lines.
async fn one_replica(server: &str) -> (SimBackend, Gateway) {
    let sim = SimBackend::start("vllm-0", &[]);
    let server = server.to_string();
    let gw = Gateway::start_with(
        &[tier("default", true, &[], &[&sim])],
        move |_| server,
        &format!("{FAST_HEALTH}{}", affinity_yaml(1800)),
    )
    .await;
    (sim, gw)
}

/// A fleet of 3 with passive health set to eject after `failures`.
async fn fleet_ejecting(failures: u32, server: &str) -> (Vec<SimBackend>, Gateway) {
    let extra = format!(
        "{FAST_HEALTH}{}outlier:\n  consecutive_failures: {failures}\n  base_ejection_ms: 600000\n  max_ejection_ms: 600000\n",
        affinity_yaml(1800)
    );
    fleet_serving(3, server, &extra).await
}

fn sim<'a>(sims: &'a [SimBackend], id: &str) -> &'a SimBackend {
    sims.iter()
        .find(|s| s.id == id)
        .expect("a backend of the fleet")
}

#[tokio::test]
async fn a_backend_failing_requests_is_ejected_and_its_sessions_rebind_once() {
    let (sims, gw) = fleet_ejecting(3, "").await;
    let client = client();
    let first = chat(&client, &gw, &[(SESSION, "s-eject")], &chat_body("m", 0)).await;
    assert_eq!(first.status, 200);
    let bound = first.backend.clone().unwrap();
    // The bound replica now answers 500 to every request; /health stays 200.
    sim(&sims, &bound)
        .set_faults(json!({"fail_rate": 1.0}))
        .await;
    let mut statuses = Vec::new();
    let mut backends = Vec::new();
    for turn in 1..=8 {
        let r = chat(&client, &gw, &[(SESSION, "s-eject")], &chat_body("m", turn)).await;
        statuses.push(r.status);
        backends.push(r.backend.clone().unwrap_or_default());
    }
    // Three failures pass through (the gateway cannot know sooner), then the
    // session moves once and stays.
    assert_eq!(statuses, vec![500, 500, 500, 200, 200, 200, 200, 200]);
    let moved_to = &backends[3];
    assert_ne!(moved_to, &bound);
    assert!(backends[3..].iter().all(|b| b == moved_to), "{backends:?}");
    let admin = gw.admin_backend(&bound).await;
    assert_eq!(admin["healthy"], false, "{admin}");
    assert_eq!(admin["health_checks_pass"], true, "{admin}");
    assert!(admin["ejected_ms_left"].as_u64().unwrap() > 0);
    let labels = format!("{{backend=\"{bound}\",tier=\"default\"}}");
    assert_eq!(
        gw.metric(&format!("agentserve_backend_ejections_total{labels}"))
            .await,
        1.0
    );
    assert_eq!(
        gw.metric("agentserve_affinity_broken_total{tier=\"default\"}")
            .await,
        1.0
    );
    // New sessions avoid it too, while it is out.
    for i in 0..12 {
        let r = chat(
            &client,
            &gw,
            &[(SESSION, &format!("new-{i}"))],
            &chat_body("m", 0),
        )
        .await;
        assert_eq!(r.status, 200);
        assert_ne!(r.backend.unwrap(), bound);
    }
    // Undrain is the operator's "put it back".
    let r = client
        .post(gw.admin_url(&format!("/admin/backends/{bound}/undrain")))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    assert_eq!(gw.admin_backend(&bound).await["healthy"], true);
}

#[tokio::test]
async fn a_hung_backend_times_out_with_504_and_is_ejected() {
    let (sims, gw) = fleet_ejecting(2, "  read_timeout_ms: 1500\n").await;
    let client = client();
    let first = chat(&client, &gw, &[(SESSION, "s-hang")], &chat_body("m", 0)).await;
    let bound = first.backend.clone().unwrap();
    sim(&sims, &bound).set_faults(json!({"hang": true})).await;
    let mut seen = Vec::new();
    for turn in 1..=4 {
        let r = chat(&client, &gw, &[(SESSION, "s-hang")], &chat_body("m", turn)).await;
        if r.status == 504 {
            assert_eq!(r.json()["error"]["code"], "backend_timeout");
        }
        seen.push((r.status, r.backend.unwrap_or_default() == bound));
    }
    assert_eq!(
        seen,
        vec![(504, true), (504, true), (200, false), (200, false)]
    );
    assert_eq!(
        gw.metric("agentserve_timeouts_total{kind=\"upstream_read\"}")
            .await,
        2.0
    );
}

#[tokio::test]
async fn ejection_never_takes_the_last_backend_of_a_tier() {
    let sim0 = SimBackend::start("only-0", &[]);
    let gw = Gateway::start(
        &[tier("default", true, &[], &[&sim0])],
        &format!(
            "{FAST_HEALTH}{}outlier:\n  consecutive_failures: 1\n",
            affinity_yaml(1800)
        ),
    )
    .await;
    sim0.set_faults(json!({"fail_rate": 1.0})).await;
    let client = client();
    for turn in 0..5 {
        let r = chat(&client, &gw, &[(SESSION, "s-one")], &chat_body("m", turn)).await;
        // The backend's own answer, never "no healthy backend".
        assert_eq!(r.status, 500);
    }
    sim0.set_faults(json!({})).await;
    let r = chat(&client, &gw, &[(SESSION, "s-one")], &chat_body("m", 9)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.hit.as_deref(), Some("true"));
}

/// The response in `raw` is framed right: its body is as long as its
/// `content-length` says.
fn assert_framed(raw: &str) {
    let (head, body) = raw.split_once("\r\n\r\n").expect("a complete head");
    let len: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .expect("content-length");
    assert_eq!(body.len(), len, "{raw:?}");
}

/// Read from `s` until EOF (or an error); what arrived.
fn read_all(s: &mut TcpStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn headers_dripped_byte_by_byte_get_a_408_and_the_connection_closes() {
    let (_sim, gw) = one_replica("  header_timeout_ms: 1000\n").await;
    let port = gw.port;
    // A client that drips one header byte every 200 ms, forever (Pingora's own
    // timer restarts on every byte).
    let dripper = std::thread::spawn(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let mut reader = s.try_clone().unwrap();
        let reading = std::thread::spawn(move || read_all(&mut reader));
        s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
            .unwrap();
        for _ in 0..300 {
            if s.write_all(b"a").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        reading.join().unwrap()
    });
    // A client that connects and says nothing at all.
    let mut silent = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let silent_got = read_all(&mut silent);
    let dripped_got = tokio::task::spawn_blocking(move || dripper.join().unwrap())
        .await
        .unwrap();
    for got in [&dripped_got, &silent_got] {
        assert!(got.starts_with("HTTP/1.1 408"), "{got:?}");
        assert_framed(got);
        assert!(got.contains("\"code\":\"request_timeout\""), "{got:?}");
    }
    assert_eq!(
        gw.metric("agentserve_timeouts_total{kind=\"header\"}")
            .await,
        2.0
    );
    // Well-behaved clients are unaffected.
    let r = chat(&client(), &gw, &[(SESSION, "fine")], &chat_body("m", 0)).await;
    assert_eq!(r.status, 200);
}

#[tokio::test]
async fn a_body_sent_at_a_crawl_gets_a_408() {
    let (_sim, gw) =
        one_replica("  body_min_rate_bytes_per_s: 1000\n  body_rate_grace_ms: 1000\n").await;
    let port = gw.port;
    let got = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let mut reader = s.try_clone().unwrap();
        let reading = std::thread::spawn(move || read_all(&mut reader));
        s.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-session-id: crawl\r\n\
              content-type: application/json\r\ncontent-length: 100000\r\n\r\n{\"model\":\"m\",",
        )
        .unwrap();
        // 10 bytes every 100 ms: 100 B/s, a tenth of the minimum.
        for _ in 0..600 {
            if s.write_all(b"          ").is_err() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        reading.join().unwrap()
    })
    .await
    .unwrap();
    assert!(got.starts_with("HTTP/1.1 408"), "{got:?}");
    assert!(got.contains("request_timeout"), "{got:?}");
    assert_eq!(
        gw.metric("agentserve_timeouts_total{kind=\"body_rate\"}")
            .await,
        1.0
    );
    // Nothing of it is still held.
    wait_until("in-flight back to 0", || async {
        gw.metric("agentserve_backend_in_flight{backend=\"vllm-0\",tier=\"default\"}")
            .await
            == 0.0
    })
    .await;
}

#[tokio::test]
async fn connections_over_the_limit_get_a_503_and_the_rest_are_served() {
    let (_sim, gw) = one_replica("  max_connections: 2\n").await;
    let get = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n";
    // Two kept-alive connections, each known to be open: each got an answer.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        s.write_all(get).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut buf = [0u8; 1024];
        let n = s.read(&mut buf).unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        held.push(s);
    }
    // Counted from here: the harness's readiness probes (connections opened
    // and dropped at once) may have been refused too, if their tasks ran
    // after the two above had taken the slots.
    let refused = "agentserve_connections_refused_total{reason=\"max_connections\"}";
    let before = gw.metric(refused).await;
    let mut third = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    let got = read_all(&mut third);
    assert!(got.starts_with("HTTP/1.1 503"), "{got:?}");
    assert!(got.contains("too_many_connections"), "{got:?}");
    assert_framed(&got);
    // At least this one counted (a harness probe still in flight when
    // `before` was read may be refused and counted too: seen on a busy box).
    let after = gw.metric(refused).await;
    assert!(after >= before + 1.0, "refused {before} -> {after}");
    // One closes; a new connection is served again.
    drop(held.pop());
    wait_until("a connection slot frees up", || async {
        let mut s = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
        s.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nconnection: close\r\n\r\n")
            .unwrap();
        read_all(&mut s).starts_with("HTTP/1.1 200")
    })
    .await;
}

#[tokio::test]
async fn pipelined_requests_are_all_answered_in_order() {
    let (_sims, gw) = fleet(1, &affinity_yaml(1800)).await;
    let mut s = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    let body = serde_json::to_vec(&chat_body("m", 0)).unwrap();
    let mut wire = Vec::new();
    for (i, close) in [(0, false), (1, false), (2, true)] {
        wire.extend_from_slice(
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-session-id: pipe-{i}\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n{}\r\n",
                body.len(),
                if close { "connection: close\r\n" } else { "" }
            )
            .as_bytes(),
        );
        wire.extend_from_slice(&body);
    }
    // All three in one write.
    s.write_all(&wire).unwrap();
    let got = read_all(&mut s);
    assert_eq!(got.matches("HTTP/1.1 200").count(), 3, "{got}");
    let sessions: Vec<usize> = (0..3)
        .map(|i| got.find(&format!("\"session\":\"pipe-{i}\"")).unwrap())
        .collect();
    assert!(
        sessions.windows(2).all(|w| w[0] < w[1]),
        "answered in order"
    );
}

#[tokio::test]
async fn requests_without_host_or_with_huge_headers_are_refused() {
    let (_sims, gw) = fleet(1, &affinity_yaml(1800)).await;
    let mut s = TcpStream::connect(("127.0.0.1", gw.port)).unwrap();
    s.write_all(b"GET /v1/models HTTP/1.1\r\nx-session-id: nohost\r\n\r\n")
        .unwrap();
    let got = read_all(&mut s);
    assert!(got.starts_with("HTTP/1.1 400"), "{got:?}");
    assert!(got.contains("missing_host"));

    let big = "a".repeat(100 * 1024);
    let r = client()
        .get(gw.url("/v1/models"))
        .header("x-padding", &big)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 431);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "headers_too_large");
    // Neither reached the backend's binding table.
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        0.0
    );
}

#[tokio::test]
async fn admin_errors_do_not_echo_unbounded_input() {
    let (_sims, gw) = fleet(1, &affinity_yaml(1800)).await;
    let long = "x".repeat(60 * 1024);
    let r = client()
        .get(gw.admin_url(&format!("/admin/sessions/{long}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    let body = r.text().await.unwrap();
    assert!(body.len() < 1024, "{} bytes", body.len());
}

#[tokio::test]
async fn a_reload_that_changes_the_hash_key_is_refused_and_bindings_survive() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let client = client();
    let first = chat(&client, &gw, &[(SESSION, "keep")], &chat_body("m", 0)).await;
    let yaml = std::fs::read_to_string(&gw.config_path).unwrap();
    std::fs::write(
        &gw.config_path,
        yaml.replace(FLEET_KEY, &FLEET_KEY.chars().rev().collect::<String>()),
    )
    .unwrap();
    gw.reload("error", 1.0).await;
    let again = chat(&client, &gw, &[(SESSION, "keep")], &chat_body("m", 1)).await;
    assert_eq!(again.backend, first.backend);
    assert_eq!(again.hit.as_deref(), Some("true"));
}

#[tokio::test]
async fn bodies_read_to_route_are_bounded_by_a_memory_budget() {
    // Two tiers: the gateway must read bodies to find `model`.
    let sims = [
        SimBackend::start("small-0", &[]),
        SimBackend::start("big-0", &[]),
    ];
    let gw = Gateway::start_with(
        &[
            tier("small", true, &["m-small"], &[&sims[0]]),
            tier("big", false, &["m-big"], &[&sims[1]]),
        ],
        |_| "  preread_budget_bytes: 100000\n".to_string(),
        &format!("{FAST_HEALTH}{}", affinity_yaml(1800)),
    )
    .await;
    let body = |bytes: usize| {
        json!({"model": "m-big", "max_tokens": 2,
               "messages": [{"role": "user", "content": "a".repeat(bytes)}]})
    };
    let client = client();
    let over = chat(&client, &gw, &[(SESSION, "big")], &body(150_000)).await;
    assert_eq!(over.status, 503);
    assert_eq!(over.json()["error"]["code"], "gateway_busy");
    assert_eq!(over.headers.get("retry-after").unwrap(), "1");
    // Within the budget, the same request is routed by its model.
    let fits = chat(&client, &gw, &[(SESSION, "big")], &body(50_000)).await;
    assert_eq!(fits.status, 200);
    assert_eq!(fits.tier.as_deref(), Some("big"));
}

/// Send `head` then `body_bytes` of chunked body (64 KiB chunks) while
/// reading; what the gateway answered.
fn upload(port: u16, head: &str, body_bytes: usize) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let mut reader = s.try_clone().unwrap();
    let reading = std::thread::spawn(move || read_all(&mut reader));
    let _ = s.write_all(head.as_bytes());
    let chunk = vec![b' '; 64 * 1024];
    let mut sent = 0;
    while sent < body_bytes {
        let mut frame = format!("{:x}\r\n", chunk.len()).into_bytes();
        frame.extend_from_slice(&chunk);
        frame.extend_from_slice(b"\r\n");
        if s.write_all(&frame).is_err() {
            break;
        }
        sent += chunk.len();
    }
    let _ = s.write_all(b"0\r\n\r\n");
    reading.join().unwrap()
}

#[tokio::test]
async fn oversized_uploads_get_a_413_not_a_reset() {
    let (_sim, gw) = one_replica("  max_body_bytes: 1048576\n").await;
    let port = gw.port;
    let answers = tokio::task::spawn_blocking(move || {
        // Declared too large, asking to continue: refused before any body.
        let declared = {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-session-id: up-1\r\n\
                  content-type: application/json\r\ncontent-length: 41943040\r\n\
                  expect: 100-continue\r\n\r\n",
            )
            .unwrap();
            read_all(&mut s)
        };
        let chunked =
            |session: &str, expect: bool| {
                upload(
                    port,
                    &format!(
                    "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-session-id: {session}\r\n\
                     content-type: application/json\r\ntransfer-encoding: chunked\r\n{}\r\n",
                    if expect { "expect: 100-continue\r\n" } else { "" }
                ),
                    40 * 1024 * 1024,
                )
            };
        (declared, chunked("up-2", true), chunked("up-3", false))
    })
    .await
    .unwrap();
    let (declared, chunked_expect, chunked_plain) = answers;
    assert!(declared.starts_with("HTTP/1.1 413"), "{declared:?}");
    for got in [&declared, &chunked_expect, &chunked_plain] {
        let final_status = got
            .split("\r\n\r\n")
            .flat_map(|part| part.lines().next())
            .find(|l| l.starts_with("HTTP/1.1 ") && !l.starts_with("HTTP/1.1 100"))
            .unwrap_or_default()
            .to_string();
        assert!(final_status.starts_with("HTTP/1.1 413"), "{got:.300}");
        assert!(got.contains("request_too_large"), "{got:.300}");
    }
}

#[tokio::test]
async fn a_malformed_chunked_body_gets_a_400_and_leaves_no_binding() {
    let (_sims, gw) = fleet(1, &affinity_yaml(1800)).await;
    let port = gw.port;
    let got = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-session-id: bad-chunks\r\n\
              content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n\
              5\r\n{\"mod\r\nzz-not-hex\r\nxxxx\r\n",
        )
        .unwrap();
        read_all(&mut s)
    })
    .await
    .unwrap();
    let final_line = got
        .split("\r\n\r\n")
        .flat_map(|part| part.lines().next())
        .find(|l| l.starts_with("HTTP/1.1 ") && !l.starts_with("HTTP/1.1 100"))
        .unwrap_or_default()
        .to_string();
    assert!(final_line.starts_with("HTTP/1.1 400"), "{got:?}");
    assert!(got.contains("invalid_body"), "{got:?}");
    let r = client()
        .get(gw.admin_url("/admin/sessions/bad-chunks"))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        404,
        "no binding for a request that was never valid"
    );
}

/// A stand-in engine that streams without end: `/health` answers 200, any
/// other request gets an SSE stream of 16 KiB events until the connection
/// breaks. Returns its address and a flag set when a stream ended.
fn endless_streamer() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let ended = std::sync::Arc::new(AtomicBool::new(false));
    let flag = std::sync::Arc::clone(&ended);
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { break };
            let flag = std::sync::Arc::clone(&flag);
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match s.read(&mut byte) {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let text = String::from_utf8_lossy(&head).to_string();
                if !text.starts_with("POST") {
                    let _ = s.write_all(
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok",
                    );
                    return;
                }
                let len: usize = text
                    .lines()
                    .find_map(|l| {
                        l.to_ascii_lowercase()
                            .strip_prefix("content-length:")
                            .map(|v| v.trim().parse().unwrap_or(0))
                    })
                    .unwrap_or(0);
                let mut body = vec![0u8; len];
                let _ = s.read_exact(&mut body);
                let _ = s.write_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
                );
                let event = format!("data: {}\n\n", "x".repeat(16 * 1024));
                let frame = format!("{:x}\r\n{event}\r\n", event.len());
                // Bounded: 2 GiB at most, far more than any socket buffers.
                for _ in 0..(128 * 1024) {
                    if s.write_all(frame.as_bytes()).is_err() {
                        break;
                    }
                }
                flag.store(true, Ordering::Relaxed);
            });
        }
    });
    (addr, ended)
}

#[tokio::test]
async fn a_client_that_stops_reading_is_cut_and_its_backend_released() {
    let (addr, ended) = endless_streamer();
    let gw = Gateway::start_with(
        &[TierSpec {
            name: "default",
            default: true,
            models: &[],
            backends: vec![("streamer".into(), addr, 1)],
        }],
        |_| "  client_write_timeout_ms: 1000\n".to_string(),
        &format!(
            "{FAST_HEALTH}{}load:\n  scrape: false\n",
            affinity_yaml(1800)
        ),
    )
    .await;
    let port = gw.port;
    // A client that reads the start of the response, then nothing more, and
    // keeps the connection open.
    let client = std::thread::spawn(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let body = br#"{"model":"m","stream":true,"messages":[]}"#;
        s.write_all(
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-session-id: sleepy\r\n\
                 content-type: application/json\r\ncontent-length: {}\r\n\r\n",
                body.len()
            )
            .as_bytes(),
        )
        .unwrap();
        s.write_all(body).unwrap();
        let mut first = [0u8; 512];
        let _ = s.read(&mut first);
        s
    });
    let held = tokio::task::spawn_blocking(move || client.join().unwrap())
        .await
        .unwrap();
    wait_until("the stalled client to be cut", || async {
        gw.metric("agentserve_timeouts_total{kind=\"client_write\"}")
            .await
            == 1.0
    })
    .await;
    wait_until(
        "the backend's stream to end and the request to be released",
        || async {
            ended.load(std::sync::atomic::Ordering::Relaxed)
                && gw
                    .metric("agentserve_backend_in_flight{backend=\"streamer\",tier=\"default\"}")
                    .await
                    == 0.0
        },
    )
    .await;
    let v: Value = reqwest::get(gw.admin_url("/admin/sessions/sleepy"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["in_flight"], 0, "lease released: {v}");
    drop(held);
}

#[tokio::test]
async fn a_body_that_stalls_gets_a_408() {
    let (_sim, gw) = one_replica("  body_idle_timeout_ms: 1000\n").await;
    let port = gw.port;
    let got = tokio::task::spawn_blocking(move || {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nx-session-id: stall\r\n\
              content-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"model\":",
        )
        .unwrap();
        // ... and nothing more, with the connection kept open.
        read_all(&mut s)
    })
    .await
    .unwrap();
    assert!(got.starts_with("HTTP/1.1 408"), "{got:?}");
    assert_eq!(
        gw.metric("agentserve_timeouts_total{kind=\"body_idle\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn a_reload_that_removes_a_backend_drops_its_gauges() {
    let (_sims, gw) = fleet(2, &affinity_yaml(1800)).await;
    let gone = "agentserve_backend_healthy{backend=\"vllm-1\",tier=\"default\"}";
    assert!(gw.metrics_text().await.contains(gone));
    let yaml = std::fs::read_to_string(&gw.config_path).unwrap();
    let kept: String = yaml
        .lines()
        .filter(|l| !l.contains("id: \"vllm-1\""))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&gw.config_path, kept).unwrap();
    // Scrapes race the reload: one that read the old backends must not
    // bring the removed one's gauges back after the reload dropped them.
    let url = gw.metrics_url("/metrics");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scrapers: Vec<_> = (0..4)
        .map(|_| {
            let (url, stop) = (url.clone(), stop.clone());
            tokio::spawn(async move {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = reqwest::get(&url).await;
                }
            })
        })
        .collect();
    gw.reload("success", 1.0).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for s in scrapers {
        s.await.unwrap();
    }
    let text = gw.metrics_text().await;
    assert!(
        !text.contains("backend=\"vllm-1\",tier=\"default\"} "),
        "{text}"
    );
    assert!(text.contains("agentserve_backend_healthy{backend=\"vllm-0\",tier=\"default\"}"));
}

#[tokio::test]
async fn a_backend_response_header_over_the_cap_is_a_502() {
    // A stand-in engine whose answers carry a 100 KB header (over the 64 KiB
    // cap; Pingora itself would forward it).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { break };
            std::thread::spawn(move || {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    match s.read(&mut byte) {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let health = head.starts_with(b"GET /health");
                let big = if health {
                    String::new()
                } else {
                    format!("x-big: {}\r\n", "a".repeat(100 * 1024))
                };
                let _ = s.write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\n{big}content-length: 2\r\nconnection: close\r\n\r\nok"
                    )
                    .as_bytes(),
                );
            });
        }
    });
    let gw = Gateway::start(
        &[TierSpec {
            name: "default",
            default: true,
            models: &[],
            backends: vec![("bighead".into(), addr, 1)],
        }],
        &format!(
            "{FAST_HEALTH}{}load:\n  scrape: false\n",
            affinity_yaml(1800)
        ),
    )
    .await;
    let r = chat(&client(), &gw, &[(SESSION, "big-head")], &chat_body("m", 0)).await;
    assert_eq!(r.status, 502);
    assert_eq!(r.json()["error"]["code"], "backend_error");
    assert!(r.headers.get("x-big").is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_backend_is_ejected_by_its_silence_and_its_sessions_served_elsewhere() {
    // The default read timeout (10 minutes) and first-byte bound (learned:
    // 4x the slowest first byte, at least 5 s); admission holds 2 requests
    // per backend, waiters up to 2 minutes: far past the learned bound even
    // where a busy box made the first turns slow, far short of the read
    // timeout.
    let sections = format!(
        "{FAST_HEALTH}{}admission:\n  enabled: true\n  max_in_flight: 2\n  max_wait_ms: 120000\n",
        affinity_yaml(1800)
    );
    let (sims, gw) = fleet_serving(3, "", &sections).await;
    let client = client();
    // Sessions until one backend holds five; each first turn answered
    // (what teaches the backends' first bytes).
    let mut by_backend: std::collections::HashMap<String, Vec<String>> = Default::default();
    let mut n = 0;
    let (hung, sessions) = loop {
        let id = format!("s-stall-{n}");
        n += 1;
        let r = chat(&client, &gw, &[(SESSION, &id)], &chat_body("m", 0)).await;
        assert_eq!(r.status, 200);
        let held = by_backend.entry(r.backend.unwrap()).or_default();
        held.push(id);
        if held.len() == 5 {
            let (b, s) = by_backend.into_iter().find(|(_, s)| s.len() == 5).unwrap();
            break (b, s);
        }
    };
    // It stops answering /v1; /health stays 200.
    sim(&sims, &hung).set_faults(json!({"hang": true})).await;
    let started = std::time::Instant::now();
    let send = |id: &str, turn: usize| {
        let (client, url, id) = (
            client.clone(),
            gw.url("/v1/chat/completions"),
            id.to_string(),
        );
        tokio::spawn(async move {
            let r = client
                .post(url)
                .header(SESSION, id)
                .json(&chat_body("m", turn))
                .send()
                .await;
            let at = started.elapsed();
            r.map(|r| {
                let backend = r
                    .headers()
                    .get("x-agent-serve-backend")
                    .map(|v| v.to_str().unwrap().to_string());
                (r.status().as_u16(), backend, at)
            })
        })
    };
    // Two turns take its two slots and hang there (never re-sent: they
    // may be running)...
    let hanging: Vec<_> = sessions[..2].iter().map(|s| send(s, 1)).collect();
    wait_until("two requests awaiting their first byte", || async {
        gw.admin_backend(&hung).await["awaiting_first_byte"] == 2
    })
    .await;
    // ...three more of its sessions' turns wait for a slot there.
    let waiters: Vec<_> = sessions[2..].iter().map(|s| send(s, 1)).collect();
    wait_until("three waiters", || async {
        gw.admin_backend(&hung).await["admission"]["waiting"] == 3
    })
    .await;
    // Each waiter is served by another backend: not a 429 at its deadline,
    // nor 10 minutes of read timeout.
    for w in waiters {
        let (status, backend, at) = w.await.unwrap().expect("an answer");
        println!("waiter served by {backend:?} {at:?} after the backend hung");
        assert_eq!(status, 200);
        assert_ne!(backend.as_deref(), Some(hung.as_str()));
    }
    let admin = gw.admin_backend(&hung).await;
    assert_eq!(admin["healthy"], false, "{admin}");
    assert_eq!(admin["health_checks_pass"], true, "{admin}");
    let labels = format!("{{backend=\"{hung}\",tier=\"default\"}}");
    assert_eq!(
        gw.metric(&format!("agentserve_backend_ejections_total{labels}"))
            .await,
        1.0
    );
    // Every later turn of its sessions goes elsewhere at once, the two
    // whose turns still hang included.
    for id in &sessions {
        let r = chat(&client, &gw, &[(SESSION, id)], &chat_body("m", 2)).await;
        assert_eq!(r.status, 200);
        assert_ne!(r.backend.as_deref(), Some(hung.as_str()));
    }
    assert!(
        gw.metric("agentserve_affinity_broken_total{tier=\"default\"}")
            .await
            >= 5.0
    );
    for h in hanging {
        h.abort();
    }
}
