//! Affinity semantics through the real gateway: single-flight placement,
//! subagent groups, leases, soft mode, drain, explicit targets, native agent
//! headers, tenants, the admin API and the bounded table.

mod common;

use agent_gateway::affinity::hrw::{self, HrwHasher, KeyKind};
use common::*;
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::net::TcpStream;
use std::sync::Arc;

fn affinity(extra: &str) -> String {
    format!("{}{extra}", affinity_yaml(1800))
}

async fn admin(
    gw: &Gateway,
    method: reqwest::Method,
    path: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = client().request(method, gw.admin_url(path));
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.expect("admin API answers");
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn concurrent_first_requests_and_fifty_subagents_land_on_one_backend() {
    let (_sims, gw) = fleet(4, &affinity("")).await;
    let gw = Arc::new(gw);
    for round in 0..10 {
        let sid = format!("race-{round}");
        let (c1, c2) = (client(), client());
        let headers = [("x-session-id", sid.as_str())];
        let body = chat_body("m", 0);
        let (a, b) = tokio::join!(
            chat(&c1, &gw, &headers, &body),
            chat(&c2, &gw, &headers, &body)
        );
        assert_eq!(a.backend, b.backend, "{sid}");
        let hits = [&a, &b]
            .iter()
            .filter(|r| r.hit.as_deref() == Some("true"))
            .count();
        assert_eq!(
            hits, 1,
            "one request placed the session, the other followed it"
        );
    }
    let mut tasks = Vec::new();
    for child in 0..50 {
        let gw = Arc::clone(&gw);
        tasks.push(tokio::spawn(async move {
            let sid = format!("child-{child}");
            chat(
                &client(),
                &gw,
                &[
                    ("x-session-id", &sid),
                    ("x-parent-session-id", "orchestrator"),
                ],
                &chat_body("m", 0),
            )
            .await
        }));
    }
    let mut backends = HashSet::new();
    for t in tasks {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200);
        backends.insert(r.backend.unwrap());
    }
    assert_eq!(
        backends.len(),
        1,
        "50 concurrent subagents on one backend: {backends:?}"
    );
    // 10 sessions + one group; the children did not bind individually.
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        11.0
    );
    let (status, v) = admin(
        &gw,
        reqwest::Method::GET,
        "/admin/sessions/orchestrator?kind=group",
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(v["backend"], *backends.iter().next().unwrap());
    assert_eq!(v["pending"], false);
}

/// A listener that accepts nothing and whose accept queue is full: connects
/// to it hang (SYNs are dropped) until it is closed.
struct Blackhole {
    listener: Option<socket2_free::Listener>,
    _fill: Vec<TcpStream>,
}

mod socket2_free {
    /// Owns the socket: dropping it closes the listener.
    pub struct Listener(#[allow(dead_code)] pub std::os::fd::OwnedFd);
    /// listen(2) with a backlog of 0 on 127.0.0.1:port.
    pub fn listen_tiny(port: u16) -> Listener {
        use std::os::fd::FromRawFd;
        unsafe {
            let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
            assert!(fd >= 0);
            let one: libc::c_int = 1;
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                libc::SO_REUSEADDR,
                &one as *const _ as *const libc::c_void,
                4,
            );
            let addr = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: port.to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_be_bytes([127, 0, 0, 1]).to_be(),
                },
                sin_zero: [0; 8],
            };
            let rc = libc::bind(
                fd,
                &addr as *const _ as *const libc::sockaddr,
                std::mem::size_of::<libc::sockaddr_in>() as u32,
            );
            assert_eq!(rc, 0, "bind {port}");
            assert_eq!(libc::listen(fd, 0), 0);
            Listener(std::os::fd::OwnedFd::from_raw_fd(fd))
        }
    }
}

impl Blackhole {
    fn on(port: u16) -> Blackhole {
        let listener = socket2_free::listen_tiny(port);
        let mut fill = Vec::new();
        // Fill the accept queue; later SYNs are dropped.
        for _ in 0..4 {
            if let Ok(s) = TcpStream::connect_timeout(
                &([127, 0, 0, 1], port).into(),
                std::time::Duration::from_millis(200),
            ) {
                fill.push(s);
            }
        }
        Blackhole {
            listener: Some(listener),
            _fill: fill,
        }
    }

    fn close(&mut self) {
        self.listener = None;
        self._fill.clear();
    }
}

#[tokio::test]
async fn a_client_leaving_mid_wait_does_not_wedge_its_session() {
    let (mut sims, gw) = fleet_serving(
        2,
        // The first request stays stuck connecting until the test lets it fail.
        "  connect_timeout_ms: 30000\n",
        &format!(
            "health:\n  interval_ms: 3600000\n{}",
            affinity("  single_flight_wait_ms: 30000\n")
        ),
    )
    .await;
    // A session whose HRW choice is vllm-0, computed as the gateway does.
    let h = HrwHasher::new(FLEET_KEY);
    let cands = hrw_candidates(&["vllm-0", "vllm-1"]);
    let sid = (0..)
        .map(|i| format!("wedge-{i}"))
        .find(|s| hrw::choose(h.session_hash(KeyKind::Session, "default", s), &cands) == Some(0))
        .unwrap();
    // vllm-0 now swallows connection attempts (health checks do not run again).
    let port = sims[0].addr.port();
    sims[0].kill();
    let mut hole = Blackhole::on(port);

    let gw = Arc::new(gw);
    let first = {
        let (gw, sid) = (Arc::clone(&gw), sid.clone());
        tokio::spawn(async move {
            chat(
                &client(),
                &gw,
                &[("x-session-id", &sid)],
                &chat_body("m", 0),
            )
            .await
        })
    };
    wait_until("the first request to hold the pending binding", || async {
        admin(
            &gw,
            reqwest::Method::GET,
            &format!("/admin/sessions/{sid}"),
            None,
        )
        .await
        .1["pending"]
            == true
    })
    .await;
    // A second request of the session waits for the first; its client gives up.
    let short = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(300))
        .build()
        .unwrap();
    let gave_up = short
        .post(gw.url("/v1/chat/completions"))
        .header("x-session-id", &sid)
        .json(&chat_body("m", 1))
        .send()
        .await;
    assert!(gave_up.is_err(), "the waiter was still waiting");
    // The gateway noticed the departure: only the first request holds a lease.
    wait_until("the waiter to be gone", || async {
        admin(
            &gw,
            reqwest::Method::GET,
            &format!("/admin/sessions/{sid}"),
            None,
        )
        .await
        .1["in_flight"]
            == 1
    })
    .await;
    // The stuck backend now refuses: the first request fails over and places
    // the session; later turns follow without waiting.
    hole.close();
    let r = first.await.unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.backend.as_deref(), Some("vllm-1"));
    let next = chat(
        &client(),
        &gw,
        &[("x-session-id", &sid)],
        &chat_body("m", 2),
    )
    .await;
    assert_eq!(next.status, 200);
    assert_eq!(next.backend.as_deref(), Some("vllm-1"));
    assert_eq!(next.hit.as_deref(), Some("true"));
}

#[tokio::test]
async fn a_client_disconnect_ends_its_lease() {
    let (sims, gw) = fleet(2, &affinity("")).await;
    for s in &sims {
        s.set_faults(json!({"hold_streams": true})).await;
    }
    let mut body = chat_body("m", 0);
    body["stream"] = json!(true);
    let resp = client()
        .post(gw.url("/v1/chat/completions"))
        .header("x-session-id", "leaver")
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    stream.next().await.unwrap().unwrap();
    let (_, v) = admin(&gw, reqwest::Method::GET, "/admin/sessions/leaver", None).await;
    assert_eq!(v["in_flight"], 1);
    assert_eq!(
        v["expires_in_ms"],
        Value::Null,
        "no deadline while in flight"
    );
    drop(stream);
    for s in &sims {
        s.release_streams().await;
    }
    wait_until("the lease to end", || async {
        admin(&gw, reqwest::Method::GET, "/admin/sessions/leaver", None)
            .await
            .1["in_flight"]
            == 0
    })
    .await;
    let (_, v) = admin(&gw, reqwest::Method::GET, "/admin/sessions/leaver", None).await;
    assert!(
        v["expires_in_ms"].as_u64().unwrap() > 1_700_000,
        "idle deadline restarted: {v}"
    );
}

/// The prompt tokens a response's `usage` says were not cached.
fn uncached(usage: &Value) -> u64 {
    usage["prompt_tokens"].as_u64().unwrap() - cached_tokens(usage)
}

/// The prompt tokens a response's `usage` says were cached.
fn cached_tokens(usage: &Value) -> u64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

/// A chat turn whose last user message is `bytes` of text no replica has seen.
fn turn_with_new_text(tag: &str, bytes: usize) -> Value {
    let mut body = chat_body("m", 0);
    let text: String = (0..)
        .map(|i| format!("{tag}-{i} "))
        .flat_map(|w| w.chars().collect::<Vec<_>>())
        .take(bytes)
        .collect();
    body["messages"][1]["content"] = json!(text);
    body
}

/// Two replicas that prefill 20 µs a token, one request at a time, behind
/// the cost-aware soft policy; and a session's first two turns on one of
/// them (the second with 500 tokens of new text): its home.
async fn soft_cost_fleet_with_a_session_home(
    c: &reqwest::Client,
    s: &[(&str, &str)],
) -> ([SimBackend; 2], Gateway, String) {
    let args = ["--prefill-us-per-token", "20", "--serial-prefill"];
    let sims = [
        SimBackend::start("vllm-0", &args),
        SimBackend::start("vllm-1", &args),
    ];
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!(
            "{FAST_HEALTH}{}",
            affinity("  mode: soft\n  soft_policy: cost\n  allow_explicit_target: true\n")
        ),
    )
    .await;
    let first = chat(c, &gw, s, &chat_body("m", 0)).await;
    let home = first.backend.clone().unwrap();
    let second = chat(c, &gw, s, &turn_with_new_text("t1", 2000)).await;
    assert_eq!(second.backend.as_deref(), Some(home.as_str()));
    assert_eq!(second.json()["x_agent_serve"]["reason"], "hit");
    (sims, gw, home)
}

/// `turn` left `home` for cost, the tier's one move so far.
async fn moved_once_for_cost(gw: &Gateway, turn: &Reply, home: &str) {
    assert_ne!(turn.backend.as_deref(), Some(home));
    assert_eq!(turn.json()["x_agent_serve"]["reason"], "moved");
    assert_eq!(
        gw.metric("agentserve_affinity_moves_total{reason=\"cost\",tier=\"default\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn cost_policy_moves_a_session_off_a_backend_that_slowed_down() {
    let c = client();
    let s = [("x-session-id", "agent")];
    let (sims, gw, home) = soft_cost_fleet_with_a_session_home(&c, &s).await;

    // The home replica becomes 50× slower; the gateway learns it from the
    // answers of requests sent there (no session, explicit target).
    let sim = sims.iter().find(|x| x.id == home).unwrap();
    sim.set_faults(json!({"slowdown": 50.0})).await;
    for i in 0..6 {
        let r = chat(
            &c,
            &gw,
            &[("x-agent-serve-backend-id", home.as_str())],
            &turn_with_new_text(&format!("probe{i}"), 1000),
        )
        .await;
        assert_eq!(r.status, 200);
    }
    // What the gateway learned is visible to the operator (a response is
    // learned from once the request is logged, just after the client has it).
    wait_until("8 responses learned from", || async {
        gw.admin_backend(&home).await["learned"]["responses"] == 8
    })
    .await;
    let learned = gw.admin_backend(&home).await["learned"].clone();
    let cost_us = learned["prefill_us_per_token"].as_f64().expect("learned");
    let queue_ms = learned["queue_ms"].as_f64().unwrap();
    assert!(
        cost_us * 500.0 / 1000.0 + queue_ms > 100.0,
        "the slowdown shows in cost or queue: {learned}"
    );
    let gauge = format!(
        "agentserve_backend_prefill_seconds_per_token{{backend=\"{home}\",tier=\"default\"}}"
    );
    wait_until("the learned cost is exported", || async {
        gw.metric(&gauge).await > 0.0
    })
    .await;
    // Its next turn would wait there far longer than re-reading its short
    // cached prefix elsewhere: it moves, once, for cost.
    let third = chat(&c, &gw, &s, &turn_with_new_text("t2", 2000)).await;
    moved_once_for_cost(&gw, &third, &home).await;
    let fourth = chat(&c, &gw, &s, &chat_body("m", 3)).await;
    assert_eq!(fourth.backend, third.backend, "it stays where it moved");
}

#[tokio::test]
async fn cost_policy_moves_a_session_off_a_backend_whose_prefill_stalls_before_any_answer_shows_it()
{
    let c = client();
    let s = [("x-session-id", "agent")];
    let (sims, gw, home) = soft_cost_fleet_with_a_session_home(&c, &s).await;

    // The home replica stalls: 200× slower, so a 1,000-token prompt sent
    // there prefills for 4 s. No answer comes back to teach the cost; only
    // the request at the head of its queue running far past its estimate
    // shows it.
    let sim = sims.iter().find(|x| x.id == home).unwrap();
    sim.set_faults(json!({"slowdown": 200.0})).await;
    let probe = {
        let (c, url, home) = (c.clone(), gw.url("/v1/chat/completions"), home.clone());
        tokio::spawn(async move {
            c.post(url)
                .header("x-agent-serve-backend-id", home)
                .json(&turn_with_new_text("probe", 4000))
                .send()
                .await
        })
    };
    wait_until("the stalled prefill has run for a second", || async {
        gw.admin_backend(&home).await["learned"]["queue_head_ms"]
            .as_u64()
            .is_some_and(|ms| ms >= 1000)
    })
    .await;
    // Its next turn would wait behind the stall: it moves, for cost, while
    // the stalled request is still prefilling (nothing answered since turn 2).
    let third = chat(&c, &gw, &s, &turn_with_new_text("t2", 2000)).await;
    moved_once_for_cost(&gw, &third, &home).await;
    let learned = gw.admin_backend(&home).await["learned"].clone();
    assert_eq!(learned["responses"], 2, "{learned}");
    assert!(
        learned["queued_prefill_tokens"].as_u64() > Some(0),
        "{learned}"
    );
    probe.abort();
}

#[tokio::test]
async fn soft_mode_moves_a_session_off_an_overloaded_backend() {
    let (sims, gw) = fleet(2, &affinity("  mode: soft\n  soft_max_in_flight: 2\n")).await;
    let first = chat(
        &client(),
        &gw,
        &[("x-session-id", "busy")],
        &chat_body("m", 0),
    )
    .await;
    let owner = first.backend.clone().unwrap();
    let owner_sim = sims.iter().find(|s| s.id == owner).unwrap();
    owner_sim.set_faults(json!({"hold_streams": true})).await;
    // Two streams of other sessions pinned to the same backend keep it busy.
    let mut held = Vec::new();
    for i in 0.. {
        if held.len() == 2 {
            break;
        }
        let sid = format!("filler-{i}");
        let mut body = chat_body("m", 0);
        body["stream"] = json!(true);
        let resp = client()
            .post(gw.url("/v1/chat/completions"))
            .header("x-session-id", &sid)
            .json(&body)
            .send()
            .await
            .unwrap();
        if resp.headers()["x-agent-serve-backend"] == owner.as_str() {
            let mut s = resp.bytes_stream();
            s.next().await.unwrap().unwrap();
            held.push(s);
        } else {
            drop(resp);
        }
        assert!(i < 200);
    }
    let moved = chat(
        &client(),
        &gw,
        &[("x-session-id", "busy")],
        &chat_body("m", 1),
    )
    .await;
    assert_ne!(moved.backend.as_deref(), Some(owner.as_str()));
    assert_eq!(moved.json()["x_agent_serve"]["reason"], "moved");
    assert_eq!(
        gw.metric("agentserve_affinity_moves_total{reason=\"overloaded\",tier=\"default\"}")
            .await,
        1.0
    );
    let (_, v) = admin(&gw, reqwest::Method::GET, "/admin/sessions/busy", None).await;
    assert_eq!(v["version"], 2, "the rebind is versioned");
    owner_sim.release_streams().await;
    drop(held);
    // It stays where it moved.
    let again = chat(
        &client(),
        &gw,
        &[("x-session-id", "busy")],
        &chat_body("m", 2),
    )
    .await;
    assert_eq!(again.backend, moved.backend);
    assert_eq!(again.hit.as_deref(), Some("true"));
}

#[tokio::test]
async fn drain_and_undrain_through_the_admin_api() {
    let (_sims, gw) = fleet(3, &affinity("")).await;
    let mut placed = Vec::new();
    for i in 0..30 {
        let sid = format!("d{i}");
        let r = chat(
            &client(),
            &gw,
            &[("x-session-id", &sid)],
            &chat_body("m", 0),
        )
        .await;
        placed.push((sid, r.backend.unwrap()));
    }
    let (status, v) = admin(
        &gw,
        reqwest::Method::POST,
        "/admin/backends/vllm-0/drain",
        None,
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let (_, list) = admin(&gw, reqwest::Method::GET, "/admin/backends", None).await;
    let b0 = list["backends"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["id"] == "vllm-0")
        .unwrap()
        .clone();
    assert_eq!(b0["draining"], true);
    assert_eq!(b0["healthy"], true);
    let on_b0 = placed.iter().filter(|(_, b)| b == "vllm-0").count() as u64;
    assert_eq!(b0["bindings"], on_b0);
    // Existing sessions stay (hard mode); new ones avoid the drained backend.
    for (sid, b) in &placed {
        let r = chat(&client(), &gw, &[("x-session-id", sid)], &chat_body("m", 1)).await;
        assert_eq!(r.backend.as_ref(), Some(b));
    }
    for i in 0..30 {
        let r = chat(
            &client(),
            &gw,
            &[("x-session-id", &format!("new{i}"))],
            &chat_body("m", 0),
        )
        .await;
        assert_ne!(r.backend.as_deref(), Some("vllm-0"));
    }
    // Asked to move its sessions: they leave on their next turn.
    admin(
        &gw,
        reqwest::Method::POST,
        "/admin/backends/vllm-0/drain",
        Some(json!({"move_sessions": true})),
    )
    .await;
    for (sid, b) in &placed {
        let r = chat(&client(), &gw, &[("x-session-id", sid)], &chat_body("m", 2)).await;
        if b == "vllm-0" {
            assert_ne!(r.backend.as_deref(), Some("vllm-0"));
        }
    }
    assert_eq!(
        gw.metric("agentserve_affinity_moves_total{reason=\"drain\",tier=\"default\"}")
            .await,
        on_b0 as f64
    );
    // Undrained, it takes new sessions again.
    admin(
        &gw,
        reqwest::Method::POST,
        "/admin/backends/vllm-0/undrain",
        None,
    )
    .await;
    let mut seen = HashSet::new();
    for i in 0..30 {
        seen.insert(
            chat(
                &client(),
                &gw,
                &[("x-session-id", &format!("after{i}"))],
                &chat_body("m", 0),
            )
            .await
            .backend
            .unwrap(),
        );
    }
    assert!(seen.contains("vllm-0"));
    let (status, _) = admin(
        &gw,
        reqwest::Method::POST,
        "/admin/backends/nope/drain",
        None,
    )
    .await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn explicit_target_is_off_by_default_and_checked_when_on() {
    let (_sims, gw) = fleet(2, &affinity("")).await;
    let r = chat(
        &client(),
        &gw,
        &[
            ("x-session-id", "s"),
            ("x-agent-serve-backend-id", "vllm-1"),
        ],
        &chat_body("m", 0),
    )
    .await;
    assert_eq!(r.status, 403);
    assert_eq!(r.json()["error"]["code"], "explicit_target_forbidden");

    let (sims, gw) = fleet(2, &affinity("  allow_explicit_target: true\n")).await;
    let bound = chat(&client(), &gw, &[("x-session-id", "s")], &chat_body("m", 0))
        .await
        .backend
        .unwrap();
    let other = if bound == "vllm-0" {
        "vllm-1"
    } else {
        "vllm-0"
    };
    let r = chat(
        &client(),
        &gw,
        &[("x-session-id", "s"), ("x-agent-serve-backend-id", other)],
        &chat_body("m", 1),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.sim_backend.as_deref(), Some(other));
    assert_eq!(r.json()["x_agent_serve"]["reason"], "explicit_target");
    // The binding is untouched.
    let r = chat(&client(), &gw, &[("x-session-id", "s")], &chat_body("m", 2)).await;
    assert_eq!(r.backend.as_deref(), Some(bound.as_str()));
    let r = chat(
        &client(),
        &gw,
        &[("x-agent-serve-backend-id", "ghost")],
        &chat_body("m", 0),
    )
    .await;
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["code"], "unknown_backend");
    sims[1].set_faults(json!({"unhealthy": true})).await;
    wait_until("vllm-1 down", || async {
        gw.metric("agentserve_backend_healthy{backend=\"vllm-1\",tier=\"default\"}")
            .await
            == 0.0
    })
    .await;
    let r = chat(
        &client(),
        &gw,
        &[("x-agent-serve-backend-id", "vllm-1")],
        &chat_body("m", 0),
    )
    .await;
    assert_eq!(r.status, 503);
    assert_eq!(r.json()["error"]["code"], "backend_unavailable");
}

#[tokio::test]
async fn native_agent_headers() {
    let (_sims, gw) = fleet(3, &affinity("")).await;
    let c = client();
    // Dynamo: a session closed by x-dynamo-session-final starts over.
    chat(
        &c,
        &gw,
        &[("x-dynamo-session-id", "dyn")],
        &chat_body("m", 0),
    )
    .await;
    let r = chat(
        &c,
        &gw,
        &[
            ("x-dynamo-session-id", "dyn"),
            ("x-dynamo-session-final", "true"),
        ],
        &chat_body("m", 1),
    )
    .await;
    assert_eq!(r.hit.as_deref(), Some("true"));
    let r = chat(
        &c,
        &gw,
        &[("x-dynamo-session-id", "dyn")],
        &chat_body("m", 2),
    )
    .await;
    assert_new_binding(&r, "the final request closed the binding");
    // Claude Code: subagents of one parent agent share a group on the session's backend.
    let main = chat(
        &c,
        &gw,
        &[("x-claude-code-session-id", "cc")],
        &chat_body("m", 0),
    )
    .await
    .backend;
    for agent in 0..6 {
        let id = format!("agent-{agent}");
        let r = chat(
            &c,
            &gw,
            &[
                ("x-claude-code-session-id", "cc"),
                ("x-claude-code-agent-id", &id),
                ("x-claude-code-parent-agent-id", "main"),
            ],
            &chat_body("m", 0),
        )
        .await;
        assert_eq!(r.backend, main, "subagent {agent} with its parent");
    }
    // ... through a group binding of their parent agent (session id and
    // parent agent id), not merely by sharing the session's own binding.
    let (status, v) = admin(
        &gw,
        reqwest::Method::GET,
        "/admin/sessions/cc%1Fmain?kind=group",
        None,
    )
    .await;
    assert_eq!(status, 200, "the parent agent's group is bound: {v}");
    assert_eq!(v["backend"].as_str(), main.as_deref());
    // Codex: its session header is recognised.
    let a = chat(&c, &gw, &[("x-codex-session-id", "cx")], &chat_body("m", 0)).await;
    let b = chat(&c, &gw, &[("x-codex-session-id", "cx")], &chat_body("m", 1)).await;
    assert_eq!(b.hit.as_deref(), Some("true"));
    assert_eq!(a.backend, b.backend);
    // The canonical header wins over the others when both are sent.
    let r = chat(
        &c,
        &gw,
        &[("x-session-id", "canon"), ("x-dynamo-session-id", "dyn2")],
        &chat_body("m", 0),
    )
    .await;
    assert_eq!(r.json()["x_agent_serve"]["session"], "canon");
}

#[tokio::test]
async fn tenants_never_share_a_binding() {
    let (_sims, gw) = fleet(3, &affinity("  tenant_header: x-tenant\n")).await;
    let c = client();
    for tenant in ["acme", "globex", "initech", "umbrella"] {
        let r = chat(
            &c,
            &gw,
            &[("x-session-id", "same-id"), ("x-tenant", tenant)],
            &chat_body("m", 0),
        )
        .await;
        assert_eq!(
            r.hit.as_deref(),
            Some("false"),
            "{tenant} got its own binding"
        );
    }
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        4.0
    );
    let r = chat(
        &c,
        &gw,
        &[("x-session-id", "same-id"), ("x-tenant", "acme")],
        &chat_body("m", 1),
    )
    .await;
    assert_eq!(r.hit.as_deref(), Some("true"));
    let (status, v) = admin(
        &gw,
        reqwest::Method::GET,
        "/admin/sessions/same-id?tenant=acme",
        None,
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["backend"], r.backend.clone().unwrap());

    let (_sims, gw) = fleet(3, &affinity("  tenant_from_authorization: true\n")).await;
    chat(
        &c,
        &gw,
        &[("x-session-id", "k"), ("authorization", "Bearer key-a")],
        &chat_body("m", 0),
    )
    .await;
    let other = chat(
        &c,
        &gw,
        &[("x-session-id", "k"), ("authorization", "Bearer key-b")],
        &chat_body("m", 0),
    )
    .await;
    assert_eq!(other.hit.as_deref(), Some("false"));
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        2.0
    );
}

#[tokio::test]
async fn admin_api_looks_up_and_deletes_bindings_behind_a_token() {
    let sims: Vec<SimBackend> = (0..2)
        .map(|i| SimBackend::start(&format!("vllm-{i}"), &[]))
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let (port, mport) = (free_port(), free_port_pair());
    let yaml = config_yaml(
        port,
        mport,
        dir.path(),
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!("{FAST_HEALTH}{}", affinity_yaml(1800)),
    )
    .replace("admin:\n", "admin:\n  token: \"s3cret\"\n");
    let gw = Gateway::start_yaml(dir, port, mport, &yaml).await;
    let r = chat(
        &client(),
        &gw,
        &[("x-session-id", "look")],
        &chat_body("m", 0),
    )
    .await;
    let c = client();
    let denied = c
        .get(gw.admin_url("/admin/sessions/look"))
        .send()
        .await
        .unwrap();
    assert_eq!(denied.status().as_u16(), 401);
    let ok: Value = c
        .get(gw.admin_url("/admin/sessions/look"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ok["backend"], r.backend.unwrap());
    assert_eq!(ok["version"], 1);
    // The scheme is case-insensitive; a wrong token is not.
    let lower = c
        .get(gw.admin_url("/admin/sessions/look"))
        .header("authorization", "bearer s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(lower.status().as_u16(), 200);
    let wrong = c
        .get(gw.admin_url("/admin/sessions/look"))
        .header("authorization", "Bearer s3cre")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status().as_u16(), 401);
    let del = c
        .delete(gw.admin_url("/admin/sessions/look"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(del.status().as_u16(), 200);
    let gone = c
        .get(gw.admin_url("/admin/sessions/look"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status().as_u16(), 404);
    let r = chat(
        &client(),
        &gw,
        &[("x-session-id", "look")],
        &chat_body("m", 1),
    )
    .await;
    assert_new_binding(&r, "deleted through the admin API");
}

/// `r` made a new binding: no hit, and the reason a first turn has — or,
/// since its prompt was served before, `prefix`: placed where it is cached.
fn assert_new_binding(r: &Reply, why: &str) {
    assert_eq!(r.hit.as_deref(), Some("false"), "{why}");
    let reason = r.json()["x_agent_serve"]["reason"].clone();
    assert!(
        reason == "first_turn" || reason == "prefix",
        "{why}: {reason}"
    );
}

#[tokio::test]
async fn a_flood_of_unique_ids_keeps_the_table_bounded_and_recent_sessions_pinned() {
    const LIMIT: usize = 2000;
    let (_sims, gw) = fleet(3, &affinity(&format!("  max_bindings: {LIMIT}\n"))).await;
    let gw = Arc::new(gw);
    let c = client();
    let recent: Vec<String> = (0..5).map(|i| format!("recent-{i}")).collect();
    let mut home = Vec::new();
    for sid in &recent {
        home.push(
            chat(&c, &gw, &[("x-session-id", sid)], &chat_body("m", 0))
                .await
                .backend
                .unwrap(),
        );
    }
    let mut baseline_rss = 0;
    let sem = Arc::new(tokio::sync::Semaphore::new(16));
    // 20 waves of half the limit: 10× the limit in unique ids overall.
    for wave in 0..20 {
        if wave == 10 {
            // Warmed up: the table is full and turning over, allocator pools
            // and connection buffers are at their working size. From here on
            // memory must stay flat; 10,000 more requests leaking even 400
            // bytes each would show.
            baseline_rss = rss_kib(gw.pid());
        }
        let mut tasks = Vec::new();
        for i in 0..LIMIT / 2 {
            let (gw, c, sem) = (Arc::clone(&gw), c.clone(), Arc::clone(&sem));
            tasks.push(tokio::spawn(async move {
                let _p = sem.acquire().await.unwrap();
                let sid = format!("flood-{wave}-{i}");
                chat(
                    &c,
                    &gw,
                    &[("x-session-id", &sid)],
                    &json!({"model": "m", "messages": [], "max_tokens": 1}),
                )
                .await
                .status
            }));
        }
        for t in tasks {
            assert_eq!(t.await.unwrap(), 200, "a full table never fails a request");
        }
        // Recent sessions are used again before the table turns over.
        for (sid, b) in recent.iter().zip(&home) {
            let r = chat(&c, &gw, &[("x-session-id", sid)], &chat_body("m", wave + 1)).await;
            assert_eq!(
                r.hit.as_deref(),
                Some("true"),
                "{sid} lost its binding in wave {wave}"
            );
            assert_eq!(r.backend.as_ref(), Some(b));
        }
        assert!(gw.metric("agentserve_bindings{tier=\"default\"}").await <= LIMIT as f64);
    }
    assert!(
        gw.metric("agentserve_bindings_evicted_total{tier=\"default\"}")
            .await
            >= (9 * LIMIT) as f64
    );
    let growth = rss_kib(gw.pid()).saturating_sub(baseline_rss);
    eprintln!(
        "flood: {} unique ids against max_bindings {LIMIT}: bindings {}, evicted {}, RSS growth {growth} KiB",
        10 * LIMIT,
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        gw.metric("agentserve_bindings_evicted_total{tier=\"default\"}").await
    );
    assert!(
        growth < 4 * 1024,
        "RSS grew {growth} KiB over the last 10,000 requests of a flood of 10× the table limit"
    );
}

/// A gateway in front of one replica slow enough (2 ms a token: a second
/// or more for the prompts of the tests using it) that a request's prefill
/// is seen in progress however busy the machine.
/// `affinity` lines are added to the test fleet's.
async fn one_slow_replica(affinity: &str) -> ([SimBackend; 1], Gateway) {
    let sims = [SimBackend::start(
        "vllm-0",
        &["--prefill-us-per-token", "2000"],
    )];
    let gw = Gateway::start(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        &format!("{FAST_HEALTH}{}{affinity}", affinity_yaml(600)),
    )
    .await;
    (sims, gw)
}

#[tokio::test]
async fn a_new_sessions_first_prompt_counts_without_the_system_prompt_its_backend_keeps() {
    // Without the prefix index (with it, what the index says the backend
    // holds of this very prompt counts instead: tests/prefix.rs).
    let (_sims, gw) = one_slow_replica("  prefix:\n    enabled: false\n").await;
    let c = client();
    let first_turn = |session: &str, body: &Value| {
        c.post(gw.url("/v1/chat/completions"))
            .header("x-session-id", session)
            .json(body)
            .send()
    };
    // Two sessions with the same system prompt: the first is cold, the
    // second finds the system prompt cached, and the gateway learns that.
    let cold = reply(
        first_turn("a", &turn_with_new_text("a", 400))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(cached_tokens(&cold.json()["usage"]), 0);
    let warm = reply(
        first_turn("b", &turn_with_new_text("b", 400))
            .await
            .unwrap(),
    )
    .await;
    let system = cached_tokens(&warm.json()["usage"]);
    assert!(system > 0, "the backend kept the system prompt");
    wait_until("the shared prefix learned", || async {
        gw.learned("vllm-0", "shared_prefix_tokens").await == system
    })
    .await;

    // A third session's first turn counts its body less that prefix while
    // it prefills: what the backend will really compute.
    let body = turn_with_new_text("c", 4000);
    let bytes = serde_json::to_vec(&body).unwrap().len() as u64;
    let turn = tokio::spawn(first_turn("c", &body));
    wait_until(
        "the first turn counted without the system prompt",
        || async { gw.queued_prefill_tokens("vllm-0").await == bytes / 4 - system },
    )
    .await;
    assert_eq!(reply(turn.await.unwrap().unwrap()).await.status, 200);
}

#[tokio::test]
async fn prefill_work_queued_at_a_backend_is_counted_until_its_first_byte() {
    let (_sims, gw) = one_slow_replica("").await;
    let queued = || gw.queued_prefill_tokens("vllm-0");
    assert_eq!(queued().await, 0);
    let c = client();
    let send = |body: &Value| {
        c.post(gw.url("/v1/chat/completions"))
            .header("x-session-id", "queued")
            .json(body)
            .send()
    };

    // Turn 1 binds the session: while it prefills it counts as its prompt
    // (read to place it: its messages without their brackets, a separator
    // after the system message, at 4 bytes a token), and not once its
    // answer has begun.
    let body = turn_with_new_text("q1", 4000);
    let canonical = serde_json::to_vec(&body["messages"]).unwrap().len() as u64 - 1;
    let turn1 = tokio::spawn(send(&body));
    wait_until("turn 1 counted while it prefills", || async {
        queued().await == canonical / 4
    })
    .await;
    let r1 = reply(turn1.await.unwrap().unwrap()).await;
    assert_eq!(r1.status, 200);
    assert_eq!(queued().await, 0, "its first byte ended its prefill");
    let usage = r1.json()["usage"].clone();
    let new1 = uncached(&usage);
    // Its usage is recorded (the token counter follows, in the same hook).
    gw.metric_reaches(
        "agentserve_prompt_tokens_total{backend=\"vllm-0\",tier=\"default\"}",
        usage["prompt_tokens"].as_u64().unwrap() as f64,
    )
    .await;

    // Turn 2 keeps the binding. Turn 1 was the session's first there, so the
    // backend holds its whole prompt: turn 2 counts what its body adds to
    // that prompt, not its whole body, nor turn 1's prefill again.
    let prompt1 = usage["prompt_tokens"].as_u64().unwrap();
    // The transcript grows: turn 1's messages, a reply, a new message.
    let grow = |body: &Value, tag: &str| {
        let mut next = body.clone();
        let added = turn_with_new_text(tag, 2000)["messages"][1].clone();
        let messages = next["messages"].as_array_mut().unwrap();
        messages.push(json!({"role": "assistant", "content": format!("{tag} done")}));
        messages.push(added);
        next
    };
    let body2 = grow(&body, "q2");
    let bytes2 = serde_json::to_vec(&body2).unwrap().len() as u64;
    let growth2 = (bytes2 / 4).saturating_sub(prompt1).min(new1);
    assert!(growth2 > 0 && growth2 < new1, "{growth2} of {new1}");
    let turn2 = tokio::spawn(send(&body2));
    wait_until("turn 2 counted as what it adds", || async {
        queued().await == growth2
    })
    .await;
    let r2 = reply(turn2.await.unwrap().unwrap()).await;
    assert_eq!(r2.status, 200);
    let usage2 = r2.json()["usage"].clone();
    let new2 = uncached(&usage2);
    gw.metric_reaches(
        "agentserve_prompt_tokens_total{backend=\"vllm-0\",tier=\"default\"}",
        (prompt1 + usage2["prompt_tokens"].as_u64().unwrap()) as f64,
    )
    .await;

    // Turn 3 follows a warm turn: it counts that turn's new tokens (the
    // transcript grows by about as much each turn), whatever its body says.
    let body3 = grow(&body2, "q3");
    let bytes3 = serde_json::to_vec(&body3).unwrap().len() as u64;
    assert_ne!(new2, bytes3 / 4);
    let turn3 = tokio::spawn(send(&body3));
    wait_until(
        "turn 3 counted as its session's last new tokens",
        || async { queued().await == new2 },
    )
    .await;
    assert_eq!(reply(turn3.await.unwrap().unwrap()).await.status, 200);

    // A client that leaves mid-prefill leaves nothing counted behind.
    let impatient = reqwest::Client::builder()
        .timeout(std::time::Duration::from_millis(300))
        .build()
        .unwrap();
    let gone = impatient
        .post(gw.url("/v1/chat/completions"))
        .header("x-session-id", "leaver")
        .json(&turn_with_new_text("q4", 4000))
        .send()
        .await;
    assert!(gone.is_err(), "the client gave up first");
    wait_until("nothing left queued", || async { queued().await == 0 }).await;
}
