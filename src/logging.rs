//! The process's log: `env_logger` (`RUST_LOG`), with repeated warnings and
//! errors rate-limited. When every backend fails, each request logs the
//! same line (Pingora's "Fail to proxy", the gateway's "refused connection"):
//! thousands a second that bury what matters and fill the disk. Each source
//! of warnings and errors (a module path) may log a burst of [`BURST`] lines,
//! then [`PER_SECOND`] a second; what it drops is counted and said with its
//! next line. Info and below pass untouched.

use log::{Level, Log, Metadata, Record};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::time::Instant;

/// Lines a source may log at once before the rate applies.
pub const BURST: f64 = 20.0;
/// Lines a second a source may log after its burst.
pub const PER_SECOND: f64 = 5.0;

/// Token buckets, one per source.
#[derive(Default)]
pub struct Limiter {
    sources: HashMap<String, Bucket>,
}

struct Bucket {
    tokens: f64,
    at: f64,
    dropped: u64,
}

impl Limiter {
    /// Whether a line from `source` at `now_s` (seconds on any monotonic
    /// clock) may be written; `Some(n)`: yes, and `n` lines were dropped
    /// before it.
    pub fn admit(&mut self, source: &str, now_s: f64) -> Option<u64> {
        if !self.sources.contains_key(source) {
            // Sources are module paths: a fixed, small set.
            self.sources.insert(
                source.to_string(),
                Bucket {
                    tokens: BURST,
                    at: now_s,
                    dropped: 0,
                },
            );
        }
        let b = self.sources.get_mut(source)?;
        b.tokens = (b.tokens + (now_s - b.at).max(0.0) * PER_SECOND).min(BURST);
        b.at = now_s;
        if b.tokens < 1.0 {
            b.dropped += 1;
            return None;
        }
        b.tokens -= 1.0;
        Some(std::mem::take(&mut b.dropped))
    }
}

struct RateLimited {
    inner: env_logger::Logger,
    limiter: Mutex<Limiter>,
    epoch: Instant,
}

impl Log for RateLimited {
    fn enabled(&self, metadata: &Metadata) -> bool {
        self.inner.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        if !self.inner.matches(record) {
            return;
        }
        if record.level() > Level::Warn {
            return self.inner.log(record);
        }
        let source = record.module_path().unwrap_or(record.target());
        let now = self.epoch.elapsed().as_secs_f64();
        match self.limiter.lock().admit(source, now) {
            None => {}
            Some(0) => self.inner.log(record),
            Some(dropped) => self.inner.log(
                &Record::builder()
                    .args(format_args!(
                        "{} ({dropped} similar lines from {source} not logged)",
                        record.args()
                    ))
                    .level(record.level())
                    .target(record.target())
                    .module_path(record.module_path())
                    .file(record.file())
                    .line(record.line())
                    .build(),
            ),
        }
    }

    fn flush(&self) {
        self.inner.flush()
    }
}

/// Install the process's logger (`RUST_LOG`, default `info`).
pub fn init() {
    let inner =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info")).build();
    let max = inner.filter();
    let logger = RateLimited {
        inner,
        limiter: Mutex::default(),
        epoch: Instant::now(),
    };
    if log::set_boxed_logger(Box::new(logger)).is_ok() {
        log::set_max_level(max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_source_logs_its_burst_then_its_rate_and_says_what_it_dropped() {
        let mut l = Limiter::default();
        // 1,000 lines in the same instant: the burst passes, the rest not.
        let passed = (0..1000)
            .filter(|_| l.admit("pingora_proxy", 0.0).is_some())
            .count();
        assert_eq!(passed, BURST as usize);
        // Another source is not held back by it.
        assert_eq!(l.admit("agent_gateway::proxy::peer", 0.0), Some(0));
        // A second later: PER_SECOND more, the first saying how many were dropped.
        assert_eq!(l.admit("pingora_proxy", 1.0), Some(1000 - BURST as u64));
        let more = (0..100)
            .filter(|_| l.admit("pingora_proxy", 1.0).is_some())
            .count();
        assert_eq!(more, PER_SECOND as usize - 1);
        // Quiet for long enough, the burst is back whole, no more.
        let later = (0..100)
            .filter(|_| l.admit("pingora_proxy", 60.0).is_some())
            .count();
        assert_eq!(later, BURST as usize);
    }
}
