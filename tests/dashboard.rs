//! The shipped Grafana dashboard queries only metrics the gateway exports.

use agent_gateway::metrics::Metrics;
use std::collections::HashSet;

#[test]
fn dashboard_queries_use_only_exported_metrics() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/conf/grafana-dashboard.json"
    ))
    .unwrap();
    let dash: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
    let exported: HashSet<String> = Metrics::new().names().into_iter().collect();
    let mut used = HashSet::new();
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            let mut rest = expr;
            while let Some(i) = rest.find("agentserve_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|b| exported.contains(*b)))
                    .unwrap_or(&name)
                    .to_string();
                assert!(
                    exported.contains(&base),
                    "panel `{}` queries unknown metric {name}",
                    panel["title"]
                );
                used.insert(base);
            }
        }
    }
    for required in [
        "agentserve_affinity_hits_total",
        "agentserve_affinity_misses_total",
        "agentserve_affinity_broken_total",
        "agentserve_affinity_moves_total",
        "agentserve_cached_prompt_tokens_total",
        "agentserve_request_duration_seconds",
        "agentserve_backend_healthy",
        "agentserve_bindings",
    ] {
        assert!(
            used.contains(required),
            "the dashboard does not chart {required}"
        );
    }
}
