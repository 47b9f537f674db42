//! The command line: `check` validates and names the wrong key.

mod common;

use common::BIN;
use std::process::Command;

fn check(yaml: &str) -> (bool, String) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("g.yaml");
    std::fs::write(&path, yaml).unwrap();
    let out = Command::new(BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn shipped_config_is_valid_with_a_warning_about_the_hash_key() {
    let out = Command::new(BIN)
        .args([
            "check",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/conf/gateway.yaml"),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("ok (1 tier(s), 2 backend(s))"), "{stdout}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("affinity.hash_key"));
}

#[test]
fn check_names_the_wrong_key_and_exits_non_zero() {
    let base = "tiers:\n  default:\n    default: true\n    backends:\n      - { id: a, addr: \"127.0.0.1:9001\" }\n";
    let cases = [
        (format!("{base}bogus: 1\n"), "bogus"),
        (format!("{base}affinity:\n  sticky_ttl: 5\n"), "sticky_ttl"),
        (
            base.replace("127.0.0.1:9001", "nowhere"),
            "tiers.default.backends[0].addr",
        ),
        (
            format!("{base}      - {{ id: a, addr: \"127.0.0.1:9002\" }}\n"),
            "duplicate backend id `a`",
        ),
        (
            "tiers:\n  default:\n    backends: []\n".to_string(),
            "tiers.default.backends",
        ),
        (
            format!(
                "{base}  second:\n    backends:\n      - {{ id: b, addr: \"127.0.0.1:9003\" }}\n"
            )
            .replace("    default: true\n", ""),
            "no default tier",
        ),
        (format!("{base}health:\n  path: health\n"), "health.path"),
    ];
    for (yaml, expected) in cases {
        let (ok, text) = check(&yaml);
        assert!(!ok, "accepted:\n{yaml}");
        assert!(text.contains(expected), "expected {expected:?} in {text:?}");
    }
    let (ok, text) = check("tiers: [");
    assert!(!ok);
    assert!(text.starts_with("error:"), "{text}");
    let (ok, text) = check(base);
    assert!(ok, "{text}");
}
