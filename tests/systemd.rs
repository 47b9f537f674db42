//! The shipped systemd unit passes `systemd-analyze verify`, and the config
//! it points at validates.

mod common;

use std::process::Command;

#[test]
fn unit_verifies_and_its_config_checks() {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/systemd/agent-gateway.service"
    ))
    .unwrap();
    for key in [
        "Type=notify",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "DynamicUser=yes",
        "StateDirectory=agent-gateway",
        "ConfigurationDirectory=agent-gateway",
        "ProtectSystem=strict",
        "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
        "LimitNOFILE=",
    ] {
        assert!(unit.contains(key), "unit lacks {key}");
    }
    // Verify a copy whose binary path exists on this machine.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agent-gateway.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/agent-gateway", common::BIN),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze is installed (scripts/setup.sh installs it)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let problems: Vec<&str> = stderr
        .lines()
        // Lines about other units on this host are not ours to judge.
        .filter(|l| l.contains("agent-gateway.service"))
        .collect();
    assert!(
        out.status.success() && problems.is_empty(),
        "systemd-analyze verify: {stderr}"
    );

    let out = Command::new(common::BIN)
        .args([
            "check",
            "--config",
            concat!(env!("CARGO_MANIFEST_DIR"), "/conf/systemd-gateway.yaml"),
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
