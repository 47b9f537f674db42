//! `agent-gateway demo`: what affinity buys, on a machine with no GPU.
//!
//! Each run starts three fresh simulated vLLM replicas and a gateway in front
//! of them (child processes of this binary, on free 127.0.0.1 ports), replays
//! an agent workload with sticky session ids (affinity on) and with a fresh id
//! per request (what a gateway sees with affinity off), then stops them. The
//! long study also runs against one replica with an unlimited cache: the
//! ideal that affinity approaches. Ctrl-C stops everything cleanly.

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
}

/// The replica latency model used by the demo.
#[derive(Clone, Copy)]
struct Model {
    prefill_us_per_token: f64,
    decode_us_per_token: f64,
    cache_blocks: usize,
    max_batch: usize,
}

/// Child processes, killed (by PID) when dropped — also on Ctrl-C or panic.
struct Fleet {
    children: Vec<Child>,
    gateway_url: String,
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

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn start_sim(exe: &PathBuf, id: &str, m: &Model) -> std::io::Result<(Child, String)> {
    let mut child = Command::new(exe)
        .args(["sim-backend", "--listen", "127.0.0.1:0", "--id", id])
        .args([
            "--prefill-us-per-token",
            &m.prefill_us_per_token.to_string(),
        ])
        .args(["--decode-us-per-token", &m.decode_us_per_token.to_string()])
        .args(["--cache-blocks", &m.cache_blocks.to_string()])
        .args(["--max-batch", &m.max_batch.to_string()])
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
    let deadline = Instant::now() + Duration::from_secs(30);
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

async fn start_fleet(exe: &PathBuf, m: &Model, replicas: usize) -> std::io::Result<Fleet> {
    let dir = tempfile::tempdir()?;
    let mut fleet = Fleet {
        children: Vec::new(),
        gateway_url: String::new(),
        _dir: dir,
    };
    let dir_path = fleet._dir.path().to_path_buf();
    let mut backends = String::new();
    for i in 0..replicas {
        let (child, addr) = start_sim(exe, &format!("vllm-{i}"), m)?;
        fleet.children.push(child);
        backends.push_str(&format!("      - {{ id: vllm-{i}, addr: \"{addr}\" }}\n"));
    }
    let (port, metrics, admin) = (free_port()?, free_port()?, free_port()?);
    let config = format!(
        "server:\n  listen: [\"127.0.0.1:{port}\"]\n  pid_file: \"{d}/gw.pid\"\n  upgrade_sock: \"{d}/gw.sock\"\n  grace_period_seconds: 0\n  graceful_shutdown_timeout_seconds: 1\n\
         tiers:\n  default:\n    default: true\n    backends:\n{backends}\
         affinity:\n  hash_key: \"demo-fleet\"\nhealth:\n  interval_ms: 500\nmetrics:\n  listen: \"127.0.0.1:{metrics}\"\nadmin:\n  listen: \"127.0.0.1:{admin}\"\n",
        d = dir_path.display()
    );
    let path = dir_path.join("gateway.yaml");
    std::fs::write(&path, config)?;
    let gw = Command::new(exe)
        .args(["run", "--config"])
        .arg(&path)
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    fleet.children.push(gw);
    wait_http(&format!("http://127.0.0.1:{metrics}/healthz")).await?;
    fleet.gateway_url = format!("http://127.0.0.1:{port}");
    wait_http(&format!("{}/v1/models", fleet.gateway_url)).await?;
    Ok(fleet)
}

async fn study(
    exe: &PathBuf,
    m: &Model,
    base: &BenchArgs,
    name: &str,
    with_ideal: bool,
) -> std::io::Result<Vec<report::Report>> {
    let mut out = Vec::new();
    for (fresh, label) in [(false, "affinity on"), (true, "affinity off (fresh ids)")] {
        let fleet = start_fleet(exe, m, 3).await?;
        let mut a = base.clone();
        a.url = fleet.gateway_url.clone();
        a.fresh_ids = fresh;
        a.label = format!("{name}: {label}");
        a.id_prefix = format!("{name}-{}", if fresh { "off" } else { "on" });
        out.push(loadgen::run(&a).await);
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
    let started = Instant::now();
    let model = if args.quick {
        Model {
            prefill_us_per_token: 20.0,
            decode_us_per_token: 500.0,
            cache_blocks: 1200,
            max_batch: 4,
        }
    } else {
        Model {
            prefill_us_per_token: 100.0,
            decode_us_per_token: 4000.0,
            cache_blocks: 1200,
            max_batch: 4,
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
    let seed_reports = study(exe, &model, &seed, "seed", false).await?;
    let long_reports = study(exe, &model, &long, "long", true).await?;
    let all: Vec<report::Report> = seed_reports.iter().chain(&long_reports).cloned().collect();
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
    for r in &long_reports[..2] {
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
    println!("chart: {}", args.svg.display());
    println!("finished in {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}
