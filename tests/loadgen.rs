//! `agent-gateway bench` against a real gateway: synthetic sessions with
//! subagents, and a Mooncake-format trace replayed as token ids.

mod common;

use common::*;
use serde_json::Value;
use std::process::Command;

fn bench(gw: &Gateway, extra: &[&str]) -> Value {
    let out = Command::new(BIN)
        .args(["bench", "--json", "--url", &gw.url("")])
        .args(extra)
        .output()
        .expect("bench runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("JSON report")
}

#[tokio::test]
async fn subagents_share_their_parents_backend() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let r = bench(
        &gw,
        &[
            "--sessions",
            "6",
            "--turns",
            "3",
            "--subagents",
            "3",
            "--subagent-turns",
            "2",
            "-c",
            "8",
        ],
    );
    assert_eq!(r["requests"], 6 * 3 + 6 * 3 * 2);
    assert_eq!(r["errors"], 0);
    assert_eq!(
        r["subagent_colocation"], 1.0,
        "every child turn on its parent's backend"
    );
    // Children of one parent share one group binding: 6 sessions + 6 groups.
    assert_eq!(
        gw.metric("agentserve_bindings{tier=\"default\"}").await,
        12.0
    );
}

#[tokio::test]
async fn mooncake_trace_replays_with_real_prefix_reuse() {
    let (_sims, gw) = fleet(3, &affinity_yaml(1800)).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.jsonl");
    std::fs::write(&path, agent_gateway_tools::loadgen::trace::synthetic(5, 4)).unwrap();
    let p = path.to_str().unwrap();
    let on = bench(&gw, &["--trace", p, "-c", "4", "--id-prefix", "on"]);
    assert_eq!(on["requests"], 20);
    assert_eq!(on["errors"], 0);
    assert_eq!(
        on["affinity_hit_rate"], 0.75,
        "5 sessions × 4 turns: first turns miss"
    );
    let off = bench(
        &gw,
        &["--trace", p, "-c", "4", "--fresh-ids", "--id-prefix", "off"],
    );
    assert_eq!(off["affinity_hit_rate"], 0.0);
    // Sticky sessions reuse every earlier block of their conversation.
    assert!(on["prefix_cache_hit_rate"].as_f64().unwrap() > 0.6, "{on}");
}

#[test]
fn the_shipped_sample_trace_parses() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/conf/traces/mooncake-sample.jsonl"
    ))
    .unwrap();
    let lines = agent_gateway_tools::loadgen::trace::parse(&text).unwrap();
    assert!(lines.len() >= 40);
}
