//! `agent-gateway demo`: what affinity buys, on a machine with no GPU.
//!
//! Each run starts three fresh simulated vLLM replicas and a gateway in front
//! of them (child processes of this binary, on free 127.0.0.1 ports), replays
//! an agent workload with sticky session ids (affinity on) and with a fresh id
//! per request (what a gateway sees with affinity off), then stops them. The
//! long study also runs against one replica with an unlimited cache: the
//! ideal that affinity approaches. Ctrl-C stops everything cleanly.
//!
//! `--engine llamacpp` runs the same study on real engines instead: three
//! llama.cpp servers (see `engine.rs`), with their own cached-token counts and
//! prefill times, and adds the no-gateway baseline (round robin straight to
//! the replicas). `--engine vllm` runs the agent study on three real vLLM
//! servers (`vllm.rs`), the gateway following their KV-cache events.

use crate::engine::{self, Engine, EngineOptions, ModelShape};
use crate::loadgen::{self, report, BenchArgs};
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// A shorter, faster run (used by the test suite).
    #[arg(long)]
    pub quick: bool,
    /// Where to write the SVG chart.
    #[arg(long, default_value = "agent-gateway-demo.svg")]
    pub svg: PathBuf,
    /// Print the reports as JSON (for scripts) instead of tables.
    #[arg(long)]
    pub json: bool,
    /// The replicas: simulated vLLM (`sim`), real llama.cpp servers (`llamacpp`) or real
    /// vLLM servers, their KV events followed (`vllm`; scripts/engine/vllm-setup.sh).
    #[arg(long, value_enum, default_value_t = EngineKind::Sim)]
    pub engine: EngineKind,
    /// Python with the engine installed (default: scripts/engine/setup.sh's venv).
    #[arg(long)]
    pub engine_python: Option<PathBuf>,
    /// Which studies to run: affinity on vs off, first placement under compute
    /// contention, or both.
    #[arg(long, value_enum, default_value_t = Study::All)]
    pub study: Study,
    /// The placement (and recovery, and trace-soft) study's variants,
    /// `;`-separated; each is a `placement.first` value, optionally with
    /// `,key=value` placement keys or affinity keys (`mode`, `soft_policy`,
    /// `move_hysteresis_ms`, ...; e.g. `bounded_hrw,load=requests,mode=soft`).
    #[arg(long, default_value = DEFAULT_PLACEMENTS)]
    pub placements: String,
    /// Placement, soft, recovery, prefix, keyless and trace studies: run
    /// each variant this many times, each repeat with another population of
    /// session ids (another draw of the hash's lumpiness), and summarise the
    /// means.
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// Soft study: the share of the requests served before replica 0 slows
    /// down 3× (0: slow from the start, so first placement meets it too).
    #[arg(long, default_value_t = 0.25)]
    pub slow_at: f64,
    /// Placement study: replicas prefill concurrently (no compute
    /// contention), to check that load-aware placement costs no cache hits
    /// where balance does not matter.
    #[arg(long)]
    pub no_contention: bool,
    /// The soft study's extra YAML sections (e.g. a `placement:` section).
    #[arg(long, default_value = "")]
    pub soft_placement: String,
    /// llamacpp: sessions per run (default 12; 6 with --quick); soft study: default 48.
    #[arg(long)]
    pub sessions: Option<usize>,
    /// llamacpp: turns per session (default 6; 4 with --quick); soft study: default 8.
    #[arg(long)]
    pub turns: Option<usize>,
    /// llamacpp: requests in flight at once (default 3); soft study: default 12.
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Soft study: each session's pause between turns (an agent's tool time), ms.
    #[arg(long, default_value_t = 0)]
    pub think_ms: u64,
    /// Soft study: sessions start this far apart, ms (0: all at once).
    #[arg(long, default_value_t = 0)]
    pub arrival_ms: u64,
    /// Prefix study: KV blocks (16 tokens) of each replica in its soft-mode
    /// part (default 700: a third of the working set).
    #[arg(long)]
    pub cache_blocks: Option<usize>,
    /// Trace and disturbed studies: the trace's token ids are drawn below
    /// this (151936: Qwen3's vocabulary, most ids six digits).
    #[arg(long, default_value_t = loadgen::trace::DEFAULT_VOCAB)]
    pub trace_vocab: u32,
    /// Placement study: the 64 × 8 workload's per-session document in the
    /// first turn, bytes (default 2000; 0: every turn alike).
    #[arg(long)]
    pub context_bytes: Option<usize>,
}

const DEFAULT_PLACEMENTS: &str = "hrw;round_robin;bounded_hrw";

impl DemoArgs {
    /// The variants `--placements` names, or a study's own `defaults` when
    /// it was not given.
    fn variants_or<'a>(&'a self, defaults: &[&'a str]) -> Vec<&'a str> {
        match self.placements.as_str() {
            DEFAULT_PLACEMENTS => defaults.to_vec(),
            list => list.split(';').filter(|v| !v.is_empty()).collect(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Study {
    Affinity,
    Placement,
    /// Hard vs cost-aware soft affinity with a skewed mix and a slow replica.
    Soft,
    /// A replica taken out at 1/3 of a run and back, empty, at 2/3.
    Recovery,
    /// Prefix-aware routing: conversations without session ids against the
    /// same with ids, a trace replayed both ways, and soft mode under KV
    /// pressure with and without the prefix index.
    Prefix,
    /// Keyless routing on the shapes users send: every conversation with
    /// the same first turn, a trace whose turns re-render the last block of
    /// the one before, engines that report no cached tokens, soft mode on
    /// the trace — each against sticky-by-conversation in the same run.
    Keyless,
    /// A production chat trace's shape (most conversations one turn, one
    /// shared block), keyless against sticky by conversation, re-blocked
    /// and byte-exact, and soft against hard with ids.
    Trace,
    /// The trace study's last table alone: soft against hard with ids.
    TraceSoft,
    /// The chat trace with a third of its conversations opening on one of
    /// 32 shared long documents: keyless and keyed against sticky hashing
    /// that knows nothing of prefixes, re-blocked and byte-exact.
    Documents,
    /// The chat trace on four replicas, one SIGKILLed at a third of the run
    /// with requests in flight and restarted empty at two thirds, sessions
    /// keyed and keyless, against one replica with an unlimited cache.
    Disturbed,
    /// Responses chains by `previous_response_id` over replicas that each
    /// keep their own responses, JSON and streamed, against one replica
    /// alone (which holds every chain).
    Responses,
    All,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum EngineKind {
    Sim,
    Llamacpp,
    /// vLLM's CPU build (`scripts/engine/vllm-setup.sh`), its KV events followed.
    Vllm,
}

/// Real llama.cpp replicas: where their scripts and model live, how they run.
struct RealEngine {
    work: engine::Workdir,
    model: PathBuf,
    opts: EngineOptions,
}

/// The replica latency model used by the demo.
#[derive(Clone, Copy)]
struct Model {
    prefill_us_per_token: f64,
    decode_us_per_token: f64,
    cache_blocks: usize,
    max_batch: usize,
    /// One prefill at a time per replica (compute contention).
    serial_prefill: bool,
    /// Leave cached tokens out of `usage` (vLLM's and SGLang's default).
    no_cache_report: bool,
}

/// Child processes, killed (by PID) when dropped — also on Ctrl-C or panic.
struct Fleet {
    children: Vec<Child>,
    engines: Vec<Engine>,
    gateway_url: String,
    metrics_url: String,
    /// The replicas' base URLs, for the no-gateway baseline.
    backend_urls: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Drop for Fleet {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `N` distinct free ports: the listeners are held until all are picked, so
/// no two are the same (a gateway whose proxy and admin listeners shared one
/// would answer half the proxy's requests from the admin API).
fn free_ports<const N: usize>() -> std::io::Result<[u16; N]> {
    let mut held = Vec::with_capacity(N);
    let mut ports = [0; N];
    for port in &mut ports {
        let l = TcpListener::bind("127.0.0.1:0")?;
        *port = l.local_addr()?.port();
        held.push(l);
    }
    Ok(ports)
}

fn start_sim(exe: &PathBuf, id: &str, m: &Model) -> std::io::Result<(Child, String)> {
    start_sim_on(exe, id, m, "127.0.0.1:0")
}

fn start_sim_on(
    exe: &PathBuf,
    id: &str,
    m: &Model,
    listen: &str,
) -> std::io::Result<(Child, String)> {
    let mut child = Command::new(exe)
        .args(["sim-backend", "--listen", listen, "--id", id])
        .args([
            "--prefill-us-per-token",
            &m.prefill_us_per_token.to_string(),
        ])
        .args(["--decode-us-per-token", &m.decode_us_per_token.to_string()])
        .args(["--cache-blocks", &m.cache_blocks.to_string()])
        .args(["--max-batch", &m.max_batch.to_string()])
        .args(m.serial_prefill.then_some("--serial-prefill"))
        .args(m.no_cache_report.then_some("--no-cache-report"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut line = String::new();
    if let Some(out) = child.stdout.take() {
        BufReader::new(out).read_line(&mut line)?;
    }
    let addr = line
        .trim()
        .strip_prefix("listening on ")
        .map(str::to_string);
    match addr {
        Some(a) => Ok((child, a)),
        None => {
            let _ = child.kill();
            Err(std::io::Error::other(format!("sim-backend said {line:?}")))
        }
    }
}

async fn wait_http(url: &str) -> std::io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let client = reqwest::Client::new();
    while Instant::now() < deadline {
        if client
            .get(url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    Err(std::io::Error::other(format!("{url} never became ready")))
}

async fn start_fleet(
    exe: &PathBuf,
    m: &Model,
    real: Option<&RealEngine>,
    replicas: usize,
    affinity_lines: &str,
    sections: &str,
) -> std::io::Result<Fleet> {
    let dir = tempfile::tempdir()?;
    let mut fleet = Fleet {
        children: Vec::new(),
        engines: Vec::new(),
        gateway_url: String::new(),
        metrics_url: String::new(),
        backend_urls: Vec::new(),
        _dir: dir,
    };
    let mut backends = String::new();
    for i in 0..replicas {
        let (id, addr) = match real {
            Some(r) => {
                let e = Engine::start(&r.work, &r.model, &r.opts)?;
                let addr = e.addr.clone();
                fleet.engines.push(e);
                (format!("llama-{i}"), addr)
            }
            None => {
                let (child, addr) = start_sim(exe, &format!("vllm-{i}"), m)?;
                fleet.children.push(child);
                (format!("vllm-{i}"), addr)
            }
        };
        fleet.backend_urls.push(format!("http://{addr}"));
        backends.push_str(&format!("      - {{ id: {id}, addr: \"{addr}\" }}\n"));
    }
    start_gateway(exe, &mut fleet, &backends, affinity_lines, sections).await?;
    Ok(fleet)
}

/// Start the gateway of `fleet` in front of `backends` (YAML list items).
async fn start_gateway(
    exe: &PathBuf,
    fleet: &mut Fleet,
    backends: &str,
    affinity_lines: &str,
    sections: &str,
) -> std::io::Result<()> {
    let dir_path = fleet._dir.path().to_path_buf();
    // A port picked free can be taken (by another process's outgoing
    // connection) before the gateway binds it: then start again on new ones.
    let mut attempts = 0;
    // `AGW_DEMO_TRACE_DIR`: each gateway started writes its request trace
    // there (`gateway-<n>.jsonl`, numbered as started), for reading a
    // study's turns.
    static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let trace = match std::env::var("AGW_DEMO_TRACE_DIR") {
        Ok(t) => {
            let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            format!("trace:\n  path: \"{t}/gateway-{n:03}.jsonl\"\n")
        }
        Err(_) => String::new(),
    };
    loop {
        attempts += 1;
        let [port, metrics, admin] = free_ports()?;
        let config = format!(
            "{trace}server:\n  listen: [\"127.0.0.1:{port}\"]\n  pid_file: \"{d}/gw.pid\"\n  upgrade_sock: \"{d}/gw.sock\"\n  grace_period_seconds: 0\n  graceful_shutdown_timeout_seconds: 1\n\
             tiers:\n  default:\n    default: true\n    backends:\n{backends}\
             affinity:\n  hash_key: \"d5aa868d7413031d2ed86ac7e0d6ce539975b49551b2c19744205af18145a156\"\n{affinity_lines}health:\n  interval_ms: 500\nmetrics:\n  listen: \"127.0.0.1:{metrics}\"\nadmin:\n  listen: \"127.0.0.1:{admin}\"\n{sections}",
            d = dir_path.display()
        );
        let path = dir_path.join("gateway.yaml");
        std::fs::write(&path, config)?;
        let mut gw = Command::new(exe)
            .args(["run", "--config"])
            .arg(&path)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        fleet.metrics_url = format!("http://127.0.0.1:{metrics}/metrics");
        fleet.gateway_url = format!("http://127.0.0.1:{port}");
        let ready = async {
            wait_http(&format!("http://127.0.0.1:{metrics}/healthz")).await?;
            wait_http(&format!("{}/v1/models", fleet.gateway_url)).await
        };
        match ready.await {
            Ok(()) => {
                fleet.children.push(gw);
                return Ok(());
            }
            Err(e) => {
                let _ = gw.kill();
                let _ = gw.wait();
                if attempts == 3 {
                    return Err(e);
                }
            }
        }
    }
}

async fn study(
    exe: &PathBuf,
    m: &Model,
    real: Option<&RealEngine>,
    base: &BenchArgs,
    name: &str,
    with_ideal: bool,
) -> std::io::Result<Vec<report::Report>> {
    let mut out = Vec::new();
    // (client sends, gateway's affinity lines, straight to the replicas, label)
    let mut runs = vec![
        (Ids::Sticky, "", false, "affinity on"),
        (Ids::None, "", false, "no session id (prefix routing)"),
        // Nothing pins a turn: no id, and no prompt read either.
        (Ids::Fresh, PREFIX_OFF, false, "affinity off (fresh ids)"),
    ];
    if real.is_some() {
        runs.push((Ids::Sticky, "", true, "round robin, no gateway"));
    }
    for (ids, affinity, direct, label) in runs {
        // Fresh replicas for every run: no run inherits another's cache.
        let fleet = start_fleet(exe, m, real, 3, affinity, "").await?;
        let mut a = base.clone();
        a.url = if direct {
            fleet.backend_urls.join(",")
        } else {
            fleet.gateway_url.clone()
        };
        a.fresh_ids = ids == Ids::Fresh;
        a.keyless = ids == Ids::None;
        a.label = format!("{name}: {label}");
        // The same text in every run (each has fresh replicas): a fair comparison.
        a.id_prefix = name.to_string();
        let mut r = loadgen::run(&a).await;
        if !direct {
            r.upstream_retries =
                Some(metric_sum(&fleet.metrics_url, "agentserve_upstream_retries_total{").await);
        }
        out.push(r);
    }
    if with_ideal {
        let unlimited = Model {
            cache_blocks: 0,
            ..*m
        };
        let (mut child, addr) = start_sim(exe, "ideal", &unlimited)?;
        let mut a = base.clone();
        a.url = format!("http://{addr}");
        a.label = format!("{name}: ideal (1 replica, unlimited cache)");
        a.id_prefix = format!("{name}-ideal");
        let r = loadgen::run(&a).await;
        let _ = child.kill();
        let _ = child.wait();
        out.push(r);
    }
    Ok(out)
}

/// The session ids a study's client sends.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ids {
    /// One per session, on every turn.
    Sticky,
    /// A new one on every request.
    Fresh,
    /// None at all: the OpenAI SDKs' default.
    None,
}

/// Affinity lines that turn prefix-aware routing off.
const PREFIX_OFF: &str = "  prefix:\n    enabled: false\n";

/// The sum of a metric's samples (`prefix` is its name and `{`).
async fn metric_sum(metrics_url: &str, prefix: &str) -> u64 {
    let Ok(resp) = reqwest::get(metrics_url).await else {
        return 0;
    };
    let text = resp.text().await.unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Wait until the gateway has served `n` requests (any status), or `bench`
/// has ended (with errors it may never serve that many: the study must still
/// end).
async fn served_at_least<T>(metrics_url: &str, n: u64, bench: &tokio::task::JoinHandle<T>) {
    while !bench.is_finished() && metric_sum(metrics_url, "agentserve_requests_total{").await < n {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Set a simulated replica's fault knobs (`POST /sim/config`).
async fn sim_faults(backend_url: &str, faults: serde_json::Value) {
    let _ = reqwest::Client::new()
        .post(format!("{backend_url}/sim/config"))
        .json(&faults)
        .send()
        .await;
}

pub fn run(args: DemoArgs) -> std::io::Result<()> {
    let exe = std::env::current_exe()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        tokio::select! {
            r = demo(&exe, &args) => r,
            _ = tokio::signal::ctrl_c() => {
                eprintln!("\ninterrupted: stopping the replicas and the gateway");
                Ok(())
            }
        }
    })
}

async fn demo(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<()> {
    if args.engine == EngineKind::Llamacpp {
        return demo_llamacpp(exe, args).await;
    }
    if args.engine == EngineKind::Vllm {
        return demo_vllm(exe, args).await;
    }
    if matches!(
        args.study,
        Study::Placement
            | Study::Soft
            | Study::Recovery
            | Study::Prefix
            | Study::Keyless
            | Study::Trace
            | Study::TraceSoft
            | Study::Documents
            | Study::Disturbed
            | Study::Responses
    ) {
        let started = Instant::now();
        let reports = match args.study {
            Study::Soft => soft_study(exe, args).await?,
            Study::Recovery => recovery_study(exe, args).await?,
            Study::Prefix => prefix_study(exe, args).await?,
            Study::Keyless => keyless_study(exe, args).await?,
            Study::Trace | Study::TraceSoft => trace_study(exe, args).await?,
            Study::Documents => documents_study(exe, args).await?,
            Study::Disturbed => disturbed_study(exe, args).await?,
            Study::Responses => responses_study(exe, args).await?,
            _ => placement_study(exe, args).await?,
        };
        std::fs::write(
            &args.svg,
            report::svg(
                &reports,
                "agent-gateway demo: first placement under contention",
            ),
        )?;
        if args.json {
            println!(
                "{}",
                serde_json::to_string_pretty(&reports).unwrap_or_default()
            );
        } else {
            println!("chart: {}", args.svg.display());
            println!("finished in {:.1} s", started.elapsed().as_secs_f64());
        }
        return Ok(());
    }
    let started = Instant::now();
    let model = if args.quick {
        Model {
            prefill_us_per_token: 20.0,
            decode_us_per_token: 500.0,
            cache_blocks: 1200,
            max_batch: 4,
            serial_prefill: false,
            no_cache_report: false,
        }
    } else {
        Model {
            prefill_us_per_token: 100.0,
            decode_us_per_token: 4000.0,
            cache_blocks: 1200,
            max_batch: 4,
            serial_prefill: false,
            no_cache_report: false,
        }
    };
    // Seed 000's study: 12 sessions × 6 turns at concurrency 6, 3 KB system prompt.
    let seed = BenchArgs::seed_study("");
    // A longer agent: more turns, a private 12 KB document per session.
    let mut long = BenchArgs::seed_study("");
    long.sessions = 8;
    long.turns = if args.quick { 6 } else { 12 };
    long.context_bytes = 12_000;
    long.show_session = 0;

    if !args.json {
        println!("agent-gateway demo: 3 simulated vLLM replicas (prefill {} µs/uncached token, decode {} µs/token, {} KV blocks of 16 tokens each), gateway in front.\n",
            model.prefill_us_per_token, model.decode_us_per_token, model.cache_blocks);
    }
    let seed_reports = study(exe, &model, None, &seed, "seed", false).await?;
    let long_reports = study(exe, &model, None, &long, "long", true).await?;
    let placement_reports = if args.study == Study::All {
        placement_study(exe, args).await?
    } else {
        Vec::new()
    };
    let all: Vec<report::Report> = seed_reports
        .iter()
        .chain(&long_reports)
        .chain(&placement_reports)
        .cloned()
        .collect();
    let svg = report::svg(&all, "agent-gateway demo: affinity on vs off");
    std::fs::write(&args.svg, svg)?;

    if args.json {
        println!("{}", serde_json::to_string_pretty(&all).unwrap_or_default());
        return Ok(());
    }
    println!("\nSeed study (12 sessions × 6 turns, c=6, 3 KB system prompt):\n");
    println!("{}", report::comparison_table(&seed_reports));
    println!("Long study ({} sessions × {} turns, c=6, 3 KB system prompt + 12 KB document per session):\n", long.sessions, long.turns);
    println!("{}", report::comparison_table(&long_reports));
    print_turns(&long_reports[..3]);
    println!("{}", report::COLUMNS);
    println!("chart: {}", args.svg.display());
    println!("finished in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Replicas that contend for compute: prefill runs one request at a time (as
/// on a GPU), decode is batched, the prefix cache is unlimited.
fn contention(args: &DemoArgs) -> Model {
    Model {
        prefill_us_per_token: if args.quick { 25.0 } else { 50.0 },
        decode_us_per_token: 500.0,
        cache_blocks: 0,
        max_batch: 16,
        serial_prefill: true,
        no_cache_report: false,
    }
}

/// A study variant: the gateway's configuration and what its client sends.
struct Variant {
    /// Lines of the `affinity` section.
    affinity: String,
    /// The `placement` section.
    placement: String,
    ids: Ids,
    /// The replicas report no cached tokens (`report=off`).
    no_cache_report: bool,
}

impl Variant {
    /// `first[,key=value...]`: `mode`, `soft_policy` and the cost policy's
    /// `move_hysteresis_ms`, `move_cooldown_ms`, `max_moves_per_session` are
    /// affinity keys,
    /// `prefix=off` turns prefix routing off, `ids=none` sends no session or
    /// parent header and `ids=fresh` a new session id on every request,
    /// `report=off` has the replicas report no cached tokens, the rest are
    /// placement keys (e.g. `bounded_hrw,load=requests,mode=soft`).
    fn parse(variant: &str) -> Variant {
        let mut v = Variant {
            affinity: String::new(),
            placement: String::from("placement:\n"),
            ids: Ids::Sticky,
            no_cache_report: false,
        };
        for kv in variant.split(',').filter(|kv| !kv.is_empty()) {
            let (k, val) = kv.split_once('=').unwrap_or(("first", kv));
            match (k, val) {
                ("ids", "none") => v.ids = Ids::None,
                ("ids", "fresh") => v.ids = Ids::Fresh,
                ("prefix", "off") => v.affinity.push_str(PREFIX_OFF),
                ("report", "off") => v.no_cache_report = true,
                (
                    "mode"
                    | "soft_policy"
                    | "move_hysteresis_ms"
                    | "move_cooldown_ms"
                    | "max_moves_per_session",
                    _,
                ) => v.affinity.push_str(&format!("  {k}: {val}\n")),
                _ => v.placement.push_str(&format!("  {k}: {val}\n")),
            }
        }
        v
    }

    /// `a` as this variant's client sends it.
    fn client(&self, a: &mut BenchArgs) {
        a.keyless = self.ids == Ids::None;
        a.fresh_ids = self.ids == Ids::Fresh;
    }
}

/// First placement when replicas contend for compute: the load-blind HRW of
/// before, the round-robin first request of a sticky-table proxy, and
/// bounded-load HRW. The same workload on fresh replicas for each.
async fn placement_study(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<Vec<report::Report>> {
    let model = Model {
        serial_prefill: !args.no_contention,
        ..contention(args)
    };
    let mut base = BenchArgs::seed_study("");
    base.sessions = 64;
    base.turns = 8;
    base.concurrency = 16;
    base.context_bytes = args.context_bytes.unwrap_or(2000);
    base.user_bytes = 2000;
    let mut sub = BenchArgs::seed_study("");
    sub.sessions = 12;
    sub.turns = 6;
    sub.subagents = 2;
    sub.user_bytes = 2000;
    let variants: Vec<&str> = args
        .placements
        .split(';')
        .filter(|v| !v.is_empty())
        .collect();
    let repeats = args.repeats.max(1);
    let mut out = Vec::new();
    let mut tables = Vec::new();
    for (name, a) in [("64x8 c=16", &base), ("12x6 + 2 subagents", &sub)] {
        // runs[v][r]: variant v, repeat r (another population of session ids).
        let mut runs: Vec<Vec<report::Report>> = vec![Vec::new(); variants.len()];
        for r in 0..repeats {
            for (v, first) in variants.iter().enumerate() {
                let variant = Variant::parse(first);
                let fleet =
                    start_fleet(exe, &model, None, 3, &variant.affinity, &variant.placement)
                        .await?;
                let mut a = a.clone();
                a.url = fleet.gateway_url.clone();
                variant.client(&mut a);
                let setting = match model.serial_prefill {
                    true => "contention",
                    false => "no contention",
                };
                a.label = if repeats > 1 {
                    format!("{setting} {name}: {first} (ids {r})")
                } else {
                    format!("{setting} {name}: {first}")
                };
                a.id_prefix = format!("contention{r}");
                runs[v].push(loadgen::run(&a).await);
            }
        }
        let flat: Vec<report::Report> = runs.iter().flatten().cloned().collect();
        let summary = (repeats > 1).then(|| report::repeats_table(&variants, &runs));
        tables.push((name, report::comparison_table(&flat), summary));
        out.extend(flat);
    }
    if !args.json {
        println!(
            "First placement {} (3 replicas, prefill {} µs/token):\n",
            if model.serial_prefill {
                "under compute contention, serial prefill"
            } else {
                "without contention, concurrent prefill"
            },
            model.prefill_us_per_token
        );
        for (name, t, summary) in tables {
            println!("{name}:\n\n{t}");
            if let Some(summary) = summary {
                println!("{name}, means over {repeats} populations of session ids (ratios against the first variant, per population):\n\n{summary}");
            }
        }
        for r in out.iter().filter(|r| r.subagent_colocation.is_some()) {
            println!(
                "{}: subagent co-location {:.2}",
                r.label,
                r.subagent_colocation.unwrap_or(0.0)
            );
        }
        println!();
    }
    Ok(out)
}

/// Hard affinity against the cost-aware soft policy when one replica of three
/// slows down 3× — by default once every session is placed (a throttled GPU,
/// a noisy neighbour: nothing first placement could have foreseen), with
/// `--slow-at 0` from the start — and a few sessions are much heavier than
/// the rest (compute contention as in the placement study). Moves are read
/// from the gateway.
async fn soft_study(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<Vec<report::Report>> {
    let model = contention(args);
    let mut a = BenchArgs::seed_study("");
    a.sessions = args.sessions.unwrap_or(48);
    a.turns = args.turns.unwrap_or(8);
    a.concurrency = args.concurrency.unwrap_or(12);
    a.context_bytes = 1000;
    a.user_bytes = 1000;
    a.heavy_sessions = 4;
    a.heavy_context_bytes = 24_000;
    a.think_ms = args.think_ms;
    a.arrival_ms = args.arrival_ms;
    let total = (a.sessions * a.turns) as u64;
    let slow_at = args.slow_at.clamp(0.0, 1.0);
    let variants = [
        ("hard", "  mode: hard\n"),
        ("soft (cost)", "  mode: soft\n  soft_policy: cost\n"),
    ];
    let repeats = args.repeats.max(1);
    let mut runs: Vec<Vec<report::Report>> = vec![Vec::new(); variants.len()];
    let mut moves = Vec::new();
    for r in 0..repeats {
        for (v, (label, yaml)) in variants.iter().enumerate() {
            let fleet = start_fleet(exe, &model, None, 3, yaml, &args.soft_placement).await?;
            let mut run = a.clone();
            run.url = fleet.gateway_url.clone();
            run.label =
                format!("replica 0 slowed 3× at {slow_at:.2} + skewed mix: {label} (ids {r})");
            run.id_prefix = format!("soft{r}");
            let slow = || sim_faults(&fleet.backend_urls[0], serde_json::json!({"slowdown": 3.0}));
            if slow_at == 0.0 {
                slow().await;
            }
            let bench = tokio::spawn(async move { loadgen::run(&run).await });
            if slow_at > 0.0 {
                served_at_least(&fleet.metrics_url, (total as f64 * slow_at) as u64, &bench).await;
                slow().await;
            }
            let rep = bench.await.map_err(std::io::Error::other)?;
            moves.push((
                rep.label.clone(),
                metric_sum(&fleet.metrics_url, "agentserve_affinity_moves_total{").await,
            ));
            runs[v].push(rep);
        }
    }
    let out: Vec<report::Report> = runs.iter().flatten().cloned().collect();
    if !args.json {
        println!("Hard vs cost-aware soft affinity (3 replicas, serial prefill; replica 0 slows down 3× once {:.0}% of the requests are served; {} sessions × {} turns at c={}, {} of them with 24 KB documents; {} ms between a session's turns, sessions {} ms apart):\n", slow_at * 100.0, a.sessions, a.turns, a.concurrency, a.heavy_sessions, a.think_ms, a.arrival_ms);
        println!("{}", report::comparison_table(&out));
        if repeats > 1 {
            let names: Vec<&str> = variants.iter().map(|(n, _)| *n).collect();
            println!(
                "Means over {repeats} populations of session ids (ratios against hard, per population):\n\n{}",
                report::repeats_table(&names, &runs)
            );
        }
        for (label, m) in moves {
            println!("{label}: {m} bindings moved");
        }
        println!();
    }
    Ok(out)
}

/// A replica is taken out at a third of the run (health check fails, its
/// requests drain, then SIGKILL) and started again, empty, at two thirds,
/// while sessions keep arriving; replicas' KV caches are bounded. Load-blind
/// HRW against bounded-load HRW.
async fn recovery_study(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<Vec<report::Report>> {
    // Each replica's cache holds its third of the live sessions, not half:
    // while one replica is out the others evict, and how soon that stops
    // after it is back is what placement decides.
    let model = Model {
        cache_blocks: 2000,
        max_batch: 16,
        ..contention(args)
    };
    let mut a = BenchArgs::seed_study("");
    a.sessions = 72;
    a.turns = 12;
    a.concurrency = 16;
    a.context_bytes = 4000;
    a.user_bytes = 500;
    a.arrival_ms = 100;
    a.think_ms = 300;
    let total = (a.sessions * a.turns) as u64;
    let variants = args.variants_or(&["hrw", "bounded_hrw", "bounded_hrw,mode=soft"]);
    let repeats = args.repeats.max(1);
    let mut runs: Vec<Vec<report::Report>> = vec![Vec::new(); variants.len()];
    for r in 0..repeats {
        for (v, first) in variants.iter().enumerate() {
            let variant = Variant::parse(first);
            let mut fleet =
                start_fleet(exe, &model, None, 3, &variant.affinity, &variant.placement).await?;
            let mut run = a.clone();
            run.url = fleet.gateway_url.clone();
            variant.client(&mut run);
            run.label = format!("replica out at 1/3, back empty at 2/3: {first} (ids {r})");
            run.id_prefix = format!("recovery{r}");
            let bench = tokio::spawn(async move { loadgen::run(&run).await });
            served_at_least(&fleet.metrics_url, total / 3, &bench).await;
            // Out of service: health fails, in-flight requests finish, then it dies.
            let victim = fleet.backend_urls[2].clone();
            sim_faults(&victim, serde_json::json!({"unhealthy": true})).await;
            let in_flight = "agentserve_backend_in_flight{backend=\"vllm-2\",tier=\"default\"}";
            let healthy = "agentserve_backend_healthy{backend=\"vllm-2\",tier=\"default\"}";
            while metric_sum(&fleet.metrics_url, healthy).await > 0
                || metric_sum(&fleet.metrics_url, in_flight).await > 0
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = fleet.children[2].kill();
            let _ = fleet.children[2].wait();
            served_at_least(&fleet.metrics_url, 2 * total / 3, &bench).await;
            let listen = victim.trim_start_matches("http://").to_string();
            fleet.children[2] = start_sim_on(exe, "vllm-2", &model, &listen)?.0;
            runs[v].push(bench.await.map_err(std::io::Error::other)?);
        }
    }
    let out: Vec<report::Report> = runs.iter().flatten().cloned().collect();
    if !args.json {
        println!(
            "A replica out at 1/3 of the run and back empty at 2/3 ({} sessions arriving {} ms apart, {} turns {} ms apart, c={}, serial prefill, {} KV blocks per replica):\n",
            a.sessions, a.arrival_ms, a.turns, a.think_ms, a.concurrency, model.cache_blocks
        );
        println!("{}", report::comparison_table(&out));
        if repeats > 1 {
            println!(
                "Means over {repeats} populations of session ids (ratios against the first variant, per population):\n\n{}",
                report::repeats_table(&variants, &runs)
            );
        }
    }
    Ok(out)
}

/// Runs `variants` (as [`variant_yaml`] reads them) of `workload` on fresh
/// replicas each, `repeats` times with other populations of ids and text;
/// `runs[v][r]`, and the moves the gateway made in each. Each repeat starts
/// one variant further on (repeat 1 with the second, ...): a run's place in
/// the sequence must not count for or against its variant (the same
/// configuration run first and third read 0.92× apart in E2E p99 over four
/// repeats on the chat trace).
async fn run_variants(
    exe: &PathBuf,
    model: &Model,
    replicas: usize,
    workload: &BenchArgs,
    name: &str,
    variants: &[&str],
    repeats: usize,
) -> std::io::Result<(Vec<Vec<report::Report>>, Vec<(String, String)>)> {
    let mut runs: Vec<Vec<report::Report>> = vec![Vec::new(); variants.len()];
    let mut moves = Vec::new();
    for r in 0..repeats {
        for v in (0..variants.len()).map(|i| (i + r) % variants.len()) {
            let variant = &variants[v];
            let parsed = Variant::parse(variant);
            let model = Model {
                no_cache_report: parsed.no_cache_report,
                ..*model
            };
            let fleet = start_fleet(
                exe,
                &model,
                None,
                replicas,
                &parsed.affinity,
                &parsed.placement,
            )
            .await?;
            let mut a = workload.clone();
            a.url = fleet.gateway_url.clone();
            parsed.client(&mut a);
            a.label = format!("{name}: {variant} (ids {r})");
            a.id_prefix = format!("{}{r}", name.replace(' ', "-"));
            let mut rep = loadgen::run(&a).await;
            let m = &fleet.metrics_url;
            moves.push((
                rep.label.clone(),
                format!(
                    "{} bindings moved, {} broken, {} misses",
                    metric_sum(m, "agentserve_affinity_moves_total{").await,
                    metric_sum(m, "agentserve_affinity_broken_total{").await,
                    metric_sum(m, "agentserve_affinity_misses_total{").await,
                ),
            ));
            rep.index_corrections = Some(
                metric_sum(
                    &fleet.metrics_url,
                    "agentserve_prefix_index_corrections_total{",
                )
                .await,
            );
            runs[v].push(rep);
        }
    }
    Ok((runs, moves))
}

/// Prefix-aware routing against its baselines, in one run:
/// - conversations that send no session id (`ids=none`) against the same
///   workload with ids, and with a new id every request and prefix routing
///   off (what a gateway that places only by id does for such clients), on
///   the placement study's two workloads with an 8 KiB system prompt every
///   conversation shares;
/// - the Mooncake sample replayed with and without ids, 4 replicas whose KV
///   caches hold a fraction of it;
/// - soft mode under KV pressure (sessions of very different lengths, each
///   replica's cache a fraction of the working set) against hard, with the
///   prefix index and without it (soft mode's expected hit then comes from
///   the last turn's cached share).
async fn prefix_study(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<Vec<report::Report>> {
    let repeats = args.repeats.max(1);
    let model = contention(args);
    let mut chat = BenchArgs::seed_study("");
    chat.sessions = 64;
    chat.turns = 8;
    chat.concurrency = 16;
    chat.system_prompt_bytes = 8192;
    chat.context_bytes = 2000;
    chat.user_bytes = 2000;
    let mut sub = BenchArgs::seed_study("");
    sub.sessions = 12;
    sub.turns = 6;
    sub.subagents = 2;
    sub.system_prompt_bytes = 8192;
    sub.user_bytes = 2000;
    let ids = [
        "bounded_hrw",
        "bounded_hrw,ids=none",
        "bounded_hrw,prefix=off",
        "bounded_hrw,ids=fresh,prefix=off",
    ];
    let mut out = Vec::new();
    let mut tables = Vec::new();
    for (name, workload) in [
        ("64x8 c=16, 8 KiB system prompt", &chat),
        ("12x6 + 2 subagents, 8 KiB system prompt", &sub),
    ] {
        let (runs, _) = run_variants(exe, &model, 3, workload, name, &ids, repeats).await?;
        tables.push((name.to_string(), ids.to_vec(), runs, Vec::new()));
    }
    // The trace: prompts of token ids; each replica's cache holds about a
    // third of what the sample's conversations send (24k tokens).
    let bounded = Model {
        cache_blocks: 1500,
        ..model
    };
    let mut trace = BenchArgs::seed_study("");
    trace.trace = Some(PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../conf/traces/mooncake-sample.jsonl"
    )));
    trace.concurrency = 8;
    let trace_variants = [
        "bounded_hrw",
        "bounded_hrw,ids=none",
        "bounded_hrw,ids=fresh,prefix=off",
    ];
    let (runs, _) = run_variants(
        exe,
        &bounded,
        4,
        &trace,
        "mooncake sample",
        &trace_variants,
        repeats,
    )
    .await?;
    tables.push((
        "Mooncake sample, 4 replicas, 1,500 KV blocks each".into(),
        trace_variants.to_vec(),
        runs,
        Vec::new(),
    ));
    // Soft mode under KV pressure: a skewed mix whose working set is about
    // three times what the replicas' caches hold together.
    let mut skewed = BenchArgs::seed_study("");
    skewed.sessions = 36;
    skewed.turns = 8;
    skewed.concurrency = 12;
    skewed.context_bytes = 4000;
    skewed.user_bytes = 1000;
    skewed.heavy_sessions = 6;
    skewed.heavy_context_bytes = 24_000;
    skewed.think_ms = 200;
    skewed.arrival_ms = 50;
    let pressure = Model {
        cache_blocks: args.cache_blocks.unwrap_or(700),
        ..model
    };
    let soft = [
        "bounded_hrw",
        "bounded_hrw,mode=soft",
        "bounded_hrw,mode=soft,prefix=off",
    ];
    let (runs, moves) =
        run_variants(exe, &pressure, 3, &skewed, "KV pressure", &soft, repeats).await?;
    tables.push((
        format!(
            "Soft mode under KV pressure (36 sessions, 6 heavy; {} KV blocks a replica)",
            pressure.cache_blocks
        ),
        soft.to_vec(),
        runs,
        moves,
    ));
    for (name, variants, runs, moves) in tables {
        let flat: Vec<report::Report> = runs.iter().flatten().cloned().collect();
        if !args.json {
            println!("{name}:\n\n{}", report::comparison_table(&flat));
            println!("means over {repeats} population(s) (ratios against the first variant, per population):\n\n{}", report::repeats_table(&variants, &runs));
            for (label, m) in moves {
                println!("{label}: {m}");
            }
            println!();
        }
        out.extend(flat);
    }
    Ok(out)
}

/// The replicas and the workload of the chat-trace studies: bounded KV
/// (`--cache-blocks`, 20,000 by default), serial prefill at 4 µs a token,
/// the trace's conversations (400 with `--quick`) in its order at c=16.
fn chat_trace(args: &DemoArgs) -> (Model, BenchArgs) {
    let model = Model {
        prefill_us_per_token: 4.0,
        decode_us_per_token: 500.0,
        cache_blocks: args.cache_blocks.unwrap_or(20_000),
        max_batch: 16,
        serial_prefill: true,
        no_cache_report: false,
    };
    let mut trace = BenchArgs::seed_study("");
    trace.trace_synthetic = Some(if args.quick { 400 } else { 1895 });
    trace.trace_shape = loadgen::TraceShape::Conversation;
    trace.trace_ordered = true;
    trace.concurrency = 16;
    trace.trace_vocab = args.trace_vocab;
    (model, trace)
}

/// A production chat trace's shape ([`loadgen::trace::conversation_like`]:
/// 1,895 conversations, 1,395 of them one turn, every prompt opening with
/// the same 512-token block), sent in the trace's order at c=16 to 4
/// replicas with bounded KV (serial prefill at 4 µs a token):
/// - keyless against sticky by conversation, a turn's partial last block
///   re-ided in the next, and byte-exact;
/// - soft mode against hard, with ids, on the re-blocked trace.
async fn trace_study(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<Vec<report::Report>> {
    let repeats = args.repeats.max(1);
    let (model, mut trace) = chat_trace(args);
    let mut tables: Vec<Table> = Vec::new();
    let pair = ["bounded_hrw", "bounded_hrw,ids=none"];
    if args.study != Study::TraceSoft {
        tables.extend(
            reblocked_and_byte_exact(
                exe,
                &model,
                &mut trace,
                ("chat trace", "chat trace"),
                &pair,
                repeats,
            )
            .await?,
        );
    }
    trace.trace_reblock = true;
    let soft = args.variants_or(&["bounded_hrw", "bounded_hrw,mode=soft"]);
    let (runs, moves) =
        run_variants(exe, &model, 4, &trace, "chat trace soft", &soft, repeats).await?;
    tables.push((
        "soft mode on the re-blocked chat trace (session ids)".into(),
        soft.to_vec(),
        runs,
    ));
    let out = keyless_tables(tables, args.json);
    if !args.json {
        for (label, m) in moves {
            println!("{label}: {m}");
        }
    }
    Ok(out)
}

/// The chat trace's replicas and shape, a third of its conversations
/// opening on one of 32 shared 4,096-token documents
/// ([`loadgen::trace::documents_like`]): keyed and keyless, each placing a
/// new conversation where its opening is cached unless that replica is over
/// the balance bound, against keyed without the prefix index (sticky
/// hashing: a conversation's replica by its id alone), re-blocked and
/// byte-exact.
async fn documents_study(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<Vec<report::Report>> {
    let (model, mut trace) = chat_trace(args);
    trace.trace_shape = loadgen::TraceShape::Documents;
    let variants = args.variants_or(&[
        "bounded_hrw",
        "bounded_hrw,ids=none",
        "bounded_hrw,prefix=off",
    ]);
    let tables = reblocked_and_byte_exact(
        exe,
        &model,
        &mut trace,
        ("chat trace opening on shared documents", "documents"),
        &variants,
        args.repeats.max(1),
    )
    .await?;
    let out = keyless_tables(tables, args.json);
    Ok(out)
}

/// The chat trace (`trace_study`'s) on four replicas, keyed and keyless:
/// at a third of its requests one replica is SIGKILLed (no warning: the
/// requests it holds die with it), at two thirds it is started again, empty,
/// on its address; against one replica with an unlimited cache running the
/// same trace (the pooled ideal: nothing is ever lost or split).
async fn disturbed_study(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<Vec<report::Report>> {
    let (model, trace) = chat_trace(args);
    let total = loadgen::trace::conversation_like(
        trace.trace_synthetic.unwrap_or(0),
        trace.trace_seed,
        trace.trace_reblock,
    )
    .lines()
    .filter(|l| !l.trim().is_empty())
    .count() as u64;
    let variants = args.variants_or(&["bounded_hrw", "bounded_hrw,ids=none"]);
    let mut out = Vec::new();
    // The first variant undisturbed too: what the kill and restart cost.
    let runs = std::iter::once((variants[0], false)).chain(variants.iter().map(|v| (*v, true)));
    for (first, disturbed) in runs {
        let variant = Variant::parse(first);
        let mut fleet =
            start_fleet(exe, &model, None, 4, &variant.affinity, &variant.placement).await?;
        let mut run = trace.clone();
        run.url = fleet.gateway_url.clone();
        variant.client(&mut run);
        run.label = match disturbed {
            true => format!("replica killed at 1/3, back empty at 2/3: {first}"),
            false => format!("undisturbed: {first}"),
        };
        run.id_prefix = "disturbed".into();
        let bench = tokio::spawn(async move { loadgen::run(&run).await });
        if !disturbed {
            out.push(bench.await.map_err(std::io::Error::other)?);
            continue;
        }
        served_at_least(&fleet.metrics_url, total / 3, &bench).await;
        let victim = fleet.backend_urls[3].clone();
        let _ = fleet.children[3].kill();
        let _ = fleet.children[3].wait();
        served_at_least(&fleet.metrics_url, 2 * total / 3, &bench).await;
        let listen = victim.trim_start_matches("http://").to_string();
        fleet.children[3] = start_sim_on(exe, "vllm-3", &model, &listen)?.0;
        let mut r = bench.await.map_err(std::io::Error::other)?;
        r.upstream_retries =
            Some(metric_sum(&fleet.metrics_url, "agentserve_upstream_retries_total{").await);
        out.push(r);
    }
    let unlimited = Model {
        cache_blocks: 0,
        ..model
    };
    let (mut child, addr) = start_sim(exe, "ideal", &unlimited)?;
    let mut a = trace.clone();
    a.url = format!("http://{addr}");
    a.label = "ideal (1 replica, unlimited cache, undisturbed)".into();
    a.id_prefix = "disturbed".into();
    out.push(loadgen::run(&a).await);
    let _ = child.kill();
    let _ = child.wait();
    if !args.json {
        println!(
            "The chat trace ({total} requests) on 4 replicas, one SIGKILLed at 1/3 and back empty at 2/3, against the pooled ideal:\n"
        );
        println!("{}", report::comparison_table(&out));
    }
    Ok(out)
}

/// A study's table: its name, its variants, and each variant's runs.
type Table<'a> = (String, Vec<&'a str>, Vec<Vec<report::Report>>);

/// Print each table (unless `json`) with its variants against the first,
/// and give back every run's report.
fn keyless_tables(tables: Vec<Table>, json: bool) -> Vec<report::Report> {
    let mut out = Vec::new();
    for (name, variants, runs) in tables {
        if !json {
            println!("{name}:\n\n{}", report::keyless_table(&variants, &runs));
        }
        out.extend(runs.into_iter().flatten());
    }
    out
}

/// `variants` on `trace` over 4 replicas, twice: with each turn's partial
/// last block given new ids in the next, then with each turn extending the
/// one before byte for byte. `what` names the trace in the tables' names,
/// `label` in the runs'.
async fn reblocked_and_byte_exact<'a>(
    exe: &PathBuf,
    model: &Model,
    trace: &mut BenchArgs,
    (what, label): (&str, &str),
    variants: &[&'a str],
    repeats: usize,
) -> std::io::Result<Vec<Table<'a>>> {
    let mut tables = Vec::new();
    for reblock in [true, false] {
        trace.trace_reblock = reblock;
        let name = format!(
            "{what} ({} conversations, 4 replicas, {} KV blocks each), {}",
            trace.trace_synthetic.unwrap_or(0),
            model.cache_blocks,
            if reblock {
                "a turn's partial last block re-ided in the next"
            } else {
                "each turn extending the one before byte for byte"
            }
        );
        let (runs, _) = run_variants(exe, model, 4, trace, label, variants, repeats).await?;
        tables.push((name, variants.to_vec(), runs));
    }
    Ok(tables)
}

/// Keyless routing on the shapes users send, each against sticky by
/// conversation (the same workload with a session id, bounded HRW) in the
/// same run, on fresh replicas each:
/// - identical openings: 64 conversations × 8 turns at c=16, serial prefill,
///   one 8 KiB system prompt and one 48-token first message for all;
/// - a generated Mooncake-style trace (token-id completions, 4 replicas with
///   bounded KV, serial prefill at 20 µs a token) whose turns give the
///   partial last block of the turn before new ids, and its byte-exact twin;
/// - engines that report no cached tokens: the agent workload and the trace
///   without reports, against the same with reports (the hit the engines
///   saw, from their own count);
/// - soft mode on the re-blocked trace, with ids, against hard mode.
async fn keyless_study(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<Vec<report::Report>> {
    let repeats = args.repeats.max(1);
    let mut tables: Vec<Table> = Vec::new();
    // Identical openings, then a document of each conversation's own and
    // caches that hold about two thirds of the working set: a turn sent
    // away from its conversation recomputes that document.
    let model = Model {
        cache_blocks: args.cache_blocks.unwrap_or(2000),
        ..contention(args)
    };
    let mut opening = BenchArgs::seed_study("");
    opening.sessions = if args.quick { 24 } else { 64 };
    opening.turns = if args.quick { 4 } else { 8 };
    opening.concurrency = 16;
    opening.system_prompt_bytes = 8192;
    opening.user_bytes = 200;
    opening.context_bytes = 4000;
    opening.same_opening = true;
    let pair = ["bounded_hrw", "bounded_hrw,ids=none"];
    let name = format!(
        "identical openings: {}x{} c=16, one 8 KiB system prompt and first message, then a 4 KB document each ({} KV blocks a replica)",
        opening.sessions, opening.turns, model.cache_blocks
    );
    let (runs, _) = run_variants(exe, &model, 3, &opening, "same opening", &pair, repeats).await?;
    tables.push((name, pair.to_vec(), runs));
    // The trace, re-blocked and byte-exact.
    let trace_model = Model {
        prefill_us_per_token: 20.0,
        decode_us_per_token: 500.0,
        cache_blocks: args.cache_blocks.unwrap_or(4000),
        max_batch: 16,
        serial_prefill: true,
        no_cache_report: false,
    };
    let mut trace = BenchArgs::seed_study("");
    trace.trace_synthetic = Some(if args.quick { 60 } else { 300 });
    trace.concurrency = 16;
    tables.extend(
        reblocked_and_byte_exact(
            exe,
            &trace_model,
            &mut trace,
            ("Mooncake-style trace", "trace"),
            &pair,
            repeats,
        )
        .await?,
    );
    // Engines that report no cached tokens.
    let mut agent = BenchArgs::seed_study("");
    agent.sessions = if args.quick { 24 } else { 64 };
    agent.turns = 8;
    agent.concurrency = 16;
    agent.system_prompt_bytes = 8192;
    agent.context_bytes = 2000;
    agent.user_bytes = 2000;
    let reports = [
        "bounded_hrw",
        "bounded_hrw,ids=none",
        "bounded_hrw,ids=none,report=off",
    ];
    let pressure = Model {
        cache_blocks: args.cache_blocks.unwrap_or(2500),
        ..model
    };
    let (runs, _) =
        run_variants(exe, &pressure, 3, &agent, "no reports", &reports, repeats).await?;
    tables.push((
        format!(
            "engines without cached-token reports: the agent workload ({}x8, {} KV blocks a replica)",
            agent.sessions, pressure.cache_blocks
        ),
        reports.to_vec(),
        runs,
    ));
    trace.trace_reblock = true;
    let (runs, _) = run_variants(
        exe,
        &trace_model,
        4,
        &trace,
        "trace no reports",
        &reports,
        repeats,
    )
    .await?;
    tables.push((
        "engines without cached-token reports: the re-blocked trace".into(),
        reports.to_vec(),
        runs,
    ));
    // Soft mode on trace-shaped work, with ids.
    let soft = ["bounded_hrw", "bounded_hrw,mode=soft"];
    let (runs, _) =
        run_variants(exe, &trace_model, 4, &trace, "trace soft", &soft, repeats).await?;
    tables.push((
        "soft mode on the re-blocked trace (session ids)".into(),
        soft.to_vec(),
        runs,
    ));
    let out = keyless_tables(tables, args.json);
    Ok(out)
}

/// Responses chains: 24 conversations x 6 turns at c=6 (`--sessions`,
/// `--turns`), each turn only its new message and the last turn's
/// `previous_response_id`, JSON and streamed: through the gateway (no
/// session ids) over 3 simulated replicas that each keep their own
/// responses, against one replica alone, which holds every chain, in the
/// same run. A misplaced turn is a 404, not a cache miss.
async fn responses_study(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<Vec<report::Report>> {
    let repeats = args.repeats.max(1);
    let model = contention(args);
    let mut w = BenchArgs::seed_study("");
    w.sessions = args.sessions.unwrap_or(24);
    w.turns = args.turns.unwrap_or(6);
    w.concurrency = args.concurrency.unwrap_or(6);
    w.system_prompt_bytes = 4096;
    w.context_bytes = 4000;
    w.user_bytes = 400;
    w.responses = true;
    let variant = ["bounded_hrw,ids=none"];
    let mut out = Vec::new();
    for stream in [false, true] {
        w.no_stream = !stream;
        let shape = if stream { "streamed" } else { "JSON" };
        let mut runs = Vec::new();
        for replicas in [1, 3] {
            let name = format!("responses {shape} {replicas}");
            let (mut r, _) =
                run_variants(exe, &model, replicas, &w, &name, &variant, repeats).await?;
            runs.push(r.remove(0));
        }
        if !args.json {
            println!(
                "Responses chains, {}x{} at c={}, {shape}:\n\n{}",
                w.sessions,
                w.turns,
                w.concurrency,
                report::chain_table(&["one replica alone", "gateway, 3 replicas"], &runs)
            );
        }
        out.extend(runs.into_iter().flatten());
    }
    Ok(out)
}

/// The same study against real llama.cpp replicas, plus the no-gateway baseline.
async fn demo_llamacpp(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<()> {
    let started = Instant::now();
    let mut opts = EngineOptions::default();
    if let Some(p) = &args.engine_python {
        opts.python = p.clone();
    }
    let work = engine::Workdir::new()?;
    let shape = if args.quick {
        ModelShape::TINY
    } else {
        ModelShape::SMALL
    };
    let real = RealEngine {
        model: work.model(&opts.python, shape)?,
        work,
        opts,
    };
    // The shape of issue 12's study: 12 sessions × 6 turns at 3 concurrent.
    let mut study_args = BenchArgs::seed_study("");
    study_args.model = "tiny".into();
    study_args.concurrency = 3;
    study_args.max_tokens = 8;
    if args.quick {
        study_args.sessions = 6;
        study_args.turns = 4;
        study_args.system_prompt_bytes = 1500;
    }
    study_args.sessions = args.sessions.unwrap_or(study_args.sessions);
    study_args.turns = args.turns.unwrap_or(study_args.turns);
    study_args.concurrency = args.concurrency.unwrap_or(study_args.concurrency);
    if !args.json {
        println!("agent-gateway demo: 3 llama.cpp servers (CPU, 1 thread, {} slots each; a generated {}-layer, width-{} llama model), gateway in front.\n",
            real.opts.slots, shape.layers, shape.width);
    }
    let unused = Model {
        prefill_us_per_token: 0.0,
        decode_us_per_token: 0.0,
        cache_blocks: 0,
        max_batch: 1,
        serial_prefill: false,
        no_cache_report: false,
    };
    let reports = study(exe, &unused, Some(&real), &study_args, "llamacpp", false).await?;
    let title = "agent-gateway demo on llama.cpp: affinity on vs off vs round robin";
    if chart_or_json(args, &reports, title)? {
        return Ok(());
    }
    println!(
        "{} sessions × {} turns, c={}, {} B system prompt (cached tokens and prefill times as llama.cpp reports them):\n",
        study_args.sessions, study_args.turns, study_args.concurrency, study_args.system_prompt_bytes
    );
    println!("{}", report::comparison_table(&reports));
    for r in &reports {
        if let Some(n) = r.upstream_retries {
            println!("{}: the gateway re-sent {n} request(s) on a fresh connection after llama.cpp closed a reused one", r.label);
        }
    }
    println!();
    print_turns(&reports);
    println!("chart: {}", args.svg.display());
    println!("finished in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The agent study against three real vLLM servers (started once: each takes
/// a minute or more), the gateway following their KV events: sessions named,
/// then keyless, then round robin straight to the servers. Each run's text is
/// its own, so no run finds another's prompts cached.
async fn demo_vllm(exe: &PathBuf, args: &DemoArgs) -> std::io::Result<()> {
    use crate::vllm::{self, Vllm, VllmOptions};
    let started = Instant::now();
    if !vllm::installed() {
        return Err(std::io::Error::other(
            "vLLM is not installed: run scripts/engine/vllm-setup.sh",
        ));
    }
    let dir = tempfile::tempdir()?;
    let model = vllm::model(dir.path())?;
    if !args.json {
        println!("agent-gateway demo: 3 vLLM servers (CPU build, a generated 2-layer Llama, 128 KV blocks of 32 tokens each: fewer than the conversations need), the gateway following their KV events. Starting them (a minute or more)...\n");
    }
    // Scarce caches: each server holds about half the conversations.
    let opts = VllmOptions {
        blocks: 128,
        max_model_len: 127 * 32,
        ..VllmOptions::default()
    };
    let mut servers = (0..3)
        .map(|i| {
            let log = dir.path().join(format!("vllm-{i}.log"));
            Vllm::spawn(&model, &opts, &log)
        })
        .collect::<std::io::Result<Vec<_>>>()?;
    for s in servers.iter_mut() {
        s.wait_healthy(Duration::from_secs(600))?;
    }
    let backends: String = servers
        .iter()
        .enumerate()
        .map(|(i, s)| {
            format!(
                "      - {{ id: vllm-{i}, addr: \"{}\", kv_events: {} }}\n",
                s.addr(),
                s.kv_events_yaml()
            )
        })
        .collect();
    let mut fleet = Fleet {
        children: Vec::new(),
        engines: Vec::new(),
        gateway_url: String::new(),
        metrics_url: String::new(),
        backend_urls: servers.iter().map(|s| s.url("")).collect(),
        _dir: tempfile::tempdir()?,
    };
    start_gateway(exe, &mut fleet, &backends, "", "").await?;
    let mut base = BenchArgs::seed_study("");
    base.model = "tiny".into();
    base.concurrency = args.concurrency.unwrap_or(3);
    base.max_tokens = 8;
    base.sessions = args.sessions.unwrap_or(6);
    base.turns = args.turns.unwrap_or(4);
    // Each conversation's own document, little shared: a replica that has
    // not seen a conversation holds next to nothing of it.
    base.system_prompt_bytes = 200;
    base.context_bytes = 3000;
    let mut reports = Vec::new();
    for (ids, direct, label) in [
        (Ids::Sticky, false, "affinity on, KV events"),
        (
            Ids::None,
            false,
            "no session id (prefix routing), KV events",
        ),
        (Ids::Sticky, true, "round robin, no gateway"),
    ] {
        let mut a = base.clone();
        a.url = match direct {
            true => fleet.backend_urls.join(","),
            false => fleet.gateway_url.clone(),
        };
        a.keyless = ids == Ids::None;
        a.label = format!("vllm: {label}");
        a.id_prefix = format!("vllm-{}", reports.len());
        reports.push(loadgen::run(&a).await);
    }
    if chart_or_json(
        args,
        &reports,
        "agent-gateway demo on vLLM: affinity vs round robin",
    )? {
        return Ok(());
    }
    println!(
        "{} sessions × {} turns, c={} (cached tokens as vLLM reports them):\n",
        base.sessions, base.turns, base.concurrency
    );
    println!("{}", report::comparison_table(&reports));
    let exact = metric_sum(&fleet.metrics_url, "agentserve_kv_index_exact{").await;
    let right = metric_sum(
        &fleet.metrics_url,
        "agentserve_kv_predictions_total{outcome=\"right\",source=\"events\"",
    )
    .await;
    let wrong = metric_sum(
        &fleet.metrics_url,
        "agentserve_kv_predictions_total{outcome=\"wrong\",source=\"events\"",
    )
    .await;
    println!("KV events: {exact} of 3 servers' holdings exact; turns predicted from them: {right} right, {wrong} wrong (cached share within 0.1 of what vLLM reported)\n");
    print_turns(&reports);
    println!("chart: {}", args.svg.display());
    println!("finished in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Write the chart of a real engines' study; with `--json`, print the
/// reports as JSON too and say so (the tables are not printed then).
fn chart_or_json(
    args: &DemoArgs,
    reports: &[report::Report],
    title: &str,
) -> std::io::Result<bool> {
    std::fs::write(&args.svg, report::svg(reports, title))?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(reports).unwrap_or_default()
        );
    }
    Ok(args.json)
}

/// Each run's first session, turn by turn: where it went, what was cached.
fn print_turns(reports: &[report::Report]) {
    for r in reports {
        println!("{} — one session, turn by turn:\n", r.label);
        let rows: Vec<String> = r
            .locality
            .iter()
            .map(|l| {
                format!(
                    "| {} | {} | {} | {} | {} |",
                    l.turn,
                    l.backend.as_deref().unwrap_or("-"),
                    l.input_tokens,
                    l.cached_tokens,
                    l.prefill_ms.map_or("-".into(), |p| format!("{p:.1}"))
                )
            })
            .collect();
        println!("| turn | backend | input tokens | cached tokens | prefill ms |\n|---:|---|---:|---:|---:|\n{}\n", rows.join("\n"));
    }
}
