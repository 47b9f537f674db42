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

#[test]
fn check_connect_asks_the_store_to_answer() {
    let base = "tiers:\n  default:\n    default: true\n    backends:\n      - { id: a, addr: \"127.0.0.1:9001\" }\n";
    let dir = tempfile::tempdir().unwrap();
    let run = |port: u16| {
        let path = dir.path().join(format!("g{port}.yaml"));
        std::fs::write(
            &path,
            format!("{base}affinity:\n  store:\n    kind: redis\n    url: \"redis://127.0.0.1:{port}\"\n"),
        )
        .unwrap();
        let out = Command::new(BIN)
            .args(["check", "--connect", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    // Nothing listens there: valid configuration, unreachable store.
    let closed = common::free_port();
    let (ok, err) = run(closed);
    assert!(!ok, "{err}");
    assert!(err.contains("affinity.store"), "{err}");
    // A real Redis answers.
    let mut redis = Command::new("redis-server")
        .args([
            "--port",
            &closed.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("redis-server is installed (scripts/setup.sh installs it)");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", closed)).is_err() {
        assert!(
            std::time::Instant::now() < deadline,
            "redis-server did not start"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let (ok, err) = run(closed);
    let _ = redis.kill();
    let _ = redis.wait();
    assert!(ok, "{err}");
}
