//! DNS discovery against a real DNS server: dnsmasq (Debian's package,
//! `scripts/setup.sh` installs it) on 127.0.0.1, answering for simulated
//! replicas on distinct loopback addresses (127.0.0.2, .3, .4). The record set
//! changes as an operator's would: dnsmasq re-reads its hosts file on SIGHUP.

mod common;

use common::*;
use serde_json::Value;
use std::collections::{HashMap, HashSet};
use std::process::{Child, Command, Stdio};

/// dnsmasq on a port of its own, answering from a hosts file only.
struct Dns {
    port: u16,
    hosts: std::path::PathBuf,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Dns {
    /// `hosts`: the hosts file's lines; `srv`: `--srv-host` values.
    async fn start(hosts: &str, srv: &[String]) -> Dns {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("hosts");
        std::fs::write(&file, hosts).unwrap();
        // dnsmasq takes its port for both UDP and TCP; one a parallel test
        // took meanwhile makes it exit: start it again on another.
        for _ in 0..20 {
            let port = free_dns_port();
            let mut cmd = Command::new(dnsmasq());
            cmd.args([
                "--keep-in-foreground",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--listen-address=127.0.0.1",
                "--local-ttl=0",
                "--cache-size=0",
            ])
            .arg(format!("--port={port}"))
            .arg(format!("--addn-hosts={}", file.display()))
            .arg(format!("--pid-file={}", dir.path().join("pid").display()));
            // As root it would read its files as `nobody`, who cannot enter the
            // test's private directory.
            if unsafe { libc::geteuid() } == 0 {
                cmd.arg("--user=root");
            }
            for s in srv {
                cmd.arg(format!("--srv-host={s}"));
            }
            let mut child = cmd
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("dnsmasq (run scripts/setup.sh)");
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
            let answering = loop {
                if answers(port) {
                    break true;
                }
                if child.try_wait().unwrap().is_some() || std::time::Instant::now() > deadline {
                    break false;
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            };
            if answering {
                return Dns {
                    port,
                    hosts: file,
                    child,
                    _dir: dir,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("dnsmasq never answered");
    }

    /// A new record set, as an operator's change would make it.
    fn set_hosts(&self, hosts: &str) {
        std::fs::write(&self.hosts, hosts).unwrap();
        signal(self.child.id(), libc::SIGHUP);
    }
}

impl Drop for Dns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn dnsmasq() -> &'static str {
    ["/usr/sbin/dnsmasq", "/sbin/dnsmasq"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or("dnsmasq")
}

/// A port free for both UDP and TCP on 127.0.0.1 (dnsmasq takes both).
fn free_dns_port() -> u16 {
    loop {
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let port = udp.local_addr().unwrap().port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Whether a DNS server answers a query (for any name) on `port`.
fn answers(port: u16) -> bool {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_millis(200)))
        .unwrap();
    // A query for `x.` type A, class IN.
    let q = [
        0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, b'x', 0, 0, 1, 0, 1,
    ];
    s.send_to(&q, ("127.0.0.1", port)).is_ok() && s.recv(&mut [0u8; 512]).is_ok()
}

/// A port free on each of these loopback addresses.
fn port_free_on(ips: &[&str]) -> u16 {
    loop {
        let port = free_port();
        if ips
            .iter()
            .all(|ip| std::net::TcpListener::bind((*ip, port)).is_ok())
        {
            return port;
        }
    }
}

/// A gateway whose one tier discovers its backends with `discovery`.
async fn gateway(discovery: &str, dns_port: u16) -> Gateway {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let metrics_port = free_port_pair();
    let yaml = format!(
        "server:\n  listen: [\"127.0.0.1:{port}\"]\n  threads: 2\n  pid_file: \"{pid}\"\n  upgrade_sock: \"{sock}\"\n  grace_period_seconds: 0\n  graceful_shutdown_timeout_seconds: 1\n\
         tiers:\n  default:\n    default: true\n    discovery: {discovery}\n\
         metrics:\n  listen: \"127.0.0.1:{metrics_port}\"\nadmin:\n  listen: \"127.0.0.1:{}\"\n\
         {FAST_HEALTH}{}discovery:\n  resolvers: [\"127.0.0.1:{dns_port}\"]\n",
        metrics_port + 1,
        affinity_yaml(1800),
        pid = dir.path().join("gw.pid").display(),
        sock = dir.path().join("upgrade.sock").display(),
    );
    Gateway::start_yaml(dir, port, metrics_port, &yaml).await
}

/// Waits until backend `id` is listed healthy (health-checked, admitted).
async fn healthy(gw: &Gateway, id: &str) {
    wait_until(&format!("{id} to be healthy"), || async {
        gw.admin_backends()
            .await
            .iter()
            .any(|b| b["id"] == id && b["healthy"] == true)
    })
    .await;
}

async fn turn(c: &reqwest::Client, gw: &Gateway, session: &str, n: usize) -> Reply {
    chat(c, gw, &[("x-session-id", session)], &chat_body("m", n)).await
}

#[tokio::test]
async fn a_changed_record_set_keeps_surviving_sessions_moves_the_removed_and_reaches_the_added() {
    let port = port_free_on(&["127.0.0.2", "127.0.0.3", "127.0.0.4"]);
    let sims: Vec<SimBackend> = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
        .iter()
        .map(|ip| SimBackend::start_on(&format!("sim-{ip}"), &format!("{ip}:{port}"), &[]))
        .collect();
    let id = |ip: &str| format!("{ip}:{port}");
    let dns = Dns::start("127.0.0.2 vllm.test\n127.0.0.3 vllm.test\n", &[]).await;
    let gw = gateway(
        &format!("{{ dns: vllm.test, port: {port}, refresh_ms: 200 }}"),
        dns.port,
    )
    .await;
    healthy(&gw, &id("127.0.0.2")).await;
    healthy(&gw, &id("127.0.0.3")).await;
    assert_eq!(
        gw.metric("agentserve_discovery_backends{tier=\"default\"}")
            .await,
        2.0
    );

    let c = client();
    let mut home: HashMap<String, String> = HashMap::new();
    for s in 0..24 {
        let session = format!("dns-{s}");
        let r = turn(&c, &gw, &session, 0).await;
        assert_eq!(r.status, 200);
        home.insert(session, r.backend.unwrap());
    }
    let used: HashSet<&String> = home.values().collect();
    assert_eq!(used.len(), 2, "24 sessions over both addresses: {home:?}");

    // Traffic throughout the change: no request may fail.
    let load = SteadyLoad::start(gw.url(""), 8, true);
    // .2 leaves, .4 joins.
    dns.set_hosts("127.0.0.3 vllm.test\n127.0.0.4 vllm.test\n");
    gw.metric_reaches(
        "agentserve_discovery_refreshes_total{result=\"changed\",tier=\"default\"}",
        1.0,
    )
    .await;
    healthy(&gw, &id("127.0.0.4")).await;
    let listed: HashSet<String> = gw
        .admin_backends()
        .await
        .iter()
        .map(|b| b["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        listed,
        HashSet::from([id("127.0.0.3"), id("127.0.0.4")]),
        "the removed address is gone"
    );

    for (session, was) in &home {
        let r = turn(&c, &gw, session, 1).await;
        assert_eq!(r.status, 200, "{session}");
        let now = r.backend.clone().unwrap();
        if *was == id("127.0.0.3") {
            assert_eq!(&now, was, "{session} stays on the address that stayed");
            assert_eq!(r.hit.as_deref(), Some("true"));
        } else {
            assert_ne!(now, id("127.0.0.2"), "{session} left the removed address");
            assert_eq!(r.json()["x_agent_serve"]["reason"], "broken", "{session}");
        }
    }
    let mut reached_new = 0;
    for s in 0..24 {
        let r = turn(&c, &gw, &format!("new-{s}"), 0).await;
        assert_eq!(r.status, 200);
        assert_ne!(r.backend.as_deref(), Some(id("127.0.0.2").as_str()));
        reached_new += usize::from(r.backend.as_deref() == Some(id("127.0.0.4").as_str()));
    }
    assert!(reached_new > 0, "new sessions reach the added address");
    let (sent, failed, errors) = load.finish().await;
    assert!(sent > 0);
    assert_eq!(failed, 0, "{errors:?}");
    drop(sims);
}

#[tokio::test]
async fn an_empty_answer_keeps_the_last_good_backends_and_says_so() {
    let port = port_free_on(&["127.0.0.2"]);
    let _sim = SimBackend::start_on("sim", &format!("127.0.0.2:{port}"), &[]);
    let dns = Dns::start("127.0.0.2 vllm.test\n", &[]).await;
    let gw = gateway(
        &format!("{{ dns: vllm.test, port: {port}, refresh_ms: 200 }}"),
        dns.port,
    )
    .await;
    healthy(&gw, &format!("127.0.0.2:{port}")).await;
    let stale = "agentserve_discovery_stale{tier=\"default\"}";
    assert_eq!(gw.metric(stale).await, 0.0);
    dns.set_hosts("");
    gw.metric_reaches(stale, 1.0).await;
    let r = turn(&client(), &gw, "kept", 0).await;
    assert_eq!(r.status, 200, "served by the last good set");
    assert_eq!(gw.admin_backends().await.len(), 1);
    // A reload of the file (which lists no backends) keeps them too.
    gw.reload("success", 1.0).await;
    assert_eq!(gw.admin_backends().await.len(), 1);
    let r = turn(&client(), &gw, "kept", 1).await;
    assert_eq!((r.status, r.hit.as_deref()), (200, Some("true")));
    dns.set_hosts("127.0.0.2 vllm.test\n");
    gw.metric_reaches(stale, 0.0).await;
}

#[tokio::test]
async fn srv_records_give_targets_and_their_ports() {
    let (p2, p3) = (port_free_on(&["127.0.0.2"]), port_free_on(&["127.0.0.3"]));
    let _a = SimBackend::start_on("a", &format!("127.0.0.2:{p2}"), &[]);
    let _b = SimBackend::start_on("b", &format!("127.0.0.3:{p3}"), &[]);
    let srv = [
        format!("_http._tcp.vllm.test,a.vllm.test,{p2},0,1"),
        format!("_http._tcp.vllm.test,b.vllm.test,{p3},0,1"),
        // A worse priority: a fallback, not a backend.
        format!("_http._tcp.vllm.test,c.vllm.test,{p3},10,1"),
    ];
    let dns = Dns::start(
        "127.0.0.2 a.vllm.test\n127.0.0.3 b.vllm.test\n127.0.0.4 c.vllm.test\n",
        &srv,
    )
    .await;
    let gw = gateway("{ srv: _http._tcp.vllm.test }", dns.port).await;
    let ids: HashSet<String> = gw
        .admin_backends()
        .await
        .iter()
        .map(|b: &Value| b["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        ids,
        HashSet::from([format!("127.0.0.2:{p2}"), format!("127.0.0.3:{p3}")])
    );
    healthy(&gw, &format!("127.0.0.3:{p3}")).await;
    let r = turn(&client(), &gw, "srv", 0).await;
    assert_eq!(r.status, 200);
}
