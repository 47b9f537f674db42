//! Shared test harness: real processes on 127.0.0.1 — simulated vLLM replicas
//! and the gateway binary — started, awaited by readiness checks, and killed
//! by PID when dropped.
#![allow(dead_code)]

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_agent-gateway");

/// Longest any readiness wait may take before the test fails.
const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// A free port whose successor is free too (metrics and admin listeners).
pub fn free_port_pair() -> u16 {
    free_ports(2)
}

pub fn free_port() -> u16 {
    free_ports(1)
}

/// The first of `n` consecutive loopback ports nobody listens on, handed
/// out once per test binary and below the kernel's ephemeral range (32768+
/// on Linux). A port from `bind(0)` is released before the process under
/// test binds it; in that gap an outgoing connection of a test running
/// beside it could take it as its source port (seen: a gateway's admin
/// port "in use", the test refused). Ports counted from here are never
/// handed to two tests of one binary, nor picked as a source port.
fn free_ports(n: u32) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 10_000;
    const SPAN: u32 = 22_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // Test binaries run one after another; start each elsewhere anyway.
    let start = std::process::id().wrapping_mul(7919) % SPAN;
    for _ in 0..SPAN {
        let first = LOW + (start + NEXT.fetch_add(n, Ordering::Relaxed)) % SPAN;
        let mut ports = first..first + n;
        if first + n <= LOW + SPAN
            && ports.all(|p| TcpListener::bind(("127.0.0.1", p as u16)).is_ok())
        {
            return first as u16;
        }
    }
    panic!("no free loopback port below the ephemeral range");
}

/// Poll `cond` until it holds (a readiness check, not a timing assertion).
pub async fn wait_until<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + READY_TIMEOUT;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A simulated replica process.
pub struct SimBackend {
    pub id: String,
    pub addr: SocketAddr,
    /// With `--kv-events`: its publisher's and replay socket's endpoints.
    pub kv: Option<(String, String)>,
    child: Option<Child>,
}

impl SimBackend {
    pub fn start(id: &str, extra: &[&str]) -> SimBackend {
        Self::start_on(id, "127.0.0.1:0", extra)
    }

    pub fn start_on(id: &str, listen: &str, extra: &[&str]) -> SimBackend {
        // Instant replicas with unbounded caches, unless `extra` says otherwise.
        let defaults = [
            ("--prefill-us-per-token", "0"),
            ("--decode-us-per-token", "0"),
            ("--cache-blocks", "0"),
        ];
        let mut child = Command::new(BIN)
            .args(["sim-backend", "--listen", listen, "--id", id])
            .args(
                defaults
                    .iter()
                    .filter(|(flag, _)| !extra.contains(flag))
                    .flat_map(|(flag, v)| [*flag, *v]),
            )
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .env("RUST_LOG", "warn")
            .spawn()
            .expect("spawn sim-backend");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut out = BufReader::new(stdout);
        let mut line = String::new();
        out.read_line(&mut line).expect("sim prints its address");
        let addr = line
            .trim()
            .strip_prefix("listening on ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("unexpected sim output: {line:?}"));
        let kv = extra.contains(&"--kv-events").then(|| {
            let mut line = String::new();
            out.read_line(&mut line)
                .expect("sim prints its events' endpoints");
            let (events, replay) = line
                .trim()
                .strip_prefix("kv events on ")
                .and_then(|l| l.split_once(" replay "))
                .unwrap_or_else(|| panic!("unexpected sim output: {line:?}"));
            (events.to_string(), replay.to_string())
        });
        SimBackend {
            id: id.into(),
            addr,
            kv,
            child: Some(child),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Kill the process (SIGKILL) and wait for it to be gone.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start again on the same address (after `kill`).
    pub fn restart(&mut self, extra: &[&str]) {
        let again = SimBackend::start_on(&self.id, &self.addr.to_string(), extra);
        self.child = again.child_into();
    }

    fn child_into(mut self) -> Option<Child> {
        self.child.take()
    }

    pub async fn stats(&self) -> Value {
        reqwest::get(self.url("/sim/stats"))
            .await
            .expect("sim stats")
            .json()
            .await
            .expect("stats json")
    }

    pub async fn set_faults(&self, faults: Value) {
        let r = reqwest::Client::new()
            .post(self.url("/sim/config"))
            .json(&faults)
            .send()
            .await
            .expect("sim config");
        assert!(r.status().is_success());
    }

    pub async fn release_streams(&self) {
        reqwest::Client::new()
            .post(self.url("/sim/release"))
            .send()
            .await
            .expect("sim release");
    }
}

impl Drop for SimBackend {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The gateway binary running with a generated config.
pub struct Gateway {
    pub port: u16,
    pub metrics_port: u16,
    pub admin_port: u16,
    pub dir: tempfile::TempDir,
    pub config_path: PathBuf,
    child: Option<Child>,
    /// Its config has the admin listener (ready once it accepts too).
    admin: bool,
}

/// A tier for [`config_yaml`]: name, default?, models, backends (id, addr, weight).
pub struct TierSpec<'a> {
    pub name: &'a str,
    pub default: bool,
    pub models: &'a [&'a str],
    pub backends: Vec<(String, SocketAddr, u32)>,
}

pub fn tier<'a>(
    name: &'a str,
    default: bool,
    models: &'a [&'a str],
    sims: &[&SimBackend],
) -> TierSpec<'a> {
    TierSpec {
        name,
        default,
        models,
        backends: sims.iter().map(|s| (s.id.clone(), s.addr, 1)).collect(),
    }
}

pub fn config_yaml(
    port: u16,
    metrics_port: u16,
    dir: &std::path::Path,
    tiers: &[TierSpec],
    extra: &str,
) -> String {
    let mut y = format!(
        "server:\n  listen: [\"127.0.0.1:{port}\"]\n  threads: 2\n  pid_file: \"{pid}\"\n  upgrade_sock: \"{sock}\"\n  grace_period_seconds: 0\n  graceful_shutdown_timeout_seconds: 1\n",
        pid = dir.join("gw.pid").display(),
        sock = dir.join("upgrade.sock").display(),
    );
    y.push_str("tiers:\n");
    for t in tiers {
        y.push_str(&format!(
            "  {}:\n    default: {}\n    models: {:?}\n    backends:\n",
            t.name, t.default, t.models
        ));
        for (id, addr, w) in &t.backends {
            y.push_str(&format!(
                "      - {{ id: \"{id}\", addr: \"{addr}\", weight: {w} }}\n"
            ));
        }
    }
    y.push_str(&format!(
        "metrics:\n  listen: \"127.0.0.1:{metrics_port}\"\nadmin:\n  listen: \"127.0.0.1:{}\"\n",
        metrics_port + 1
    ));
    y.push_str(extra);
    y
}

/// `yaml` with the tests' fleet secret where it names none (a gateway
/// refuses to start without one).
pub fn with_fleet_key(yaml: String) -> String {
    if yaml.contains("hash_key:") {
        yaml
    } else if yaml.starts_with("affinity:\n") || yaml.contains("\naffinity:\n") {
        yaml.replacen(
            "affinity:\n",
            &format!("affinity:\n  hash_key: \"{FLEET_KEY}\"\n"),
            1,
        )
    } else if yaml.contains("affinity: {") {
        yaml.replacen(
            "affinity: {",
            &format!("affinity: {{ hash_key: \"{FLEET_KEY}\","),
            1,
        )
    } else {
        format!("{yaml}affinity:\n  hash_key: \"{FLEET_KEY}\"\n")
    }
}

/// `yaml` (from [`config_yaml`]) with each backend named in `kv` given the
/// `kv_events` beside it (a YAML flow mapping).
pub fn with_kv_events(mut yaml: String, kv: &[(&str, SocketAddr, String)]) -> String {
    for (id, addr, events) in kv {
        let plain = format!("id: \"{id}\", addr: \"{addr}\", weight: 1 }}");
        assert!(yaml.contains(&plain), "backend {id} in the config");
        let with = format!("id: \"{id}\", addr: \"{addr}\", weight: 1, kv_events: {events} }}");
        yaml = yaml.replace(&plain, &with);
    }
    yaml
}

/// A simulated replica's `kv_events` (started with `--kv-events`).
pub fn sim_kv_events(sim: &SimBackend) -> String {
    let (events, replay) = sim.kv.as_ref().expect("started with --kv-events");
    format!("{{ endpoint: \"{events}\", replay: \"{replay}\" }}")
}

/// The tests' `health` section (their `affinity` one is [`affinity_yaml`]).
/// Fast enough for tests to see a backend go down within a second, and two
/// probes in a row must fail: one slow probe on a busy 2-core box must not
/// flip a backend.
pub const FAST_HEALTH: &str =
    "health:\n  path: /health\n  interval_ms: 200\n  timeout_ms: 1000\n  consecutive_failures: 2\n";

/// The fleet secret of the gateways tests start (as `agent-gateway keygen` prints one).
pub const FLEET_KEY: &str = "3d807b9efcf864bb3b1535f793d56dde9a86b6614387f3b0b96f76d94e568b6b";

pub fn affinity_yaml(ttl: u64) -> String {
    format!("affinity:\n  sticky_ttl_seconds: {ttl}\n  hash_key: \"{FLEET_KEY}\"\n")
}

impl Gateway {
    /// Start with the given tiers plus `extra` YAML sections (health, affinity...).
    pub async fn start(tiers: &[TierSpec<'_>], extra: &str) -> Gateway {
        Self::start_with(tiers, |_| String::new(), extra).await
    }

    /// Like [`Gateway::start`], with `server_lines` (indented YAML, a
    /// function of the gateway's own directory) added to the `server` section.
    pub async fn start_with(
        tiers: &[TierSpec<'_>],
        server_lines: impl FnOnce(&std::path::Path) -> String,
        extra: &str,
    ) -> Gateway {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let metrics_port = free_port_pair();
        let yaml = config_yaml(port, metrics_port, dir.path(), tiers, extra).replacen(
            "server:\n",
            &format!("server:\n{}", server_lines(dir.path())),
            1,
        );
        Self::start_yaml(dir, port, metrics_port, &yaml).await
    }

    /// Like [`Gateway::start`], its log written to `gateway.log` in its own
    /// directory (the path returned), for a test that reads what it logged.
    pub async fn start_logging(tiers: &[TierSpec<'_>], extra: &str) -> (Gateway, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let metrics_port = free_port_pair();
        let yaml = config_yaml(port, metrics_port, dir.path(), tiers, extra);
        let log = dir.path().join("gateway.log");
        let gw = Self::start_yaml_logging_to_file(dir, port, metrics_port, &yaml, &log).await;
        (gw, log)
    }

    pub async fn start_yaml(
        dir: tempfile::TempDir,
        port: u16,
        metrics_port: u16,
        yaml: &str,
    ) -> Gateway {
        Self::start_yaml_logging_to(dir, port, metrics_port, yaml, Stdio::inherit()).await
    }

    /// Like [`Gateway::start_yaml`], with the gateway's log written to the
    /// file `log` (made anew), for a test that reads what it logged.
    pub async fn start_yaml_logging_to_file(
        dir: tempfile::TempDir,
        port: u16,
        metrics_port: u16,
        yaml: &str,
        log: &std::path::Path,
    ) -> Gateway {
        let file = std::fs::File::create(log).expect("create the gateway's log file");
        Self::start_yaml_logging_to(dir, port, metrics_port, yaml, Stdio::from(file)).await
    }

    /// Like [`Gateway::start_yaml`], with the gateway's stderr (its log) sent to `stderr`.
    pub async fn start_yaml_logging_to(
        dir: tempfile::TempDir,
        port: u16,
        metrics_port: u16,
        yaml: &str,
        stderr: Stdio,
    ) -> Gateway {
        let config_path = dir.path().join("gateway.yaml");
        std::fs::write(&config_path, with_fleet_key(yaml.to_string())).expect("write config");
        let child = Command::new(BIN)
            .args(["run", "--config"])
            .arg(&config_path)
            .env(
                "RUST_LOG",
                std::env::var("GW_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn gateway");
        let gw = Gateway {
            port,
            metrics_port,
            admin_port: metrics_port + 1,
            dir,
            config_path,
            child: Some(child),
            admin: yaml.contains(&format!("127.0.0.1:{}\"", metrics_port + 1)),
        };
        gw.wait_ready().await;
        gw
    }

    pub async fn wait_ready(&self) {
        let (port, admin) = (self.port, self.admin.then_some(self.admin_port));
        let metrics = self.metrics_url("/healthz");
        wait_until("gateway listeners", || {
            let metrics = metrics.clone();
            async move {
                TcpStream::connect(("127.0.0.1", port)).is_ok()
                    && admin.is_none_or(|a| TcpStream::connect(("127.0.0.1", a)).is_ok())
                    && reqwest::get(&metrics)
                        .await
                        .is_ok_and(|r| r.status().is_success())
            }
        })
        .await;
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.port, path)
    }

    /// `GET /admin/backends`: every backend's entry.
    pub async fn admin_backends(&self) -> Vec<Value> {
        let v: Value = reqwest::get(self.admin_url("/admin/backends"))
            .await
            .expect("admin API")
            .json()
            .await
            .expect("admin JSON");
        v["backends"].as_array().cloned().unwrap_or_default()
    }

    /// The admin entry of backend `id`.
    pub async fn admin_backend(&self, id: &str) -> Value {
        self.admin_backends()
            .await
            .into_iter()
            .find(|b| b["id"] == id)
            .unwrap_or_else(|| panic!("backend {id} listed"))
    }

    /// Backend `id`'s queued prefill tokens as the admin API shows them,
    /// once the admin listener is up (the gateway is ready once its proxy
    /// and metrics listen; the admin listener may come a moment later).
    pub async fn queued_prefill_tokens(&self, id: &str) -> u64 {
        self.learned(id, "queued_prefill_tokens").await
    }

    /// One of backend `id`'s `learned` figures as the admin API shows them,
    /// once the admin listener is up (see `queued_prefill_tokens`).
    pub async fn learned(&self, id: &str, field: &str) -> u64 {
        wait_until("the admin API listens", || async {
            reqwest::get(self.admin_url("/admin/backends"))
                .await
                .is_ok()
        })
        .await;
        self.admin_backend(id).await["learned"][field]
            .as_u64()
            .unwrap_or_else(|| panic!("learned.{field}"))
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.admin_port, path)
    }

    pub fn metrics_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{}", self.metrics_port, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// The value of one metric sample, e.g. `agentserve_affinity_hits_total{tier="default"}`.
    pub async fn metric(&self, sample: &str) -> f64 {
        let text = reqwest::get(self.metrics_url("/metrics"))
            .await
            .expect("scrape")
            .text()
            .await
            .expect("metrics text");
        metric_value(&text, sample)
    }

    /// Waits for `sample` to read `value`: for what the logging hook counts,
    /// which runs after the answer is written (a client can read the metric
    /// before its last request was counted).
    pub async fn metric_reaches(&self, sample: &str, value: f64) {
        let what = format!("{sample} to reach {value}");
        wait_until(&what, || async { self.metric(sample).await == value }).await;
    }

    pub async fn metrics_text(&self) -> String {
        reqwest::get(self.metrics_url("/metrics"))
            .await
            .expect("scrape")
            .text()
            .await
            .expect("metrics text")
    }

    /// Send SIGHUP and wait until `agentserve_config_reload_total{result}`
    /// (`success` or `error`) reaches `count`.
    pub async fn reload(&self, result: &str, count: f64) {
        signal(self.pid(), libc::SIGHUP);
        let sample = format!("agentserve_config_reload_total{{result=\"{result}\"}}");
        wait_until(&format!("reload {result} #{count}"), || async {
            self.metric(&sample).await == count
        })
        .await;
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn take_child(&mut self) -> Option<Child> {
        self.child.take()
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sum of the samples whose name-and-labels text is `sample` (labels given in
/// the order Prometheus prints them), or, for `sample` ending in `{`, every
/// sample of that metric. Absent → 0.
pub fn metric_value(text: &str, sample: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            (name == sample || (sample.ends_with('{') && name.starts_with(sample)))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
        .sum()
}

/// A chat request body like an agent turn.
pub fn chat_body(model: &str, turn: usize) -> Value {
    json!({
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a careful coding agent. ".repeat(20)},
            {"role": "user", "content": format!("turn {turn}: continue")}
        ],
        "max_tokens": 4
    })
}

pub struct Reply {
    pub status: u16,
    pub backend: Option<String>,
    pub sim_backend: Option<String>,
    pub hit: Option<String>,
    pub tier: Option<String>,
    pub headers: reqwest::header::HeaderMap,
    pub body: Vec<u8>,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

/// POST a chat completion with the given headers.
pub async fn chat(
    client: &reqwest::Client,
    gw: &Gateway,
    headers: &[(&str, &str)],
    body: &Value,
) -> Reply {
    let mut req = client.post(gw.url("/v1/chat/completions")).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = req.send().await.expect("request reaches the gateway");
    reply(resp).await
}

/// A chat completion sent in the background with `headers`: its status, once
/// its whole answer is read.
pub fn send_chat(
    gw: &Gateway,
    headers: &[(&str, String)],
    body: &serde_json::Value,
) -> tokio::task::JoinHandle<u16> {
    let mut req = client().post(gw.url("/v1/chat/completions")).json(body);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    tokio::spawn(async move {
        let r = req.send().await.expect("answered");
        let status = r.status().as_u16();
        let _ = r.bytes().await;
        status
    })
}

pub async fn reply(resp: reqwest::Response) -> Reply {
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let h = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let backend = h("x-agent-serve-backend");
    let sim_backend = h("x-sim-backend");
    let hit = h("x-agent-serve-affinity-hit");
    let tier = h("x-agent-serve-tier");
    let body = resp.bytes().await.expect("body").to_vec();
    Reply {
        status,
        backend,
        sim_backend,
        hit,
        tier,
        headers,
        body,
    }
}

/// A client whose requests fail instead of hanging when the gateway misbehaves.
pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(std::time::Duration::from_secs(60))
        .build()
        .expect("client")
}

/// Send a signal to a process we started.
pub fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) with a PID this test spawned.
    let rc = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig})");
}

/// Requests sent and failed by a background load loop.
pub struct SteadyLoad {
    pub stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    pub task: tokio::task::JoinHandle<(u64, u64, Vec<String>)>,
    /// Connection-level errors (no HTTP response at all) that were retried once.
    pub retried: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl SteadyLoad {
    /// Turns of `sessions` sessions, round-robin, until stopped. Each request
    /// uses a fresh connection unless `keepalive`.
    pub fn start(url: String, sessions: usize, keepalive: bool) -> SteadyLoad {
        use std::sync::atomic::{AtomicBool, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let retried = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let retries = retried.clone();
        let task = tokio::spawn(async move {
            let mut b = reqwest::Client::builder().timeout(std::time::Duration::from_secs(30));
            if !keepalive {
                b = b.pool_max_idle_per_host(0);
            }
            let c = b.build().unwrap();
            let (mut sent, mut failed, mut errors) = (0u64, 0u64, Vec::new());
            let mut i = 0usize;
            while !flag.load(Ordering::Relaxed) {
                let sid = format!("load-{}", i % sessions);
                i += 1;
                sent += 1;
                let send = || {
                    c.post(format!("{url}/v1/chat/completions"))
                        .header("x-session-id", sid.as_str())
                        .json(&chat_body("m", i))
                        .send()
                };
                // Like the OpenAI SDKs, retry a request that got no HTTP
                // response at all (the connection was closed under it).
                let r = match send().await {
                    Err(e) if e.is_request() || e.is_connect() => {
                        retries.fetch_add(1, Ordering::Relaxed);
                        send().await
                    }
                    other => other,
                };
                match r {
                    Ok(resp) if resp.status().is_success() => {
                        let _ = resp.bytes().await;
                    }
                    Ok(resp) => {
                        failed += 1;
                        errors.push(format!("status {}", resp.status()));
                    }
                    Err(e) => {
                        failed += 1;
                        errors.push(e.to_string());
                    }
                }
            }
            (sent, failed, errors)
        });
        SteadyLoad {
            stop,
            task,
            retried,
        }
    }

    pub async fn finish(self) -> (u64, u64, Vec<String>) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

/// `n` simulated replicas `vllm-0..n` behind a gateway with one default tier,
/// fast health checks and the extra YAML sections given.
pub async fn fleet(n: usize, extra: &str) -> (Vec<SimBackend>, Gateway) {
    fleet_with(n, &format!("{FAST_HEALTH}{extra}")).await
}

/// Like [`fleet`], with every YAML section after `tiers` given (no default health).
pub async fn fleet_with(n: usize, sections: &str) -> (Vec<SimBackend>, Gateway) {
    fleet_serving(n, "", sections).await
}

/// Like [`fleet_with`], with `server` (indented YAML) added to the `server` section.
pub async fn fleet_serving(n: usize, server: &str, sections: &str) -> (Vec<SimBackend>, Gateway) {
    let sims: Vec<SimBackend> = (0..n)
        .map(|i| SimBackend::start(&format!("vllm-{i}"), &[]))
        .collect();
    let server = server.to_string();
    let gw = Gateway::start_with(
        &[tier("default", true, &[], &sims.iter().collect::<Vec<_>>())],
        move |_| server,
        sections,
    )
    .await;
    (sims, gw)
}

/// Candidates for backends `ids` (slots 0..), seeded as the gateway seeds
/// them with the test fleet's hash key: for computing its HRW choices.
pub fn hrw_candidates(ids: &[&str]) -> Vec<agent_gateway::affinity::Candidate> {
    let h = agent_gateway::affinity::hrw::HrwHasher::new(FLEET_KEY);
    ids.iter()
        .enumerate()
        .map(|(i, id)| agent_gateway::affinity::Candidate {
            slot: i as u32,
            seed: h.backend_seed(id),
            weight: 1,
            ..Default::default()
        })
        .collect()
}

/// A certificate authority the test generates, and leaf certificates it
/// signs, written as PEM files.
pub struct Pki {
    pub ca_pem: String,
    pub ca: rcgen::Certificate,
    ca_key: rcgen::KeyPair,
}

impl Pki {
    pub fn new() -> Pki {
        let mut params = rcgen::CertificateParams::new(vec![]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        // Names of their own: OpenSSL (Redis) takes a leaf whose subject is
        // its issuer's for self-signed.
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "agent-gateway test CA");
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca = params.self_signed(&ca_key).unwrap();
        Pki {
            ca_pem: ca.pem(),
            ca,
            ca_key,
        }
    }

    /// Write a leaf certificate for `name` to dir/name.{pem,key}; returns its DER.
    pub fn leaf(&self, dir: &std::path::Path, name: &str) -> Vec<u8> {
        let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
        std::fs::write(dir.join(format!("{name}.key")), key.serialize_pem()).unwrap();
        cert.der().to_vec()
    }
}

/// A keys file (`auth.keys_file`): each (key, tenant, YAML lines of the
/// entry's limits, indented four spaces).
pub fn keys_file(entries: &[(&str, &str, &str)]) -> String {
    let mut s = String::from("keys:\n");
    for (key, tenant, extra) in entries {
        s += &format!(
            "  - key_sha256: {}\n    tenant: {tenant}\n{extra}",
            agent_gateway::auth::hash_key(key)
        );
    }
    s
}

/// A keys file of `entries` (as [`keys_file`] takes them) in a directory of
/// its own: the directory (keep it) and the file's path.
pub fn write_keys(entries: &[(&str, &str, &str)]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys.yaml");
    std::fs::write(&keys, keys_file(entries)).unwrap();
    (dir, keys)
}

/// One replica behind a gateway that requires client keys: `entries` as
/// [`keys_file`] takes them. The directory holds the keys file.
pub async fn fleet_with_keys(
    entries: &[(&str, &str, &str)],
) -> (tempfile::TempDir, Vec<SimBackend>, Gateway) {
    let (dir, keys) = write_keys(entries);
    let (sims, gw) = fleet(
        1,
        &format!(
            "{}auth:\n  keys_file: \"{}\"\n  required: true\n",
            affinity_yaml(1800),
            keys.display()
        ),
    )
    .await;
    (dir, sims, gw)
}

/// A `redis-server` this test owns (no persistence), killed by PID on drop.
pub struct Redis {
    pub port: u16,
    child: Option<Child>,
}

impl Redis {
    pub fn start_on(port: u16) -> Redis {
        let mut r = Redis::spawn(&["--port", &port.to_string()]);
        r.port = port;
        r.wait_for(|| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
        r
    }

    /// A server listening where `listen` (redis-server options) says.
    pub fn spawn(listen: &[&str]) -> Redis {
        let child = Command::new("redis-server")
            .args(listen)
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server is installed (scripts/setup.sh installs it)");
        Redis {
            port: 0,
            child: Some(child),
        }
    }

    pub fn wait_for(&self, ready: impl Fn() -> bool) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while !ready() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Redis {
    /// What `redis-cli` prints for `args` against this server.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli (installed with redis-server)");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Redis {
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).expect("running")
    }
}

/// Runs `script` with the engine venv's Python (`scripts/setup.sh` installs
/// the SDKs there) and `args` (the gateway's URL first); its stdout.
pub async fn python(script: &str, args: &[&str]) -> String {
    let python = agent_gateway_tools::engine::default_python();
    let out = tokio::process::Command::new(&python)
        .arg("-c")
        .arg(script)
        .args(args)
        .kill_on_drop(true)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{} (run scripts/setup.sh): {e}", python.display()));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "the SDK failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// A streamed answer's body as text, up to its end or to where the
/// connection was cut (a stream ended by the gateway mid-way).
pub async fn read_until_cut(resp: reqwest::Response) -> String {
    use futures_util::StreamExt;
    let mut stream = resp.bytes_stream();
    let mut got = Vec::new();
    while let Some(Ok(chunk)) = stream.next().await {
        got.extend_from_slice(&chunk);
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A POST whose request-target is sent byte for byte (an HTTP client
/// library settles dot segments and escapes first): the status and the
/// body of the answer. `headers`: whole lines, each ending in CRLF.
pub async fn post_raw_path(port: u16, path: &str, headers: &str, body: &str) -> (u16, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n{headers}\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer);
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let body = match head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        // Chunks joined: size lines dropped.
        true => body
            .split("\r\n")
            .enumerate()
            .filter(|(i, _)| i % 2 == 1)
            .map(|(_, c)| c)
            .collect::<String>(),
        false => body.to_string(),
    };
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// The resident memory of process `pid`, in KiB.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| {
            l.strip_prefix("VmRSS:")
                .map(|v| v.trim().trim_end_matches(" kB").trim().parse().unwrap())
        })
        .unwrap()
}
