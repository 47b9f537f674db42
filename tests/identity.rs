//! Which conversation a request belongs to, as real clients send it
//! (issue 48): the official Anthropic SDK moving its `cache_control`
//! breakpoint to the newest message each turn, with no session id; and the
//! ids agent clients send of their own (Codex's `session-id`, aiperf's
//! `X-Session-Affinity`, Claude Code's JSON `metadata.user_id`).

mod common;

use common::*;
use serde_json::json;
use std::collections::{HashMap, HashSet};

/// 16 keyless conversations × 4 turns through the Anthropic SDK, a large
/// system prompt every conversation shares: `moving` puts the breakpoint
/// on each turn's newest message (as clients of Anthropic's prompt caching
/// do), else on the system prompt alone; `in_flight` conversations at a
/// time. Lines: conversation, turn, backend, hit, cached tokens.
const CONVERSATIONS: &str = r#"
import sys, anthropic, concurrent.futures
url, moving, in_flight = sys.argv[1], sys.argv[2] == "moving", int(sys.argv[3])
client = anthropic.Anthropic(base_url=url, api_key="sk-ant", max_retries=0)
system = [{"type": "text", "text": "You are a careful coding agent. " * 200,
           "cache_control": {"type": "ephemeral"}}]
def conversation(c):
    lines, messages = [], []
    for turn in range(4):
        messages.append({"role": "user", "content": [{"type": "text",
            "text": f"conversation {c} turn {turn}: " + "look at the failing test " * 40}]})
        if moving:
            for m in messages:
                if isinstance(m["content"], list):
                    for block in m["content"]:
                        block.pop("cache_control", None)
            messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        raw = client.messages.with_raw_response.create(
            model="m", max_tokens=6, system=system, messages=messages)
        msg = raw.parse()
        lines.append(f"{c} {turn} {raw.headers.get('x-agent-serve-backend')} "
                     f"{raw.headers.get('x-agent-serve-affinity-hit')} "
                     f"{msg.usage.cache_read_input_tokens or 0}")
        messages.append({"role": "assistant", "content": [{"type": "text", "text": msg.content[0].text}]})
    return lines
with concurrent.futures.ThreadPoolExecutor(max_workers=in_flight) as pool:
    for lines in pool.map(conversation, range(16)):
        print("\n".join(lines))
"#;

struct Run {
    /// Conversation → its turns' backends.
    backends: HashMap<String, Vec<String>>,
    later_hits: usize,
    cached: u64,
}

async fn conversations(moving: bool, in_flight: usize) -> Run {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let mode = if moving { "moving" } else { "fixed" };
    let url = gw.url("");
    let n = in_flight.to_string();
    let stdout = python(CONVERSATIONS, &[&url, mode, &n]).await;
    let mut run = Run {
        backends: HashMap::new(),
        later_hits: 0,
        cached: 0,
    };
    for line in stdout.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(f.len(), 5, "{line}");
        run.backends
            .entry(f[0].to_string())
            .or_default()
            .push(f[2].to_string());
        if f[1] != "0" {
            run.later_hits += (f[3] == "true") as usize;
            run.cached += f[4].parse::<u64>().unwrap();
        }
    }
    assert_eq!(run.backends.len(), 16, "{stdout}");
    run
}

/// The breakpoint moved to the newest message each turn leaves every
/// conversation on one backend and every later turn a hit, sequentially
/// and 4 at a time, with the cache the unmoved run finds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moving_cache_control_breakpoint_keeps_every_conversation_on_one_backend() {
    for in_flight in [1, 4] {
        let fixed = conversations(false, in_flight).await;
        let moving = conversations(true, in_flight).await;
        for (name, run) in [("fixed", &fixed), ("moving", &moving)] {
            let split: Vec<_> = run
                .backends
                .iter()
                .filter(|(_, b)| b.iter().collect::<HashSet<_>>().len() > 1)
                .collect();
            assert!(split.is_empty(), "{name}, {in_flight} in flight: {split:?}");
            assert_eq!(run.later_hits, 48, "{name}, {in_flight} in flight");
        }
        assert_eq!(
            moving.cached, fixed.cached,
            "{in_flight} in flight: the moved breakpoint finds the cache the fixed one does"
        );
    }
}

/// A client's id, the header it sends it in (none: in its body), and its
/// request's `metadata`.
type Case<'a> = (&'a str, Option<(&'a str, &'a str)>, serde_json::Value);

/// Agent clients' own ids bind their turns: Codex's `session-id`, aiperf's
/// `X-Session-Affinity`, opencode's `x-opencode-session`, Claude Code's
/// `metadata.user_id` (a JSON string naming its `session_id`) — each
/// request named by the client's id, not by its prompt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ids_agent_clients_send_bind_their_sessions() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let c = client();
    let cases: [Case; 4] = [
        ("codex-1", Some(("session-id", "codex-1")), json!({})),
        (
            "aiperf-7",
            Some(("X-Session-Affinity", "aiperf-7")),
            json!({}),
        ),
        ("oc-3", Some(("x-opencode-session", "oc-3")), json!({})),
        (
            "5f0c1a2b-3d4e-4f60-8a9b-0c1d2e3f4a5b",
            None,
            json!({"user_id": json!({"device_id": "d".repeat(64),
                                     "account_uuid": "9b8a7c6d-0000-4000-8000-000000000002",
                                     "session_id": "5f0c1a2b-3d4e-4f60-8a9b-0c1d2e3f4a5b"}).to_string()}),
        ),
    ];
    for (id, header, metadata) in cases {
        let mut homes = HashSet::new();
        for turn in 0..3 {
            // A prompt that shares nothing with the turn before: only the
            // client's id can keep the session together.
            let mut body = json!({"model": "m", "max_tokens": 2,
                "messages": [{"role": "user", "content": format!("{id} {turn} {}", "z".repeat(turn * 97))}]});
            if metadata != json!({}) {
                body["metadata"] = metadata.clone();
            }
            let headers: Vec<(&str, &str)> = header.into_iter().collect();
            let r = chat(&c, &gw, &headers, &body).await;
            assert_eq!(r.status, 200);
            let meta = &r.json()["x_agent_serve"];
            assert_eq!(meta["session"], id, "{meta}");
            if turn > 0 {
                assert_eq!(r.hit.as_deref(), Some("true"), "{id}.{turn}: {meta}");
            }
            homes.insert(r.backend.unwrap());
        }
        assert_eq!(homes.len(), 1, "{id}");
    }
    // The official Anthropic SDK with Claude Code's metadata.
    let script = r#"
import sys, json, anthropic
client = anthropic.Anthropic(base_url=sys.argv[1], api_key="sk-ant", max_retries=0)
user_id = json.dumps({"device_id": "e" * 64, "account_uuid": "1a2b3c4d-0000-4000-8000-000000000003",
                      "session_id": "cc-json-session"})
for turn in range(3):
    raw = client.messages.with_raw_response.create(
        model="m", max_tokens=4, metadata={"user_id": user_id},
        messages=[{"role": "user", "content": f"unrelated prompt {turn}" + "!" * (turn * 50)}])
    print(raw.headers.get("x-agent-serve-affinity-hit"), raw.parse().model_extra.get("x_agent_serve", {}).get("session"))
"#;
    let out = python(script, &[&gw.url("")]).await;
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    for (turn, line) in lines.iter().enumerate() {
        let (hit, session) = line.split_once(' ').unwrap();
        assert_eq!(session, "cc-json-session", "{out}");
        if turn > 0 {
            assert_eq!(hit, "true", "{out}");
        }
    }
}
