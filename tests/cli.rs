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

/// A configuration with a key of its own, its `affinity` section first.
const KEYED: &str = "affinity:\n  hash_key: \"5f0c2a9e81d34b7f96a1e0c4d2b8f3a7c6e9d1b04f2a8c7e3d5b9f1a0c6e4d2b\"\ntiers:\n  default:\n    default: true\n    backends:\n      - { id: a, addr: \"127.0.0.1:9001\" }\n";

fn keygen() -> String {
    let out = Command::new(BIN).arg("keygen").output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// The shipped config carries no secret of its own: copied as it is, it is
/// refused and says how to make one; with a key from `keygen` it passes.
#[test]
fn shipped_config_needs_a_key_of_its_own_and_keygen_makes_one() {
    let shipped =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/conf/gateway.yaml")).unwrap();
    let (ok, stderr) = check(&shipped);
    assert!(!ok, "the shipped config passed: {stderr}");
    assert!(
        stderr.contains("affinity.hash_key") && stderr.contains("agent-gateway keygen"),
        "{stderr}"
    );
    let (k1, k2) = (keygen(), keygen());
    assert_ne!(k1, k2);
    assert_eq!(k1.len(), 64, "{k1}");
    let given = shipped.replace(
        "  # hash_key: \"<64 hex digits from agent-gateway keygen>\"",
        &format!("  hash_key: \"{k1}\""),
    );
    assert_ne!(given, shipped);
    let (ok, stderr) = check(&given);
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("hash_key"), "{stderr}");
}

/// `change-me`, a short key, a repeated pattern: refused wherever the key
/// guards what clients are handed (response ids by default; client keys;
/// cache salts); with only placement to guard, a warning.
#[test]
fn check_refuses_a_weak_hash_key() {
    let base = "tiers:\n  default:\n    default: true\n    backends:\n      - { id: a, addr: \"127.0.0.1:9001\" }\n";
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.yaml");
    std::fs::write(&keys, "keys: []\n").unwrap();
    let keys_on = format!("auth: {{ keys_file: \"{}\" }}\n", keys.display());
    for weak in ["change-me", "s3cret", "0123456789abcdef", &"ab".repeat(20)] {
        for extra in ["", keys_on.as_str()] {
            let yaml = format!("{base}affinity: {{ hash_key: \"{weak}\" }}\n{extra}");
            let (ok, stderr) = check(&yaml);
            assert!(!ok, "{weak} passed with {extra:?}");
            assert!(stderr.contains("affinity.hash_key"), "{stderr}");
        }
        let placement_only =
            format!("{base}affinity: {{ hash_key: \"{weak}\", response_ids: engine }}\n");
        let (ok, stderr) = check(&placement_only);
        assert!(ok, "{stderr}");
        assert!(stderr.contains("warning: affinity.hash_key"), "{stderr}");
    }
    let strong = format!(
        "{base}affinity: {{ hash_key: \"{}\" }}\n{keys_on}",
        keygen()
    );
    let (ok, stderr) = check(&strong);
    assert!(ok, "{stderr}");
    // Client keys with the engines' own response ids: refused.
    let engine_ids = format!(
        "{base}affinity: {{ hash_key: \"{}\", response_ids: engine }}\n{keys_on}",
        keygen()
    );
    let (ok, stderr) = check(&engine_ids);
    assert!(!ok && stderr.contains("affinity.response_ids"), "{stderr}");
}

#[test]
fn check_names_the_wrong_key_and_exits_non_zero() {
    let base = KEYED;
    let cases = [
        (format!("{base}bogus: 1\n"), "bogus"),
        (
            base.replace("affinity:\n", "affinity:\n  sticky_ttl: 5\n"),
            "sticky_ttl",
        ),
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
fn check_connect_asks_the_store_and_every_backend_to_answer() {
    let sim = common::SimBackend::start("a", &[]);
    let dir = tempfile::tempdir().unwrap();
    // `check --connect` of KEYED with its backend at `backend` and a store
    // at `port`: whether it passed, and what it said on stderr.
    let run = |backend: &str, port: u16| {
        let path = dir
            .path()
            .join(format!("g{port}-{}.yaml", backend.replace(':', "-")));
        std::fs::write(
            &path,
            KEYED.replace("127.0.0.1:9001", backend).replace(
                "affinity:\n",
                &format!(
                    "affinity:\n  store:\n    kind: redis\n    url: \"redis://127.0.0.1:{port}\"\n"
                ),
            ),
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
    let live = sim.addr.to_string();
    // Nothing listens there: valid configuration, unreachable store.
    let closed = common::free_port();
    let (ok, err) = run(&live, closed);
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
    let (ok, err) = run(&live, closed);
    assert!(ok, "{err}");
    // A backend that does not answer fails the check, by name.
    let (ok, err) = run(&format!("127.0.0.1:{}", common::free_port()), closed);
    let _ = redis.kill();
    let _ = redis.wait();
    assert!(!ok, "{err}");
    assert!(err.contains("error: tier default backend a"), "{err}");
}
