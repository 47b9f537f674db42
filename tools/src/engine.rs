//! Real inference engines as child processes: llama.cpp's own HTTP server
//! (through the `xllamacpp` wheel, CPU only) serving a tiny random-weight
//! llama model generated on the spot. The demo, `bench` studies and the
//! integration tests run the gateway in front of these, so every figure can be
//! checked against a real KV cache, a real tokenizer and a real HTTP stack.
//!
//! The two Python scripts are compiled into the binary and written to a
//! temporary directory when used; all the machine needs is a Python with
//! `xllamacpp`, `gguf` and `numpy` (`scripts/engine/setup.sh` makes one).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MAKE_MODEL_PY: &str = include_str!("../../scripts/engine/make_model.py");
const SERVE_PY: &str = include_str!("../../scripts/engine/serve.py");

/// The Python that runs the engine: `$AGENT_GATEWAY_ENGINE_PYTHON`, else the
/// venv `scripts/engine/setup.sh` makes beside the build, else `python3`.
pub fn default_python() -> PathBuf {
    if let Some(p) = std::env::var_os("AGENT_GATEWAY_ENGINE_PYTHON") {
        return PathBuf::from(p);
    }
    // The workspace's root: this crate's parent.
    let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/engine-venv/bin/python");
    if venv.exists() {
        return venv;
    }
    PathBuf::from("python3")
}

/// Shape of the generated model. `layers` sets the prefill cost per token.
#[derive(Debug, Clone, Copy)]
pub struct ModelShape {
    pub layers: u32,
    pub width: u32,
}

impl ModelShape {
    /// Fast turns: what tests and load studies use.
    pub const TINY: ModelShape = ModelShape {
        layers: 2,
        width: 384,
    };
    /// Prefill costs enough that a cache hit shows in TTFT (~22 MB).
    pub const SMALL: ModelShape = ModelShape {
        layers: 6,
        width: 384,
    };
}

/// How each replica runs.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub python: PathBuf,
    pub threads: u32,
    /// Requests decoded together (llama.cpp `--parallel`).
    pub slots: u32,
    /// KV cache tokens, shared by the slots.
    pub ctx_tokens: u32,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            python: default_python(),
            threads: 1,
            slots: 4,
            ctx_tokens: 4 * 16384,
        }
    }
}

/// A directory holding the scripts and generated models; removed when dropped.
pub struct Workdir {
    dir: tempfile::TempDir,
}

impl Workdir {
    pub fn new() -> std::io::Result<Workdir> {
        let dir = tempfile::Builder::new()
            .prefix("agent-gateway-engine")
            .tempdir()?;
        std::fs::write(dir.path().join("make_model.py"), MAKE_MODEL_PY)?;
        std::fs::write(dir.path().join("serve.py"), SERVE_PY)?;
        Ok(Workdir { dir })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Generate the model (deterministic for a shape) and return its path.
    pub fn model(&self, python: &Path, shape: ModelShape) -> std::io::Result<PathBuf> {
        let out = self
            .path()
            .join(format!("tiny-{}x{}.gguf", shape.layers, shape.width));
        if out.exists() {
            return Ok(out);
        }
        let status = Command::new(python)
            .arg(self.path().join("make_model.py"))
            .arg(&out)
            .args(["--layers", &shape.layers.to_string()])
            .args(["--width", &shape.width.to_string()])
            .stdout(Stdio::null())
            .status()
            .map_err(|e| {
                std::io::Error::other(format!(
                    "cannot run {} (run scripts/engine/setup.sh): {e}",
                    python.display()
                ))
            })?;
        if !status.success() {
            return Err(std::io::Error::other(format!(
                "generating the model failed ({status}); is the engine installed? run scripts/engine/setup.sh"
            )));
        }
        Ok(out)
    }
}

/// One llama.cpp server on 127.0.0.1, killed (by PID) when dropped.
pub struct Engine {
    pub addr: String,
    child: Option<Child>,
}

impl Engine {
    /// Start a replica on a free port and wait until `/health` answers 200.
    pub fn start(work: &Workdir, model: &Path, opts: &EngineOptions) -> std::io::Result<Engine> {
        let mut cmd = Command::new(&opts.python);
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe; it only asks the kernel to
            // kill the replica if this process dies first (no orphaned engines).
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
        }
        let mut child = cmd
            .arg(work.path().join("serve.py"))
            .arg("--model")
            .arg(model)
            .args(["--port", "0"])
            .args(["--threads", &opts.threads.to_string()])
            .args(["--slots", &opts.slots.to_string()])
            .args(["--ctx", &opts.ctx_tokens.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let mut line = String::new();
        if let Some(out) = child.stdout.take() {
            BufReader::new(out).read_line(&mut line)?;
        }
        let Some(addr) = line
            .trim()
            .strip_prefix("listening http://")
            .map(str::to_string)
        else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::other(format!(
                "llama.cpp server did not start (said {line:?})"
            )));
        };
        let engine = Engine {
            addr,
            child: Some(child),
        };
        engine.wait_healthy()?;
        Ok(engine)
    }

    fn wait_healthy(&self) -> std::io::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if health_ok(&self.addr) {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(std::io::Error::other(format!(
            "llama.cpp at {} never became healthy",
            self.addr
        )))
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stop the replica now (SIGKILL, as a crash would).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A plain blocking `GET /health` (no client library: also used before any runtime exists).
pub(crate) fn health_ok(addr: &str) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut head = [0u8; 12];
    s.read_exact(&mut head).is_ok() && head.ends_with(b"200")
}
