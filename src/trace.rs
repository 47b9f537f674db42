//! Request traces: one JSON line per request — the per-turn locality log that
//! shows whether affinity pays (which backend, hit or why not, prompt and
//! cached tokens, time to first byte). Written by a dedicated thread so a slow
//! disk never stalls a request; lines are dropped (and counted) if it falls
//! behind. Files rotate by size: `trace.jsonl` → `trace.jsonl.1` → ... `.keep`.

use serde::Serialize;
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::Duration;

/// One request, as written to the trace.
#[derive(Debug, Serialize)]
pub struct TraceRecord<'a> {
    /// Milliseconds since the Unix epoch at request start.
    pub time_ms: u64,
    pub request_id: &'a str,
    /// The OpenTelemetry trace it belongs to (`telemetry` on).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    pub method: &'a str,
    pub path: &'a str,
    pub tier: Option<&'a str>,
    pub session: Option<&'a str>,
    pub parent: Option<&'a str>,
    pub backend: Option<&'a str>,
    pub affinity_hit: bool,
    /// `hit`, `first_turn`, `expired`, `broken`, `moved`, ...
    pub reason: Option<&'a str>,
    pub moved_because: Option<&'a str>,
    /// Tokens of the prompt the prefix index said its backend held.
    pub prefix_tokens: Option<u64>,
    pub status: u16,
    pub prompt_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub ttfb_ms: Option<f64>,
    pub total_ms: f64,
}

pub struct TraceLog {
    tx: SyncSender<Vec<u8>>,
    pub dropped: Arc<AtomicU64>,
    writer: std::thread::JoinHandle<()>,
}

const QUEUE: usize = 16_384;

impl TraceLog {
    /// Open (append) `path`; rotate when it exceeds `max_bytes`, keeping `keep` old files.
    pub fn open(path: PathBuf, max_bytes: u64, keep: usize) -> std::io::Result<TraceLog> {
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        let size = file.metadata()?.len();
        let (tx, rx) = sync_channel::<Vec<u8>>(QUEUE);
        let dropped = Arc::new(AtomicU64::new(0));
        let writer = std::thread::Builder::new()
            .name("trace writer".into())
            .spawn(move || {
                let mut w = Writer {
                    path,
                    out: BufWriter::new(file),
                    size,
                    max_bytes: max_bytes.max(1024),
                    keep,
                };
                loop {
                    match rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(line) => w.write(&line),
                        Err(RecvTimeoutError::Timeout) => {
                            let _ = w.out.flush();
                        }
                        Err(RecvTimeoutError::Disconnected) => {
                            let _ = w.out.flush();
                            return;
                        }
                    }
                }
            })?;
        Ok(TraceLog {
            tx,
            dropped,
            writer,
        })
    }

    /// Stop accepting lines and wait until every queued line is on disk.
    pub fn close(self) {
        drop(self.tx);
        let _ = self.writer.join();
    }

    pub fn record(&self, r: &TraceRecord<'_>) {
        let Ok(mut line) = serde_json::to_vec(r) else {
            return;
        };
        line.push(b'\n');
        if let Err(TrySendError::Full(_)) = self.tx.try_send(line) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

struct Writer {
    path: PathBuf,
    out: BufWriter<File>,
    size: u64,
    max_bytes: u64,
    keep: usize,
}

fn numbered(path: &Path, n: usize) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

impl Writer {
    fn write(&mut self, line: &[u8]) {
        if self.size + line.len() as u64 > self.max_bytes && self.size > 0 {
            self.rotate();
        }
        if self.out.write_all(line).is_ok() {
            self.size += line.len() as u64;
        }
    }

    fn rotate(&mut self) {
        let _ = self.out.flush();
        if self.keep == 0 {
            let _ = std::fs::remove_file(&self.path);
        } else {
            let _ = std::fs::remove_file(numbered(&self.path, self.keep));
            for n in (1..self.keep).rev() {
                let _ = std::fs::rename(numbered(&self.path, n), numbered(&self.path, n + 1));
            }
            let _ = std::fs::rename(&self.path, numbered(&self.path, 1));
        }
        match OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
        {
            Ok(f) => {
                self.out = BufWriter::new(f);
                self.size = 0;
            }
            Err(e) => log::error!("trace log {}: cannot reopen: {e}", self.path.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: u64) -> TraceRecord<'static> {
        TraceRecord {
            time_ms: i,
            request_id: "r",
            trace_id: None,
            method: "POST",
            path: "/v1/chat/completions",
            tier: Some("default"),
            session: Some("s"),
            parent: None,
            backend: Some("b0"),
            affinity_hit: i > 0,
            reason: Some("hit"),
            moved_because: None,
            prefix_tokens: None,
            status: 200,
            prompt_tokens: Some(100),
            cached_tokens: Some(96),
            ttfb_ms: Some(1.5),
            total_ms: 2.0,
        }
    }

    #[test]
    fn rotates_by_size_and_keeps_a_bounded_number_of_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.jsonl");
        let log = TraceLog::open(path.clone(), 2048, 2).unwrap();
        for i in 0..200 {
            log.record(&rec(i));
        }
        log.close();
        assert!(numbered(&path, 1).exists() && numbered(&path, 2).exists());
        assert!(!numbered(&path, 3).exists(), "only `keep` old files");
        for p in [path.clone(), numbered(&path, 1)] {
            let text = std::fs::read_to_string(&p).unwrap();
            assert!(text.len() <= 2048 + 400);
            for line in text.lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                assert_eq!(v["backend"], "b0");
            }
        }
    }
}
