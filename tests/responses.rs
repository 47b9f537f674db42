//! Stateful APIs through the real gateway and simulated replicas that each
//! keep their own responses (as vLLM and SGLang do): a chain by
//! `previous_response_id` reaches the one replica that holds it, through the
//! official OpenAI Python SDK too; a holder that dies ends its chains with a
//! clear error and nothing else; the official Anthropic SDK's Messages
//! conversation stays on one backend, streamed, its usage counted.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::HashSet;

async fn respond(c: &reqwest::Client, gw: &Gateway, body: &Value) -> Reply {
    reply(
        c.post(gw.url("/v1/responses"))
            .json(body)
            .send()
            .await
            .expect("request reaches the gateway"),
    )
    .await
}

/// Turn `turn` of chain `chain`: only the new input, the rest is stored.
fn turn_body(chain: usize, turn: usize, previous: Option<&str>, stream: bool) -> Value {
    let mut body = json!({
        "model": "m",
        "input": format!("chain {chain} turn {turn}: {}", "look at the failing test ".repeat(30)),
        "max_output_tokens": 4,
        "stream": stream,
    });
    if turn == 0 {
        body["instructions"] = json!("You are a careful coding agent. ".repeat(40));
    }
    if let Some(p) = previous {
        body["previous_response_id"] = json!(p);
    }
    body
}

/// The response id of a JSON answer or of a stream's `response.created`.
fn response_id(r: &Reply) -> String {
    if r.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream")
    {
        let text = String::from_utf8_lossy(&r.body);
        let data = text
            .lines()
            .find_map(|l| l.strip_prefix("data: "))
            .expect("an event");
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"], "response.created");
        return v["response"]["id"].as_str().unwrap().to_string();
    }
    r.json()["id"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn chains_by_previous_response_id_reach_the_replica_that_stored_them() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    let chains = 12;
    let mut previous: Vec<Option<String>> = vec![None; chains];
    let mut homes: Vec<HashSet<String>> = vec![HashSet::new(); chains];
    for turn in 0..6 {
        for chain in 0..chains {
            // Half the chains stream.
            let body = turn_body(chain, turn, previous[chain].as_deref(), chain % 2 == 1);
            let r = respond(&c, &gw, &body).await;
            assert_eq!(
                r.status,
                200,
                "{chain}.{turn}: {}",
                String::from_utf8_lossy(&r.body)
            );
            if turn > 0 {
                assert_eq!(r.hit.as_deref(), Some("true"), "{chain}.{turn}");
            }
            homes[chain].insert(r.sim_backend.clone().unwrap());
            previous[chain] = Some(response_id(&r));
        }
    }
    for (chain, h) in homes.iter().enumerate() {
        assert_eq!(h.len(), 1, "chain {chain} on {h:?}");
    }
    let used: HashSet<&String> = homes.iter().flatten().collect();
    assert!(used.len() >= 2, "chains spread over the fleet: {used:?}");
}

#[tokio::test]
async fn a_chain_whose_holder_died_gets_a_clear_error_and_the_others_go_on() {
    let (mut sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    let mut previous: Vec<(String, String)> = Vec::new();
    for chain in 0..9 {
        let r = respond(&c, &gw, &turn_body(chain, 0, None, false)).await;
        assert_eq!(r.status, 200);
        previous.push((response_id(&r), r.sim_backend.unwrap()));
    }
    // The holder of chain 0 dies; health checks take it out.
    let dead = previous[0].1.clone();
    let i = sims.iter().position(|s| s.id == dead).unwrap();
    sims[i].kill();
    wait_until("the dead replica marked down", || async {
        gw.metric(&format!(
            "agentserve_backend_healthy{{backend=\"{dead}\",tier=\"default\"}}"
        ))
        .await
            == 0.0
    })
    .await;
    for (chain, (id, home)) in previous.iter().enumerate() {
        let r = respond(&c, &gw, &turn_body(chain, 1, Some(id), false)).await;
        if *home == dead {
            assert_eq!(r.status, 404, "{}", String::from_utf8_lossy(&r.body));
            let e = &r.json()["error"];
            assert_eq!(e["code"], "previous_response_not_found", "{e}");
            assert_eq!(e["type"], "invalid_request_error");
            assert!(
                e["message"].as_str().unwrap().contains(&dead),
                "says why: {e}"
            );
        } else {
            assert_eq!(r.status, 200, "chain {chain} goes on untouched");
            assert_eq!(r.sim_backend.as_ref(), Some(home));
        }
    }
}

#[tokio::test]
async fn the_official_openai_sdk_chains_six_turns_on_one_backend_with_cached_tokens() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let script = r#"
import sys, openai
client = openai.OpenAI(base_url=sys.argv[1], api_key="sk-sdk", max_retries=0)
prev = None
for turn in range(6):
    r = client.responses.with_raw_response.create(
        model="m",
        instructions="You are a careful coding agent. " * 40 if prev is None else None,
        input=f"turn {turn}: " + "look at the failing test " * 30,
        previous_response_id=prev,
        max_output_tokens=4,
    )
    backend = r.headers.get("x-sim-backend")
    resp = r.parse()
    cached = resp.usage.input_tokens_details.cached_tokens
    print(turn, backend, resp.id, cached, resp.output_text.strip() != "")
    prev = resp.id
"#;
    let stdout = python(script, &[&gw.url("/v1")]).await;
    let turns: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(turns.len(), 6, "{stdout}");
    let backends: HashSet<&str> = turns.iter().map(|t| t[1]).collect();
    assert_eq!(backends.len(), 1, "one backend: {stdout}");
    for t in &turns[1..] {
        let cached: u64 = t[3].parse().unwrap();
        assert!(cached > 0, "cached tokens from turn 2: {stdout}");
        assert_eq!(t[4], "True");
    }
}

#[tokio::test]
async fn the_official_anthropic_sdk_streams_a_conversation_on_one_backend_with_its_usage_counted() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let script = r#"
import sys, anthropic
client = anthropic.Anthropic(base_url=sys.argv[1], api_key="sk-ant", max_retries=0)
system = "You are a careful coding agent. " * 40
messages = []
for turn in range(4):
    messages.append({"role": "user", "content": f"turn {turn}: " + "look at the failing test " * 30})
    with client.messages.stream(model="m", max_tokens=6, system=system, messages=messages,
                                extra_headers={"x-claude-code-session-id": "cc-session-1"}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        backend = stream.response.headers.get("x-agent-serve-backend")
    u = final.usage
    print(turn, backend, u.input_tokens, u.cache_read_input_tokens or 0, u.output_tokens, len(text) > 0)
    messages.append({"role": "assistant", "content": text})
"#;
    let stdout = python(script, &[&gw.url("")]).await;
    let turns: Vec<Vec<&str>> = stdout
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(turns.len(), 4, "{stdout}");
    let backends: HashSet<&str> = turns.iter().map(|t| t[1]).collect();
    assert_eq!(backends.len(), 1, "one backend: {stdout}");
    let (mut input, mut cached) = (0u64, 0u64);
    for t in &turns {
        assert_eq!(t[4], "6", "{stdout}");
        assert_eq!(t[5], "True", "{stdout}");
        input += t[2].parse::<u64>().unwrap();
        cached += t[3].parse::<u64>().unwrap();
    }
    assert!(
        turns[1..].iter().all(|t| t[3] != "0"),
        "warm turns cached: {stdout}"
    );
    // The gateway read the Anthropic usage of the streams: the whole prompt
    // (uncached and cached) and the cached part.
    assert_eq!(
        gw.metric("agentserve_prompt_tokens_total{").await,
        (input + cached) as f64
    );
    assert_eq!(
        gw.metric("agentserve_cached_prompt_tokens_total{").await,
        cached as f64
    );
}

#[tokio::test]
async fn a_conversation_of_the_conversations_api_is_a_session() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    for conv in ["conv_a", "conv_b", "conv_c"] {
        let mut homes = HashSet::new();
        for turn in 0..4 {
            // Each turn alone: nothing in its prompt ties it to the last.
            let body = json!({"model": "m", "conversation": {"id": conv},
                              "input": format!("question {turn} of {conv}")});
            let r = respond(&c, &gw, &body).await;
            assert_eq!(r.status, 200);
            assert_eq!(r.json()["x_agent_serve"]["session"], conv);
            if turn > 0 {
                assert_eq!(r.hit.as_deref(), Some("true"));
            }
            homes.insert(r.sim_backend.unwrap());
        }
        assert_eq!(homes.len(), 1, "{conv}: {homes:?}");
    }
}

/// A key's `tokens_per_minute` is charged from the Responses and Anthropic
/// usage shapes too: a key of 600 tokens a minute gets one request of about
/// 800 through on each API, then 429 on its next.
#[tokio::test]
async fn responses_and_anthropic_usage_count_against_a_keys_token_limit() {
    let limit = "    tokens_per_minute: 600\n";
    let (_dir, _sims, gw) =
        fleet_with_keys(&[("sk-responses", "r", limit), ("sk-messages", "m", limit)]).await;
    let c = client();
    let long = "look at the failing test and fix it ".repeat(80);
    let responses = json!({"model": "m", "input": long, "max_output_tokens": 4});
    let messages = json!({"model": "m", "max_tokens": 4,
                          "messages": [{"role": "user", "content": long}]});
    for (path, key, body) in [
        ("/v1/responses", "sk-responses", &responses),
        ("/v1/messages", "sk-messages", &messages),
    ] {
        let send = || {
            c.post(gw.url(path))
                .header("authorization", format!("Bearer {key}"))
                .json(body)
                .send()
        };
        let first = reply(send().await.unwrap()).await;
        assert_eq!(first.status, 200, "{path}");
        let second = reply(send().await.unwrap()).await;
        assert_eq!(
            second.status,
            429,
            "{path}: {}",
            String::from_utf8_lossy(&second.body)
        );
        assert_eq!(second.json()["error"]["code"], "rate_limit_exceeded");
    }
}

/// Open `/v1/responses` over WebSocket through the gateway, naming `session`;
/// the 101's headers and the socket.
async fn websocket(
    gw: &Gateway,
    session: Option<&str>,
) -> (
    String,
    agent_gateway_tools::ws::Socket<tokio::io::BufReader<tokio::net::TcpStream>>,
) {
    let session = session.map_or(String::new(), |s| format!("x-session-id: {s}\r\n"));
    websocket_with(gw, &session).await
}

/// [`websocket`] with `extra` header lines (each ending in CRLF).
async fn websocket_with(
    gw: &Gateway,
    extra: &str,
) -> (
    String,
    agent_gateway_tools::ws::Socket<tokio::io::BufReader<tokio::net::TcpStream>>,
) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(("127.0.0.1", gw.port))
        .await
        .unwrap();
    let session = extra;
    let head = format!(
        "GET /v1/responses HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\n\
         connection: Upgrade\r\nsec-websocket-version: 13\r\n\
         sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n{session}\r\n"
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    let mut io = tokio::io::BufReader::new(tcp);
    let mut answer = String::new();
    loop {
        let mut line = String::new();
        assert!(io.read_line(&mut line).await.unwrap() > 0, "{answer}");
        answer.push_str(&line.to_ascii_lowercase());
        if line == "\r\n" {
            break;
        }
    }
    assert!(answer.starts_with("http/1.1 101"), "{answer}");
    assert!(
        answer.contains("sec-websocket-accept: s3pplmbitxaq9kygzzhzrbk+xoo="),
        "{answer}"
    );
    (answer, agent_gateway_tools::ws::Socket::client(io))
}

/// The header `name` of a lower-cased response head.
fn head_value<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .map(str::trim)
}

/// One turn over an open socket: `response.create`, then the events up to
/// `response.completed` (panics on an `error` event).
async fn socket_turn(
    socket: &mut agent_gateway_tools::ws::Socket<tokio::io::BufReader<tokio::net::TcpStream>>,
    mut create: Value,
) -> Value {
    create["type"] = json!("response.create");
    socket.send_text(&create.to_string()).await.unwrap();
    let created: Value = serde_json::from_str(&socket.recv_text().await.unwrap().unwrap()).unwrap();
    assert_eq!(created["type"], "response.created", "{created}");
    let done: Value = serde_json::from_str(&socket.recv_text().await.unwrap().unwrap()).unwrap();
    assert_eq!(done["type"], "response.completed");
    done["response"].clone()
}

/// Responses over WebSocket (OpenAI's WebSocket mode): the upgrade is a turn
/// of its session, so the socket reaches the replica holding the session's
/// stored responses and chains on them; each of 6 sessions began over HTTP
/// on one of 3 replicas, and any other replica would answer its first
/// `response.create` with a 404 error event. The session stays usable over
/// HTTP after the socket closes, and the socket's turns are counted in the
/// gateway's token metrics as requests' are.
#[tokio::test]
async fn a_websocket_upgrade_is_pinned_like_a_turn_of_its_session() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    let mut homes = HashSet::new();
    let mut socket_prompt_tokens = 0.0;
    for s in 0..6 {
        let session = format!("ws-{s}");
        let first = reply(
            c.post(gw.url("/v1/responses"))
                .header("x-session-id", &session)
                .json(&turn_body(s, 0, None, false))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(first.status, 200);
        let home = first.backend.clone().unwrap();
        homes.insert(home.clone());
        let (head, mut socket) = websocket(&gw, Some(&session)).await;
        assert_eq!(head_value(&head, "x-agent-serve-backend"), Some(&*home));
        assert_eq!(
            head_value(&head, "x-agent-serve-affinity-hit"),
            Some("true")
        );
        let mut previous = response_id(&first);
        let before = metric_value(&gw.metrics_text().await, "agentserve_prompt_tokens_total{");
        let mut prompt = 0.0;
        for turn in 1..4 {
            let done = socket_turn(&mut socket, turn_body(s, turn, Some(&previous), false)).await;
            assert!(
                done["usage"]["input_tokens_details"]["cached_tokens"]
                    .as_u64()
                    .unwrap()
                    > 0,
                "{s}.{turn}: the stored conversation is cached where it lives"
            );
            prompt += done["usage"]["input_tokens"].as_f64().unwrap();
            previous = done["id"].as_str().unwrap().to_string();
        }
        socket.close().await.unwrap();
        socket_prompt_tokens += prompt;
        wait_until("the socket's usage counted", || async {
            metric_value(&gw.metrics_text().await, "agentserve_prompt_tokens_total{") - before
                == prompt
        })
        .await;
        // The socket's last response lives on the same replica: an HTTP turn
        // of the session chains on it.
        let next = reply(
            c.post(gw.url("/v1/responses"))
                .header("x-session-id", &session)
                .json(&turn_body(s, 4, Some(&previous), false))
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(next.status, 200, "{}", String::from_utf8_lossy(&next.body));
        assert_eq!(next.backend.as_deref(), Some(&*home));
    }
    assert!(homes.len() > 1, "sessions spread: {homes:?}");
    assert!(socket_prompt_tokens > 0.0);
    let m = gw.metrics_text().await;
    assert_eq!(metric_value(&m, "agentserve_websockets_total"), 6.0);
}

/// A socket without a session key: the response ids its events announce are
/// learned, so a keyless HTTP follow-up by `previous_response_id` reaches the
/// replica that stored it (any other would answer 404). A socket may idle past
/// `server.body_idle_timeout_ms` between turns; a message over
/// `server.max_body_bytes` ends it, though the socket's turns together pass it.
#[tokio::test]
async fn a_keyless_socket_teaches_its_response_ids_and_idles_between_turns() {
    let (_sims, gw) = fleet_serving(
        3,
        "  body_idle_timeout_ms: 300\n  max_body_bytes: 2048\n",
        &format!("{FAST_HEALTH}{}", affinity_yaml(1800)),
    )
    .await;
    let c = client();
    for s in 0..6 {
        let (_, mut socket) = websocket(&gw, None).await;
        let mut previous: Option<String> = None;
        for turn in 0..3 {
            if turn == 2 {
                // Longer than the body clock allows a stalled body: a socket
                // between turns is not a stalled body.
                tokio::time::sleep(std::time::Duration::from_millis(700)).await;
            }
            let mut body = turn_body(s, turn, previous.as_deref(), false);
            body.as_object_mut().unwrap().remove("instructions");
            let done = socket_turn(&mut socket, body).await;
            previous = Some(done["id"].as_str().unwrap().to_string());
        }
        let next = respond(&c, &gw, &turn_body(s, 3, previous.as_deref(), false)).await;
        assert_eq!(next.status, 200, "{}", String::from_utf8_lossy(&next.body));
        assert_eq!(next.hit.as_deref(), Some("true"));
        // One message over the limit: the socket is closed on it.
        let mut big = turn_body(s, 4, None, false);
        big["input"] = json!("x".repeat(5000));
        big["type"] = json!("response.create");
        socket.send_text(&big.to_string()).await.unwrap();
        assert_eq!(socket.recv_text().await.ok().flatten(), None);
    }
}

/// A key's limits hold on a WebSocket while it is open: each turn is a
/// request and its usage is charged as it comes back, and a turn over a
/// limit ends the socket (the key's HTTP requests are refused too).
#[tokio::test]
async fn a_sockets_turns_count_against_its_keys_limits_while_it_is_open() {
    let (_dir, _sims, gw) = fleet_with_keys(&[
        ("sk-turns", "turns", "    requests_per_minute: 3\n"),
        ("sk-tokens", "tokens", "    tokens_per_minute: 100\n"),
    ])
    .await;
    let turn = |t: usize| json!({"model": "m", "input": format!("turn {t}: go on"), "max_output_tokens": 4});
    // Three requests a minute: the upgrade and its first turn are one, two
    // more turns pass, the fourth ends the socket.
    let (_, mut socket) = websocket_with(&gw, "authorization: Bearer sk-turns\r\n").await;
    for t in 0..3 {
        socket_turn(&mut socket, turn(t)).await;
    }
    let mut fourth = turn(3);
    fourth["type"] = json!("response.create");
    socket.send_text(&fourth.to_string()).await.unwrap();
    assert_eq!(
        socket.recv_text().await.ok().flatten(),
        None,
        "socket ended"
    );
    // 100 tokens a minute: a turn of about 200 is charged as its usage
    // comes back; the next turn ends the socket.
    let long = json!({"model": "m", "input": "look at the failing test ".repeat(30), "max_output_tokens": 4});
    let (_, mut socket) = websocket_with(&gw, "authorization: Bearer sk-tokens\r\n").await;
    socket_turn(&mut socket, long.clone()).await;
    let mut next = long.clone();
    next["type"] = json!("response.create");
    socket.send_text(&next.to_string()).await.unwrap();
    assert_eq!(
        socket.recv_text().await.ok().flatten(),
        None,
        "socket ended"
    );
    // Both keys are spent for HTTP too.
    for key in ["sk-turns", "sk-tokens"] {
        let r = client()
            .post(gw.url("/v1/responses"))
            .header("authorization", format!("Bearer {key}"))
            .json(&turn(9))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 429, "{key}");
    }
    let rejected = |tenant: &str, limit: &str| {
        format!("agentserve_client_rejected_total{{reason=\"{limit}\",tenant=\"{tenant}\"}}")
    };
    assert!(gw.metric(&rejected("turns", "requests_per_minute")).await >= 2.0);
    assert!(gw.metric(&rejected("tokens", "tokens_per_minute")).await >= 2.0);
}

/// With client keys, a socket's `previous_response_id` that was not issued
/// in its tenant's scope never reaches the replica as it is: another
/// tenant's engine id (read off somewhere, or guessed: the simulator's are
/// `resp_<replica><n>`) is answered as no such response, even on the one
/// replica that holds it; the tenant's own ids chain as ever.
#[tokio::test]
async fn a_socket_cannot_name_another_tenants_stored_response() {
    let (dir, _sims, gw) = fleet_with_keys(&[("sk-a", "acme", ""), ("sk-b", "bravo", "")]).await;
    let first = reply(
        client()
            .post(gw.url("/v1/responses"))
            .header("authorization", "Bearer sk-a")
            .json(&turn_body(0, 0, None, false))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(first.status, 200);
    let ours = response_id(&first);
    // The one replica's first response: acme's, under the engine's own id.
    let engine = "resp_vllm01";
    let (_, mut socket) = websocket_with(&gw, "authorization: Bearer sk-b\r\n").await;
    let mut create = turn_body(0, 1, Some(engine), false);
    create["type"] = json!("response.create");
    socket.send_text(&create.to_string()).await.unwrap();
    let answer: Value = serde_json::from_str(&socket.recv_text().await.unwrap().unwrap()).unwrap();
    assert_eq!(answer["type"], "error", "{answer}");
    // Acme's own socket chains on its id.
    let (_, mut socket) = websocket_with(&gw, "authorization: Bearer sk-a\r\n").await;
    let done = socket_turn(&mut socket, turn_body(0, 1, Some(&ours), false)).await;
    assert!(done["id"].as_str().is_some(), "{done}");
    drop(dir);
}
