use agent_gateway::config::Config;
use agent_gateway::server::{self, RunOptions};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

// mimalloc: measured to cut the gateway's CPU per request (README, "Proxy
// overhead"); the allocator is a large share of a proxy's user time.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// mimalloc's options (the v3 sources libmimalloc-sys builds: `mi_option_e`
// in its mimalloc.h), set through its C API.
extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// Memory freed goes back to the system at once, not after mimalloc's
/// delay (10 ms, retried only when the freeing thread allocates again):
/// 5,000 idle client connections that closed left 526 MiB held for good.
fn give_freed_memory_back() {
    // SAFETY: mimalloc's documented option setters, called before any
    // thread but this one runs; they take plain integers.
    unsafe {
        mi_option_set(MI_OPTION_PURGE_DELAY, 0);
    }
}

#[derive(Parser)]
#[command(
    name = "agent-gateway",
    version,
    about = "Session-affine gateway for LLM agent fleets"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve in the foreground (systemd runs this).
    Run {
        #[arg(long, short)]
        config: PathBuf,
        /// Take over the listeners of a running instance (graceful upgrade).
        #[arg(long, short)]
        upgrade: bool,
    },
    /// Validate a configuration file; exit non-zero and say what is wrong.
    Check {
        #[arg(long, short)]
        config: PathBuf,
        /// Also connect to the shared binding store (`affinity.store: redis`)
        /// and ask it to answer, and ask each backend its health path: a
        /// wrong CA, password or address shows now, not as a gateway that
        /// serves alone or a backend never healthy.
        #[arg(long)]
        connect: bool,
    },
    /// Run one simulated vLLM replica (prefix cache, latency model, faults).
    SimBackend(agent_gateway_tools::sim::SimConfig),
    /// Replay agent sessions (or a Mooncake trace) against a URL and report.
    Bench(agent_gateway_tools::loadgen::BenchArgs),
    /// Show what affinity buys: simulated replicas + gateway + agent workload.
    Demo(agent_gateway_tools::demo::DemoArgs),
    /// Print a new random `affinity.hash_key` (256 bits, 64 hex digits).
    Keygen,
    /// Print the `key_sha256` of a client key read from stdin, for
    /// `auth.keys_file` (read from stdin: a key on the command line would
    /// show in `ps` and shell history).
    HashKey,
}

fn main() -> ExitCode {
    give_freed_memory_back();
    agent_gateway::logging::init();
    let cli = Cli::parse();
    match cli.command {
        Command::Keygen => {
            println!("{}", agent_gateway::secret::generate());
            ExitCode::SUCCESS
        }
        Command::HashKey => {
            let mut key = String::new();
            if std::io::stdin().read_line(&mut key).is_err() || key.trim().is_empty() {
                eprintln!("error: give the key on stdin, e.g. `printf %s \"$KEY\" | agent-gateway hash-key`");
                return ExitCode::FAILURE;
            }
            println!("{}", agent_gateway::auth::hash_key(key.trim()));
            ExitCode::SUCCESS
        }
        Command::Demo(args) => match agent_gateway_tools::demo::run(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Bench(args) => bench(args),
        Command::SimBackend(cfg) => match agent_gateway_tools::sim::run(cfg) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Check { config, connect } => match Config::load(&config) {
            Ok(c) => {
                for w in &c.warnings {
                    eprintln!("warning: {w}");
                }
                if connect {
                    if let Err(e) = agent_gateway::fleet::store::try_connect(&c.affinity.store) {
                        eprintln!("error: affinity.store: {e}");
                        return ExitCode::FAILURE;
                    }
                    if !backends_answer(&c) {
                        return ExitCode::FAILURE;
                    }
                }
                let backends: usize = c.tiers.iter().map(|t| t.backends.len()).sum();
                println!(
                    "{}: ok ({} tier(s), {} backend(s))",
                    config.display(),
                    c.tiers.len(),
                    backends
                );
                ExitCode::SUCCESS
            }
            Err(errors) => {
                for e in &errors.0 {
                    eprintln!("error: {e}");
                }
                ExitCode::FAILURE
            }
        },
        Command::Run { config, upgrade } => {
            let cfg = match Config::load(&config) {
                Ok(c) => c,
                Err(errors) => {
                    for e in &errors.0 {
                        eprintln!("error: {e}");
                    }
                    return ExitCode::FAILURE;
                }
            };
            for w in &cfg.warnings {
                log::warn!("{w}");
            }
            let opts = RunOptions {
                upgrade,
                daemon: false,
                config_path: Some(config.clone()),
            };
            match server::build(cfg, &opts) {
                Ok((srv, _gw)) => srv.run_forever(),
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}

fn bench(args: agent_gateway_tools::loadgen::BenchArgs) -> ExitCode {
    use agent_gateway_tools::loadgen::{self, report};
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(loadgen::run(&args));
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r).unwrap_or_default());
    } else {
        println!("{}", report::detail(&r));
    }
    if let Some(path) = &args.svg {
        if let Err(e) = std::fs::write(path, report::svg(std::slice::from_ref(&r), &args.label)) {
            eprintln!("error: writing {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if r.requests == 0 || r.errors == r.requests {
        eprintln!("error: no request succeeded");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

/// `check --connect`: every backend checked once, as the gateway checks
/// it; each verdict printed, each failure an error.
fn backends_answer(c: &Config) -> bool {
    let mut ok = true;
    for (tier, id, addr, failed) in agent_gateway::upstream::health::check_once(c) {
        match failed {
            None => println!(
                "tier {tier} backend {id} ({addr}): passes its health check (GET {})",
                c.health.path
            ),
            Some(e) => {
                eprintln!("error: tier {tier} backend {id} ({addr}): {e}");
                ok = false;
            }
        }
    }
    ok
}
