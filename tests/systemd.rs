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

    // Valid once given its own key, as the install step says.
    let shipped = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/conf/systemd-gateway.yaml"
    ))
    .unwrap();
    let key = Command::new(common::BIN).arg("keygen").output().unwrap();
    let key = String::from_utf8(key.stdout).unwrap();
    let given = shipped.replace(
        "  # hash_key: \"<64 hex digits from agent-gateway keygen>\"",
        &format!("  hash_key: \"{}\"", key.trim()),
    );
    assert_ne!(given, shipped, "the shipped line to fill in");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("gateway.yaml");
    std::fs::write(&path, given).unwrap();
    let out = Command::new(common::BIN)
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn readiness_and_reloads_are_reported_to_systemd() {
    use std::os::unix::net::UnixDatagram;
    let sim = common::SimBackend::start("vllm-0", &[]);
    let dir = tempfile::tempdir().unwrap();
    let (port, mport) = (common::free_port(), common::free_port_pair());
    let yaml = common::config_yaml(
        port,
        mport,
        dir.path(),
        &[common::tier("default", true, &[], &[&sim])],
        common::FAST_HEALTH,
    );
    let config = dir.path().join("gateway.yaml");
    std::fs::write(&config, common::with_fleet_key(yaml)).unwrap();
    let notify = dir.path().join("notify.sock");
    let sock = UnixDatagram::bind(&notify).unwrap();
    sock.set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    // Killed by PID when the test ends, passing or not.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let child = Killed(
        Command::new(common::BIN)
            .args(["run", "--config"])
            .arg(&config)
            .env("NOTIFY_SOCKET", &notify)
            .env("RUST_LOG", "warn")
            .spawn()
            .unwrap(),
    );
    let recv = || {
        let mut buf = [0u8; 256];
        let n = sock.recv(&mut buf).expect("a notification within 30 s");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    assert_eq!(recv(), "READY=1");
    // READY means every listener accepts already.
    for p in [port, mport, mport + 1] {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", p)).is_ok(),
            "port {p} not listening at READY"
        );
    }
    common::signal(child.0.id(), libc::SIGHUP);
    assert_eq!(recv(), "RELOADING=1");
    assert_eq!(recv(), "READY=1");
}
