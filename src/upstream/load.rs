//! What each engine reports about its own load: its gauges, parsed, and kept
//! fresh for placement (the scraping service is `crate::scraper`).
//!
//! The gateway always knows its own requests in flight and live bindings per
//! backend. With `load.scrape` on, a background task also reads each
//! backend's Prometheus `/metrics` every `load.interval_ms` and keeps the
//! engine's own gauges: requests running and waiting, and KV-cache usage —
//! vLLM, SGLang and llama.cpp names alike. A scrape older than
//! `load.stale_ms` (or a failing one) is ignored: placement falls back to the
//! gateway-local counts, the failure is counted, and no client ever sees it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Gauge names per engine: (running, waiting, KV usage 0..1).
const RUNNING: &[&str] = &[
    "vllm:num_requests_running",
    "sglang:num_running_reqs",
    "llamacpp:requests_processing",
];
const WAITING: &[&str] = &[
    "vllm:num_requests_waiting",
    "sglang:num_queue_reqs",
    "llamacpp:requests_deferred",
];
const KV_USAGE: &[&str] = &[
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
    "llamacpp:kv_cache_usage_ratio",
];

/// The engine's cumulative decode time (seconds) and the tokens it was
/// spent on: a time-per-output-token histogram's sum and count, or
/// llama.cpp's counters.
const DECODE_SECONDS: &[&str] = &[
    "vllm:inter_token_latency_seconds_sum",
    "sglang:inter_token_latency_seconds_sum",
    "llamacpp:tokens_predicted_seconds_total",
];
const DECODE_TOKENS: &[&str] = &[
    "vllm:inter_token_latency_seconds_count",
    "sglang:inter_token_latency_seconds_count",
    "llamacpp:tokens_predicted_total",
];

/// What one scrape found (absent gauges stay `None`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineGauges {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    pub kv_usage: Option<f64>,
    /// Cumulative decode time, seconds, and its tokens ([`DECODE_SECONDS`]).
    pub decode_seconds: Option<f64>,
    pub decode_tokens: Option<f64>,
}

impl EngineGauges {
    /// Read the known gauges from Prometheus text exposition. Samples of one
    /// gauge with several label sets (one per model, say) are summed.
    pub fn parse(text: &str) -> EngineGauges {
        let mut g = EngineGauges::default();
        for line in text.lines() {
            if line.starts_with('#') {
                continue;
            }
            let line = line.trim();
            // `name{labels} value [timestamp]`; label values may hold spaces.
            let (name, rest) = match line.rfind('}') {
                Some(end) => (line.split('{').next().unwrap_or(""), &line[end + 1..]),
                None => line.split_once(char::is_whitespace).unwrap_or((line, "")),
            };
            let Some(Ok(v)) = rest.split_whitespace().next().map(str::parse::<f64>) else {
                continue;
            };
            if !v.is_finite() {
                continue;
            }
            let slot = if RUNNING.contains(&name) {
                &mut g.running
            } else if WAITING.contains(&name) {
                &mut g.waiting
            } else if KV_USAGE.contains(&name) {
                &mut g.kv_usage
            } else if DECODE_SECONDS.contains(&name) {
                &mut g.decode_seconds
            } else if DECODE_TOKENS.contains(&name) {
                &mut g.decode_tokens
            } else {
                continue;
            };
            *slot = Some(slot.unwrap_or(0.0) + v.max(0.0));
        }
        g
    }
}

const NONE: u64 = u64::MAX;

/// A backend's engine-reported load, shared by the scraper and placement.
#[derive(Debug)]
pub struct EngineLoad {
    running: AtomicU64,
    waiting: AtomicU64,
    /// KV usage in millionths (NONE: not reported).
    kv_usage_ppm: AtomicU64,
    /// When the last successful scrape landed (ms on the process clock; 0: never).
    scraped_ms: AtomicU64,
    /// How old a scrape may be and still count (ms; 0: scraping off).
    stale_ms: AtomicU64,
}

impl Default for EngineLoad {
    fn default() -> Self {
        EngineLoad {
            running: AtomicU64::new(NONE),
            waiting: AtomicU64::new(NONE),
            kv_usage_ppm: AtomicU64::new(NONE),
            scraped_ms: AtomicU64::new(0),
            stale_ms: AtomicU64::new(0),
        }
    }
}

fn store(cell: &AtomicU64, v: Option<f64>, scale: f64) {
    cell.store(
        v.map_or(NONE, |v| (v * scale).round() as u64),
        Ordering::Relaxed,
    );
}

fn read(cell: &AtomicU64) -> Option<u64> {
    match cell.load(Ordering::Relaxed) {
        NONE => None,
        v => Some(v),
    }
}

impl EngineLoad {
    pub fn record(&self, g: &EngineGauges, stale: Duration) {
        store(&self.running, g.running, 1.0);
        store(&self.waiting, g.waiting, 1.0);
        store(&self.kv_usage_ppm, g.kv_usage, 1e6);
        self.stale_ms
            .store(stale.as_millis() as u64, Ordering::Relaxed);
        self.scraped_ms
            .store(crate::clock::now_ms(), Ordering::Relaxed);
    }

    /// Reads the clock only once a scrape has landed (never, with scraping off).
    pub fn fresh(&self) -> bool {
        let at = self.scraped_ms.load(Ordering::Relaxed);
        at != 0
            && crate::clock::now_ms().saturating_sub(at) <= self.stale_ms.load(Ordering::Relaxed)
    }

    fn fresh_at(&self, now_ms: u64) -> bool {
        let at = self.scraped_ms.load(Ordering::Relaxed);
        at != 0 && now_ms.saturating_sub(at) <= self.stale_ms.load(Ordering::Relaxed)
    }

    /// Running + waiting, when the last scrape is fresh and reported them; else 0.
    pub fn requests_if_fresh(&self) -> u64 {
        if self.fresh() {
            self.requests()
        } else {
            0
        }
    }

    /// [`Self::requests_if_fresh`] with the clock already read (`clock::now_ms`).
    pub fn requests_if_fresh_at(&self, now_ms: u64) -> u64 {
        if self.fresh_at(now_ms) {
            self.requests()
        } else {
            0
        }
    }

    fn requests(&self) -> u64 {
        read(&self.running).unwrap_or(0) + read(&self.waiting).unwrap_or(0)
    }

    /// The last scrape's figures when fresh: (running, waiting, KV usage 0..1).
    pub fn snapshot(&self) -> Option<(Option<u64>, Option<u64>, Option<f64>)> {
        self.fresh().then(|| {
            (
                read(&self.running),
                read(&self.waiting),
                read(&self.kv_usage_ppm).map(|p| p as f64 / 1e6),
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn reads_vllm_sglang_and_llamacpp_gauges() {
        let vllm = "# HELP vllm:num_requests_running x\n\
            vllm:num_requests_running{model_name=\"q\"} 3.0\n\
            vllm:num_requests_waiting{model_name=\"q\"} 2\n\
            vllm:kv_cache_usage_perc{model_name=\"q\"} 0.25\n\
            vllm:inter_token_latency_seconds_bucket{model_name=\"q\",le=\"0.01\"} 7\n\
            vllm:inter_token_latency_seconds_sum{model_name=\"q\"} 1.5\n\
            vllm:inter_token_latency_seconds_count{model_name=\"q\"} 30\n\
            vllm:num_requests_running_not_this 99\n";
        assert_eq!(
            EngineGauges::parse(vllm),
            EngineGauges {
                running: Some(3.0),
                waiting: Some(2.0),
                kv_usage: Some(0.25),
                decode_seconds: Some(1.5),
                decode_tokens: Some(30.0),
            }
        );
        let sglang = "sglang:num_running_reqs{tp_rank=\"0\"} 4\nsglang:num_queue_reqs{tp_rank=\"0\"} 7\nsglang:token_usage{tp_rank=\"0\"} 0.5\n";
        let g = EngineGauges::parse(sglang);
        assert_eq!(
            (g.running, g.waiting, g.kv_usage),
            (Some(4.0), Some(7.0), Some(0.5))
        );
        let llama = "llamacpp:requests_processing 2\nllamacpp:requests_deferred 1\nllamacpp:prompt_tokens_total 110\n\
            llamacpp:tokens_predicted_seconds_total 0.9\nllamacpp:tokens_predicted_total 45\n";
        let g = EngineGauges::parse(llama);
        assert_eq!(
            (g.running, g.waiting, g.kv_usage),
            (Some(2.0), Some(1.0), None)
        );
        assert_eq!((g.decode_seconds, g.decode_tokens), (Some(0.9), Some(45.0)));
        // A timestamp after the value; two models on one server: summed.
        assert_eq!(
            EngineGauges::parse("llamacpp:requests_deferred 5 1700000000000\n").waiting,
            Some(5.0)
        );
        let two = "vllm:num_requests_running{m=\"a\"} 1\nvllm:num_requests_running{m=\"b\"} 2\n";
        assert_eq!(EngineGauges::parse(two).running, Some(3.0));
        // Garbage is ignored, never an error.
        assert_eq!(
            EngineGauges::parse("\u{0}{{ NaN\nvllm:num_requests_running NaN\n"),
            EngineGauges::default()
        );
    }
    #[test]
    fn stale_or_missing_scrapes_count_as_unknown() {
        let l = EngineLoad::default();
        assert_eq!(l.requests_if_fresh(), 0);
        assert!(l.snapshot().is_none());
        let g = EngineGauges {
            running: Some(3.0),
            waiting: Some(4.0),
            kv_usage: Some(0.5),
            ..Default::default()
        };
        l.record(&g, Duration::from_secs(60));
        assert_eq!(l.requests_if_fresh(), 7);
        assert_eq!(l.snapshot(), Some((Some(3), Some(4), Some(0.5))));
        l.record(&g, Duration::ZERO);
        l.scraped_ms
            .store(crate::clock::now_ms().saturating_sub(10), Ordering::Relaxed);
        assert_eq!(l.requests_if_fresh(), 0, "too old to count");
    }
}
