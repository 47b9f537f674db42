//! Real vLLM (its CPU build) as child processes, serving a tiny
//! random-weight Llama generated on the spot (`scripts/engine/make_vllm_model.py`),
//! with prefix caching, cached-token reports, the Responses store, `/metrics`
//! and KV-cache events on. `scripts/engine/vllm-setup.sh` installs it.
//!
//! Nothing listens beyond this host: the HTTP server and the replay socket
//! are on 127.0.0.1, and the event publisher on a Unix socket (vLLM binds a
//! publisher's endpoint only when it is `ipc://` or names no one host; to a
//! `tcp://` host it connects instead).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MAKE_MODEL_PY: &str = include_str!("../../scripts/engine/make_vllm_model.py");
const SERVE_SH: &str = include_str!("../../scripts/engine/vllm-serve.sh");

/// The Python with vLLM: `$AGENT_GATEWAY_VLLM_PYTHON`, else the venv
/// `scripts/engine/vllm-setup.sh` makes beside the build.
pub fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("AGENT_GATEWAY_VLLM_PYTHON") {
        return PathBuf::from(p);
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/vllm-venv/bin/python")
}

/// Whether vLLM is installed where [`python`] says.
pub fn installed() -> bool {
    Command::new(python())
        .args(["-c", "import vllm"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Write the model into `dir` (once) and return its directory.
pub fn model(dir: &Path) -> std::io::Result<PathBuf> {
    let out = dir.join("tiny-llama");
    if out.join("config.json").exists() {
        return Ok(out);
    }
    let script = dir.join("make_vllm_model.py");
    std::fs::write(&script, MAKE_MODEL_PY)?;
    let status = Command::new(python())
        .arg(&script)
        .arg("--out")
        .arg(&out)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !status.success() {
        return Err(std::io::Error::other(
            "generating the vLLM model failed; run scripts/engine/vllm-setup.sh",
        ));
    }
    Ok(out)
}

/// How one server runs.
#[derive(Debug, Clone)]
pub struct VllmOptions {
    /// KV-cache blocks (`--num-gpu-blocks-override`) of `block_size` tokens.
    pub blocks: u32,
    pub block_size: u32,
    pub max_model_len: u32,
}

impl Default for VllmOptions {
    fn default() -> Self {
        VllmOptions {
            blocks: 512,
            block_size: 32,
            max_model_len: 4096,
        }
    }
}

/// Ports a server keeps across restarts.
#[derive(Debug, Clone, Copy)]
pub struct VllmPorts {
    pub http: u16,
    pub replay: u16,
}

impl VllmPorts {
    pub fn free() -> std::io::Result<VllmPorts> {
        let http = free_port("127.0.0.1:0")?;
        let replay = free_port("127.0.0.1:0")?;
        Ok(VllmPorts { http, replay })
    }
}

fn free_port(at: &str) -> std::io::Result<u16> {
    Ok(std::net::TcpListener::bind(at)?.local_addr()?.port())
}

/// One vLLM server, killed (by PID) when dropped.
pub struct Vllm {
    pub ports: VllmPorts,
    model: PathBuf,
    opts: VllmOptions,
    log: PathBuf,
    child: Option<Child>,
}

impl Vllm {
    /// Start a server (it answers `/health` later: see [`Vllm::wait_healthy`]).
    pub fn spawn(model: &Path, opts: &VllmOptions, log: &Path) -> std::io::Result<Vllm> {
        let mut v = Vllm {
            ports: VllmPorts::free()?,
            model: model.to_path_buf(),
            opts: opts.clone(),
            log: log.to_path_buf(),
            child: None,
        };
        v.start()?;
        Ok(v)
    }

    /// (Re)start the process on its ports.
    pub fn start(&mut self) -> std::io::Result<()> {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        writeln!(log, "--- starting vLLM on 127.0.0.1:{}", self.ports.http)?;
        // Its own copy: bash reads a script as it runs it, and a copy
        // rewritten for another server under it would end it.
        let script = self.log.with_extension("sh");
        std::fs::write(&script, SERVE_SH)?;
        let mut cmd = Command::new("bash");
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl and setpgid are async-signal-safe; the first asks
            // the kernel to kill the server if this process dies first.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    // Its own process group: killing it takes its engine core too.
                    libc::setpgid(0, 0);
                    Ok(())
                });
            }
        }
        let child = cmd
            .arg(&script)
            .arg(&self.model)
            .arg(self.ports.http.to_string())
            .arg(self.events_endpoint())
            .arg(self.ports.replay.to_string())
            .arg(self.opts.blocks.to_string())
            .arg(self.opts.block_size.to_string())
            .arg(self.opts.max_model_len.to_string())
            .env("AGENT_GATEWAY_VLLM_PYTHON", python())
            .stdout(Stdio::from(log.try_clone()?))
            .stderr(Stdio::from(log))
            .spawn()?;
        self.child = Some(child);
        Ok(())
    }

    /// Wait until `/health` answers 200 (start takes 50–90 s alone on a
    /// 2-core box, longer beside others).
    pub fn wait_healthy(&mut self, within: Duration) -> std::io::Result<()> {
        let deadline = Instant::now() + within;
        let addr = self.addr();
        while Instant::now() < deadline {
            if super::engine::health_ok(&addr) {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
                return Err(std::io::Error::other(format!(
                    "vLLM exited ({status}); its log ends:\n{}",
                    self.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        Err(std::io::Error::other(format!(
            "vLLM at {addr} never became healthy; its log ends:\n{}",
            self.log_tail()
        )))
    }

    /// The last lines of its log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.ports.http)
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.ports.http)
    }

    /// Where it publishes its events: a Unix socket beside its log.
    pub fn events_endpoint(&self) -> String {
        let dir = self.log.parent().unwrap_or(Path::new("/tmp"));
        format!("ipc://{}/kv-{}.sock", dir.display(), self.ports.http)
    }

    /// Its `kv_events` for a gateway's config.
    pub fn kv_events_yaml(&self) -> String {
        format!(
            r#"{{ endpoint: "{}", replay: "tcp://127.0.0.1:{}" }}"#,
            self.events_endpoint(),
            self.ports.replay
        )
    }

    /// Stop it now (SIGKILL to its process group, as a crash would).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SAFETY: signals the process group this server leads.
            unsafe {
                libc::kill(-(c.id() as i32), libc::SIGKILL);
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Vllm {
    fn drop(&mut self) {
        self.kill();
    }
}
