//! OpenTelemetry traces (`telemetry`): a span per proxied request, in the
//! caller's W3C trace, with the GenAI semantic conventions, exported as
//! OTLP/HTTP protobuf.
//!
//! The request path stamps ids when a request arrives and, when it ends,
//! encodes its span (see `otlp.rs`) and offers the bytes to a bounded queue,
//! never waiting: a full queue drops the span and counts it. The
//! [`SpanExport`] background service batches the queue and posts it to the
//! collector. The engine gets a `traceparent` naming the gateway's span as
//! its parent, so its own spans (vLLM's `--otlp-traces-endpoint`) nest under
//! the gateway's.

mod otlp;

use crate::config::TelemetryConfig;
use otlp::{span, Pb, Value};
use prometheus::IntCounter;
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;

/// Spans posted in one export at most.
const MAX_BATCH: usize = 512;
/// How long the first span of a batch waits for others.
const BATCH_DELAY: Duration = Duration::from_millis(500);
/// The collector's answer is read up to this much.
const MAX_COLLECTOR_ANSWER: usize = 1 << 20;

/// The tracer: sampling, the export queue and its counters.
pub struct Telemetry {
    tx: mpsc::Sender<Vec<u8>>,
    rx: parking_lot::Mutex<Option<mpsc::Receiver<Vec<u8>>>>,
    /// A new trace is sampled when the low 63 bits of its id fall below this.
    threshold: std::sync::atomic::AtomicU64,
    config: TelemetryConfig,
    exported: IntCounter,
    dropped: IntCounter,
    failed: IntCounter,
}

/// A request's place in its trace, fixed when it arrives.
#[derive(Debug, Clone)]
pub struct RequestSpan {
    trace_id: u128,
    span_id: u64,
    /// The caller's span (0: the trace starts here).
    parent: u64,
    sampled: bool,
    start: SystemTime,
}

/// What a finished request tells its span.
pub struct Finished<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub model: Option<&'a str>,
    pub status: u16,
    /// The gateway's own error code, when it answered one.
    pub error_code: Option<&'a str>,
    pub request_id: &'a str,
    pub tier: Option<&'a str>,
    /// The chosen backend's id and address.
    pub backend: Option<(&'a str, std::net::SocketAddr)>,
    pub affinity_hit: bool,
    pub reason: Option<&'a str>,
    pub session: Option<&'a str>,
    pub queue_wait: Duration,
    /// Input, output and cached input tokens (`None`: not reported).
    pub usage: Option<(u64, u64, Option<u64>)>,
}

impl Telemetry {
    /// `None` when no OTLP endpoint is configured (nor in the environment).
    pub fn new(config: &TelemetryConfig, metrics: &crate::metrics::Metrics) -> Option<Telemetry> {
        config.otlp.as_ref()?;
        let (tx, rx) = mpsc::channel(config.max_queued_spans);
        let spans = |result| metrics.otel_spans.with_label_values(&[result]);
        Some(Telemetry {
            tx,
            rx: parking_lot::Mutex::new(Some(rx)),
            threshold: threshold(config.sample_ratio).into(),
            config: config.clone(),
            exported: spans("exported"),
            dropped: spans("dropped"),
            failed: spans("failed"),
        })
    }

    /// A reload's new sampling ratio (the endpoint needs a restart).
    pub fn set_sample_ratio(&self, ratio: f64) {
        self.threshold
            .store(threshold(ratio), std::sync::atomic::Ordering::Relaxed);
    }

    /// The span of a request with these headers: a child of the caller's
    /// `traceparent` (whose sampled flag it follows), else the root of a new
    /// trace, sampled by `telemetry.sample_ratio`.
    pub fn start(&self, headers: &http::HeaderMap) -> RequestSpan {
        let span_id = nonzero_u64();
        let start = SystemTime::now();
        match parent_of(headers) {
            Some((trace_id, parent, sampled)) => RequestSpan {
                trace_id,
                span_id,
                parent,
                sampled,
                start,
            },
            None => {
                let trace_id =
                    (u128::from(nonzero_u64()) << 64) | u128::from(rand::random::<u64>());
                let threshold = self.threshold.load(std::sync::atomic::Ordering::Relaxed);
                RequestSpan {
                    trace_id,
                    span_id,
                    parent: 0,
                    sampled: ((trace_id as u64) >> 1) < threshold,
                    start,
                }
            }
        }
    }

    /// End a request's span: a sampled one is encoded and queued for export
    /// (or dropped and counted when the queue is full); the request never
    /// waits.
    pub fn end(&self, span: &RequestSpan, headers: &http::HeaderMap, f: &Finished<'_>) {
        if !span.sampled {
            return;
        }
        let trace_state = headers
            .get("tracestate")
            .filter(|_| span.parent != 0)
            .and_then(|v| v.to_str().ok());
        if self.tx.try_send(encode(span, trace_state, f)).is_err() {
            self.dropped.inc();
        }
    }

    /// Post one batch; count its spans exported or failed.
    async fn export(&self, client: &reqwest::Client, spans: &[Vec<u8>]) {
        let Some(otlp) = &self.config.otlp else {
            return;
        };
        let n = spans.len() as u64;
        let body = otlp::export_request(
            &[
                ("service.name", &self.config.service_name),
                ("service.version", env!("CARGO_PKG_VERSION")),
                ("telemetry.sdk.name", "agent-gateway"),
                ("telemetry.sdk.language", "rust"),
            ],
            ("agent-gateway", env!("CARGO_PKG_VERSION")),
            spans,
        );
        let mut req = client
            .post(&otlp.traces_url)
            .header(http::header::CONTENT_TYPE, "application/x-protobuf")
            .body(body);
        for (k, v) in &otlp.headers {
            req = req.header(k, v);
        }
        let outcome = async {
            let mut resp = req.send().await.map_err(|e| e.to_string())?;
            let status = resp.status();
            // Read (a bounded part of) the answer so the connection is reused.
            let mut read = 0;
            while let Some(chunk) = resp.chunk().await.map_err(|e| e.to_string())? {
                read += chunk.len();
                if read > MAX_COLLECTOR_ANSWER {
                    break;
                }
            }
            if status.is_success() {
                Ok(())
            } else {
                Err(format!("the collector answered {status}"))
            }
        };
        match tokio::time::timeout(otlp.timeout, outcome).await {
            Ok(Ok(())) => self.exported.inc_by(n),
            Ok(Err(e)) => {
                self.failed.inc_by(n);
                log::warn!(
                    "telemetry: exporting {n} spans to {} failed: {e}",
                    otlp.traces_url
                );
            }
            Err(_) => {
                self.failed.inc_by(n);
                log::warn!(
                    "telemetry: exporting {n} spans to {} timed out",
                    otlp.traces_url
                );
            }
        }
    }
}

impl RequestSpan {
    /// The `traceparent` the backend gets: this trace, the gateway's span
    /// as the parent, this request's sampling decision.
    pub fn traceparent(&self) -> http::HeaderValue {
        let mut v = [0u8; 55];
        v[..3].copy_from_slice(b"00-");
        hex(&self.trace_id.to_be_bytes(), &mut v[3..35]);
        v[35] = b'-';
        hex(&self.span_id.to_be_bytes(), &mut v[36..52]);
        v[52..54].copy_from_slice(b"-0");
        v[54] = if self.sampled { b'1' } else { b'0' };
        http::HeaderValue::from_bytes(&v).expect("hex digits and dashes are a valid header value")
    }

    /// The trace's id, 32 hex digits.
    pub fn trace_id(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    pub fn sampled(&self) -> bool {
        self.sampled
    }
}

fn hex(bytes: &[u8], out: &mut [u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in bytes.iter().enumerate() {
        out[2 * i] = DIGITS[usize::from(b >> 4)];
        out[2 * i + 1] = DIGITS[usize::from(b & 0xf)];
    }
}

/// The caller's W3C `traceparent`: trace id, parent span id, sampled. One
/// that is absent, repeated or malformed starts a new trace (W3C §3.2).
fn parent_of(headers: &http::HeaderMap) -> Option<(u128, u64, bool)> {
    let mut all = headers.get_all("traceparent").iter();
    let v = all.next()?.as_bytes();
    if all.next().is_some() {
        return None;
    }
    // version "-" trace-id "-" parent-id "-" flags; a later version may add
    // fields after a dash, version ff is invalid.
    if v.len() < 55
        || (v.len() > 55 && v[55] != b'-')
        || v[2] != b'-'
        || v[35] != b'-'
        || v[52] != b'-'
    {
        return None;
    }
    let number = |b: &[u8]| -> Option<u128> {
        if b.iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
        {
            u128::from_str_radix(std::str::from_utf8(b).ok()?, 16).ok()
        } else {
            None
        }
    };
    let version = number(&v[..2])?;
    if version == 0xff || (version == 0 && v.len() != 55) {
        return None;
    }
    let trace = number(&v[3..35])?;
    let parent = number(&v[36..52])? as u64;
    let flags = number(&v[53..55])? as u8;
    if trace == 0 || parent == 0 {
        return None;
    }
    Some((trace, parent, flags & 1 == 1))
}

fn threshold(ratio: f64) -> u64 {
    (ratio.clamp(0.0, 1.0) * (1u64 << 63) as f64) as u64
}

fn nonzero_u64() -> u64 {
    loop {
        let v = rand::random::<u64>();
        if v != 0 {
            return v;
        }
    }
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// `gen_ai.operation.name` and `gen_ai.provider.name` of an API path.
fn operation(path: &str) -> Option<(&'static str, &'static str)> {
    let path = path.trim_end_matches('/');
    Some(
        if path.ends_with("/chat/completions") || path.ends_with("/responses") {
            ("chat", "openai")
        } else if path.ends_with("/messages") {
            ("chat", "anthropic")
        } else if path.ends_with("/completions") {
            ("text_completion", "openai")
        } else if path.ends_with("/embeddings") {
            ("embeddings", "openai")
        } else {
            return None;
        },
    )
}

/// The bytes of the request's `Span` message. Named by the GenAI
/// convention, `{gen_ai.operation.name} {gen_ai.request.model}`; other
/// requests `{method} {path}`.
fn encode(s: &RequestSpan, trace_state: Option<&str>, f: &Finished<'_>) -> Vec<u8> {
    let mut pb = Pb::with_capacity(768);
    pb.bytes(span::TRACE_ID, &s.trace_id.to_be_bytes());
    pb.bytes(span::SPAN_ID, &s.span_id.to_be_bytes());
    if let Some(ts) = trace_state {
        pb.string(span::TRACE_STATE, ts);
    }
    if s.parent != 0 {
        pb.bytes(span::PARENT_SPAN_ID, &s.parent.to_be_bytes());
    }
    let op = operation(f.path);
    match (op, f.model) {
        (Some((op, _)), Some(model)) => pb.string_of(span::NAME, &[op, " ", model]),
        (Some((op, _)), None) => pb.string(span::NAME, op),
        (None, _) => pb.string_of(span::NAME, &[f.method, " ", f.path]),
    }
    pb.uint(span::KIND, span::KIND_SERVER);
    pb.fixed64(span::START, unix_nanos(s.start));
    pb.fixed64(span::END, unix_nanos(SystemTime::now()));
    let mut attr = |key: &str, v: Value<'_>| pb.attr(span::ATTRIBUTES, key, v);
    if let Some((op, provider)) = op {
        attr("gen_ai.operation.name", Value::Str(op));
        attr("gen_ai.provider.name", Value::Str(provider));
    }
    if let Some(model) = f.model {
        attr("gen_ai.request.model", Value::Str(model));
    }
    if let Some((input, output, cached)) = f.usage {
        attr("gen_ai.usage.input_tokens", Value::Int(input as i64));
        attr("gen_ai.usage.output_tokens", Value::Int(output as i64));
        if let Some(cached) = cached {
            attr(
                "gen_ai.usage.cache_read.input_tokens",
                Value::Int(cached as i64),
            );
        }
    }
    attr("http.request.method", Value::Str(f.method));
    attr("url.path", Value::Str(f.path));
    if f.status != 0 {
        attr("http.response.status_code", Value::Int(i64::from(f.status)));
    }
    let failed = f.status >= 500 || f.status == 0;
    let status_text;
    let error = match f.error_code {
        Some(code) => code,
        None if f.status == 0 => "no answer",
        None => {
            status_text = f.status.to_string();
            &status_text
        }
    };
    if failed {
        attr("error.type", Value::Str(error));
    }
    attr("agent_gateway.request_id", Value::Str(f.request_id));
    if let Some(tier) = f.tier {
        attr("agent_gateway.tier", Value::Str(tier));
    }
    if let Some((id, addr)) = f.backend {
        attr("server.address", Value::Str(&addr.ip().to_string()));
        attr("server.port", Value::Int(i64::from(addr.port())));
        attr("agent_gateway.backend", Value::Str(id));
        attr("agent_gateway.affinity_hit", Value::Bool(f.affinity_hit));
        attr(
            "agent_gateway.queue_wait_ms",
            Value::Double(f.queue_wait.as_secs_f64() * 1000.0),
        );
    }
    if let Some(reason) = f.reason {
        attr("agent_gateway.reason", Value::Str(reason));
    }
    if let Some(session) = f.session {
        attr("agent_gateway.session", Value::Str(session));
    }
    if failed {
        pb.message(span::STATUS, |st| {
            st.string(span::STATUS_MESSAGE, error);
            st.uint(span::STATUS_CODE, span::STATUS_ERROR);
        });
    }
    let remote = if s.parent != 0 {
        span::FLAGS_IS_REMOTE
    } else {
        0
    };
    pb.fixed32(span::FLAGS, 1 | span::FLAGS_HAS_IS_REMOTE | remote);
    pb.buf
}

/// Batches finished spans and posts them to the collector.
pub struct SpanExport(pub std::sync::Arc<Telemetry>);

#[async_trait::async_trait]
impl pingora_core::services::background::BackgroundService for SpanExport {
    async fn start(&self, mut shutdown: pingora_core::server::ShutdownWatch) {
        let t = &self.0;
        let Some(mut rx) = t.rx.lock().take() else {
            return;
        };
        let client = match reqwest::Client::builder().pool_max_idle_per_host(1).build() {
            Ok(c) => c,
            Err(e) => {
                log::error!("telemetry: no HTTP client, spans are dropped: {e}");
                return;
            }
        };
        let mut batch = Vec::with_capacity(MAX_BATCH);
        loop {
            let first = tokio::select! {
                s = rx.recv() => s,
                _ = shutdown.changed() => None,
            };
            let Some(first) = first else { break };
            batch.push(first);
            let deadline = tokio::time::Instant::now() + BATCH_DELAY;
            while batch.len() < MAX_BATCH {
                tokio::select! {
                    s = rx.recv() => match s {
                        Some(s) => batch.push(s),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(deadline) => break,
                }
            }
            t.export(&client, &batch).await;
            batch.clear();
        }
        // Shutting down: what is queued goes out in one last round.
        while let Ok(s) = rx.try_recv() {
            batch.push(s);
            if batch.len() == MAX_BATCH {
                t.export(&client, &batch).await;
                batch.clear();
            }
        }
        if !batch.is_empty() {
            t.export(&client, &batch).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(tp: &[&str]) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        for v in tp {
            h.append("traceparent", v.parse().unwrap());
        }
        h
    }

    #[test]
    fn a_callers_traceparent_is_the_parent_and_its_sampled_flag_is_followed() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let (trace, parent, sampled) = parent_of(&headers(&[tp])).unwrap();
        assert_eq!(format!("{trace:032x}"), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(format!("{parent:016x}"), "00f067aa0ba902b7");
        assert!(sampled);
        let off = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        assert!(!parent_of(&headers(&[off])).unwrap().2);
        // A later version may append fields.
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra";
        assert!(parent_of(&headers(&[later])).is_some());
    }

    #[test]
    fn a_malformed_or_repeated_traceparent_starts_a_new_trace() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert!(parent_of(&headers(&[bad])).is_none(), "{bad:?}");
        }
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(parent_of(&headers(&[tp, tp])).is_none());
    }

    fn telemetry(ratio: f64) -> Telemetry {
        let cfg = TelemetryConfig {
            otlp: Some(crate::config::OtlpConfig {
                traces_url: "http://127.0.0.1:1/v1/traces".into(),
                timeout: Duration::from_secs(1),
                headers: Vec::new(),
            }),
            sample_ratio: ratio,
            max_queued_spans: 2,
            service_name: "t".into(),
        };
        Telemetry::new(&cfg, &crate::metrics::Metrics::new()).unwrap()
    }

    #[test]
    fn new_traces_are_sampled_at_the_configured_ratio() {
        let count = |t: &Telemetry| {
            (0..4000)
                .filter(|_| t.start(&http::HeaderMap::new()).sampled)
                .count()
        };
        assert_eq!(count(&telemetry(1.0)), 4000);
        assert_eq!(count(&telemetry(0.0)), 0);
        let quarter = count(&telemetry(0.25));
        assert!((800..1200).contains(&quarter), "{quarter} of 4000");
    }

    #[test]
    fn the_backends_traceparent_names_the_gateways_span_in_the_callers_trace() {
        let t = telemetry(0.0);
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let span = t.start(&headers(&[tp]));
        let up = span.traceparent();
        let up = up.to_str().unwrap();
        assert_eq!(up.len(), 55);
        assert!(
            up.starts_with("00-4bf92f3577b34da6a3ce929d0e0e4736-"),
            "{up}"
        );
        assert!(up.ends_with("-01"), "the caller sampled it: {up}");
        assert_ne!(&up[36..52], "00f067aa0ba902b7", "the gateway's own span");
        assert!(parent_of(&headers(&[up])).is_some(), "well-formed: {up}");
    }

    #[test]
    fn a_full_queue_drops_spans_and_counts_them_without_waiting() {
        let t = telemetry(1.0);
        let f = Finished {
            method: "POST",
            path: "/v1/chat/completions",
            model: Some("m"),
            status: 200,
            error_code: None,
            request_id: "r",
            tier: Some("default"),
            backend: None,
            affinity_hit: false,
            reason: None,
            session: None,
            queue_wait: Duration::ZERO,
            usage: None,
        };
        for _ in 0..5 {
            let span = t.start(&http::HeaderMap::new());
            t.end(&span, &http::HeaderMap::new(), &f);
        }
        assert_eq!(t.dropped.get(), 3, "a queue of 2 holds 2 of 5");
    }
}
