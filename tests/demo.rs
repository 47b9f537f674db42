//! `agent-gateway demo --quick`: the one-command study shows what affinity buys.

mod common;

use common::BIN;
use serde_json::Value;
use std::process::Command;

#[test]
fn quick_demo_shows_affinity_paying() {
    let dir = tempfile::tempdir().unwrap();
    let svg = dir.path().join("demo.svg");
    let out = Command::new(BIN)
        .args(["demo", "--quick", "--json", "--svg"])
        .arg(&svg)
        .output()
        .expect("demo runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let reports: Vec<Value> = serde_json::from_slice(&out.stdout).expect("JSON reports");
    let find = |label: &str| {
        reports
            .iter()
            .find(|r| r["label"] == label)
            .unwrap_or_else(|| panic!("no run {label}"))
    };
    let rate = |r: &Value, k: &str| r[k].as_f64().unwrap();

    let on = find("seed: affinity on");
    let off = find("seed: affinity off (fresh ids)");
    assert_eq!(on["requests"], 72);
    assert_eq!(on["errors"], 0);
    assert_eq!(
        rate(on, "affinity_hit_rate"),
        5.0 / 6.0,
        "turn 1 misses, turns 2-6 hit"
    );
    assert_eq!(rate(on, "same_backend_rate"), 1.0);
    assert_eq!(rate(off, "affinity_hit_rate"), 0.0);
    assert!(rate(on, "prefix_cache_hit_rate") > rate(off, "prefix_cache_hit_rate") + 0.05);

    // The same sessions sending no id at all: the gateway names each
    // conversation by its prompt and keeps it on one replica as well.
    for study in ["seed", "long"] {
        let on = find(&format!("{study}: affinity on"));
        let keyless = find(&format!("{study}: no session id (prefix routing)"));
        assert_eq!(keyless["errors"], 0);
        assert_eq!(rate(keyless, "replicas_per_conversation"), 1.0, "{study}");
        assert_eq!(rate(keyless, "same_backend_rate"), 1.0, "{study}");
        assert!(
            rate(keyless, "prefix_cache_hit_rate") >= 0.98 * rate(on, "prefix_cache_hit_rate"),
            "{study}: keyless {} vs keyed {}",
            keyless["prefix_cache_hit_rate"],
            on["prefix_cache_hit_rate"]
        );
    }

    let long_on = find("long: affinity on");
    let long_off = find("long: affinity off (fresh ids)");
    let ideal = find("long: ideal (1 replica, unlimited cache)");
    assert_eq!(rate(long_off, "affinity_hit_rate"), 0.0);
    assert!(
        rate(long_on, "prefix_cache_hit_rate") > rate(long_off, "prefix_cache_hit_rate") + 0.15,
        "on {} vs off {}",
        long_on["prefix_cache_hit_rate"],
        long_off["prefix_cache_hit_rate"]
    );
    // Affinity gets within a few points of one replica that never evicts.
    assert!(rate(ideal, "prefix_cache_hit_rate") - rate(long_on, "prefix_cache_hit_rate") < 0.05);
    // The locality table: turn 1's private document is cold (only the system
    // prompt all sessions share may already be cached, when another session's
    // first turn reached that replica first), later turns mostly cached.
    let rows = long_on["locality"].as_array().unwrap();
    let tokens = |row: &Value, k: &str| row[k].as_u64().unwrap();
    assert!(
        tokens(&rows[0], "cached_tokens") * 2 < tokens(&rows[0], "input_tokens"),
        "turn 1: {}",
        rows[0]
    );
    assert!(tokens(&rows[1], "cached_tokens") * 10 > tokens(&rows[1], "input_tokens") * 9);
    assert!(std::fs::read_to_string(&svg).unwrap().starts_with("<svg"));
}
