//! OpenTelemetry traces (`telemetry`): a span per proxied request, in the
//! caller's W3C trace, with the GenAI semantic conventions, exported as
//! OTLP/HTTP protobuf.
//!
//! The request path only stamps ids and, at the end, builds one `SpanData`
//! and offers it to a bounded queue (never waiting: a full queue drops the
//! span and counts it). The [`SpanExport`] background service batches the
//! queue and posts it with the opentelemetry-otlp exporter. The engine gets a
//! `traceparent` naming the gateway's span as its parent, so its own spans
//! (vLLM's `--otlp-traces-endpoint`) nest under the gateway's.

use crate::config::TelemetryConfig;
use opentelemetry::trace::{
    SpanContext, SpanId, SpanKind, Status, TraceFlags, TraceId, TraceState,
};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter as _, SpanLinks};
use prometheus::IntCounter;
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};
use tokio::sync::mpsc;

/// Spans posted in one export at most.
const MAX_BATCH: usize = 512;
/// How long the first span of a batch waits for others.
const BATCH_DELAY: Duration = Duration::from_millis(500);

/// The tracer: sampling, the export queue and its counters.
pub struct Telemetry {
    tx: mpsc::Sender<SpanData>,
    rx: parking_lot::Mutex<Option<mpsc::Receiver<SpanData>>>,
    /// A new trace is sampled when the low 63 bits of its id fall below this.
    threshold: AtomicU64,
    scope: InstrumentationScope,
    config: TelemetryConfig,
    exported: IntCounter,
    dropped: IntCounter,
    failed: IntCounter,
}

/// A request's place in its trace, fixed when it arrives.
#[derive(Debug, Clone)]
pub struct RequestSpan {
    trace_id: TraceId,
    span_id: SpanId,
    /// The caller's span (`SpanId::INVALID`: the trace starts here).
    parent: SpanId,
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
            threshold: AtomicU64::new(threshold(config.sample_ratio)),
            scope: InstrumentationScope::builder("agent-gateway")
                .with_version(env!("CARGO_PKG_VERSION"))
                .build(),
            config: config.clone(),
            exported: spans("exported"),
            dropped: spans("dropped"),
            failed: spans("failed"),
        })
    }

    /// A reload's new sampling ratio (the endpoint needs a restart).
    pub fn set_sample_ratio(&self, ratio: f64) {
        self.threshold.store(threshold(ratio), Ordering::Relaxed);
    }

    /// The span of a request with these headers: a child of the caller's
    /// `traceparent` (whose sampled flag it follows), else the root of a new
    /// trace, sampled by `telemetry.sample_ratio`.
    pub fn start(&self, headers: &http::HeaderMap) -> RequestSpan {
        let span_id = SpanId::from_bytes(nonzero_u64().to_be_bytes());
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
                let id = (u128::from(nonzero_u64()) << 64) | u128::from(rand::random::<u64>());
                RequestSpan {
                    trace_id: TraceId::from_bytes(id.to_be_bytes()),
                    span_id,
                    parent: SpanId::INVALID,
                    sampled: ((id as u64) >> 1) < self.threshold.load(Ordering::Relaxed),
                    start,
                }
            }
        }
    }

    /// End a request's span: a sampled one is queued for export (or dropped
    /// and counted when the queue is full); the request never waits.
    pub fn end(&self, span: &RequestSpan, headers: &http::HeaderMap, f: &Finished<'_>) {
        if !span.sampled {
            return;
        }
        let trace_state = headers
            .get("tracestate")
            .filter(|_| span.parent != SpanId::INVALID)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<TraceState>().ok())
            .unwrap_or_default();
        let data = SpanData {
            span_context: SpanContext::new(
                span.trace_id,
                span.span_id,
                TraceFlags::SAMPLED,
                false,
                trace_state,
            ),
            parent_span_id: span.parent,
            parent_span_is_remote: span.parent != SpanId::INVALID,
            span_kind: SpanKind::Server,
            name: Cow::Owned(span_name(f)),
            start_time: span.start,
            end_time: SystemTime::now(),
            attributes: attributes(f),
            dropped_attributes_count: 0,
            events: SpanEvents::default(),
            links: SpanLinks::default(),
            status: if f.status >= 500 || f.status == 0 {
                Status::error(f.error_code.unwrap_or("no answer").to_string())
            } else {
                Status::Unset
            },
            instrumentation_scope: self.scope.clone(),
        };
        if self.tx.try_send(data).is_err() {
            self.dropped.inc();
        }
    }

    fn exporter(&self) -> Result<opentelemetry_otlp::SpanExporter, String> {
        use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
        let otlp = self.config.otlp.as_ref().ok_or("no OTLP endpoint")?;
        let mut exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(OtlpClient {
                client: reqwest::Client::builder()
                    .timeout(otlp.timeout)
                    .pool_max_idle_per_host(1)
                    .build()
                    .map_err(|e| e.to_string())?,
            })
            .with_endpoint(otlp.traces_url.clone())
            .with_protocol(Protocol::HttpBinary)
            .with_timeout(otlp.timeout)
            .build()
            .map_err(|e| e.to_string())?;
        exporter.set_resource(
            &opentelemetry_sdk::Resource::builder()
                .with_service_name(self.config.service_name.clone())
                .build(),
        );
        Ok(exporter)
    }
}

impl RequestSpan {
    /// The `traceparent` the backend gets: this trace, the gateway's span
    /// as the parent, this request's sampling decision.
    pub fn traceparent(&self) -> http::HeaderValue {
        let v = format!(
            "00-{}-{}-{:02x}",
            self.trace_id,
            self.span_id,
            u8::from(self.sampled)
        );
        http::HeaderValue::from_str(&v).expect("hex digits and dashes are a valid header value")
    }

    /// The trace's id, 32 hex digits.
    pub fn trace_id(&self) -> String {
        self.trace_id.to_string()
    }

    pub fn sampled(&self) -> bool {
        self.sampled
    }
}

/// The caller's W3C `traceparent`: trace id, parent span id, sampled. One
/// that is absent, repeated or malformed starts a new trace (W3C §3.2).
fn parent_of(headers: &http::HeaderMap) -> Option<(TraceId, SpanId, bool)> {
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
    let hex = |b: &[u8]| -> Option<u128> {
        if b.iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
        {
            u128::from_str_radix(std::str::from_utf8(b).ok()?, 16).ok()
        } else {
            None
        }
    };
    let version = hex(&v[..2])?;
    if version == 0xff || (version == 0 && v.len() != 55) {
        return None;
    }
    let trace = hex(&v[3..35])?;
    let parent = hex(&v[36..52])? as u64;
    let flags = hex(&v[53..55])? as u8;
    if trace == 0 || parent == 0 {
        return None;
    }
    Some((
        TraceId::from_bytes(trace.to_be_bytes()),
        SpanId::from_bytes(parent.to_be_bytes()),
        flags & 1 == 1,
    ))
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

/// GenAI convention: `{gen_ai.operation.name} {gen_ai.request.model}`;
/// other requests: `{method} {path}`.
fn span_name(f: &Finished<'_>) -> String {
    match (operation(f.path), f.model) {
        (Some((op, _)), Some(model)) => format!("{op} {model}"),
        (Some((op, _)), None) => op.to_string(),
        (None, _) => format!("{} {}", f.method, f.path),
    }
}

fn attributes(f: &Finished<'_>) -> Vec<KeyValue> {
    let mut a = Vec::with_capacity(20);
    if let Some((op, provider)) = operation(f.path) {
        a.push(KeyValue::new("gen_ai.operation.name", op));
        a.push(KeyValue::new("gen_ai.provider.name", provider));
    }
    if let Some(model) = f.model {
        a.push(KeyValue::new("gen_ai.request.model", model.to_string()));
    }
    if let Some((input, output, cached)) = f.usage {
        a.push(KeyValue::new("gen_ai.usage.input_tokens", input as i64));
        a.push(KeyValue::new("gen_ai.usage.output_tokens", output as i64));
        if let Some(cached) = cached {
            a.push(KeyValue::new(
                "gen_ai.usage.cache_read.input_tokens",
                cached as i64,
            ));
        }
    }
    a.push(KeyValue::new("http.request.method", f.method.to_string()));
    a.push(KeyValue::new("url.path", f.path.to_string()));
    if f.status != 0 {
        a.push(KeyValue::new(
            "http.response.status_code",
            i64::from(f.status),
        ));
    }
    if f.status >= 500 || f.status == 0 {
        let kind = f
            .error_code
            .map_or_else(|| f.status.to_string(), str::to_string);
        a.push(KeyValue::new("error.type", kind));
    }
    a.push(KeyValue::new(
        "agent_gateway.request_id",
        f.request_id.to_string(),
    ));
    if let Some(tier) = f.tier {
        a.push(KeyValue::new("agent_gateway.tier", tier.to_string()));
    }
    if let Some((id, addr)) = f.backend {
        a.push(KeyValue::new("server.address", addr.ip().to_string()));
        a.push(KeyValue::new("server.port", i64::from(addr.port())));
        a.push(KeyValue::new("agent_gateway.backend", id.to_string()));
        a.push(KeyValue::new("agent_gateway.affinity_hit", f.affinity_hit));
        a.push(KeyValue::new(
            "agent_gateway.queue_wait_ms",
            f.queue_wait.as_secs_f64() * 1000.0,
        ));
    }
    if let Some(reason) = f.reason {
        a.push(KeyValue::new("agent_gateway.reason", reason.to_string()));
    }
    if let Some(session) = f.session {
        a.push(KeyValue::new("agent_gateway.session", session.to_string()));
    }
    a
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
        let exporter = match t.exporter() {
            Ok(e) => e,
            Err(e) => {
                log::error!("telemetry: no OTLP exporter, spans are dropped: {e}");
                return;
            }
        };
        loop {
            let first = tokio::select! {
                s = rx.recv() => s,
                _ = shutdown.changed() => None,
            };
            let Some(first) = first else { break };
            let mut batch = vec![first];
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
            t.export(&exporter, batch).await;
        }
        // Shutting down: what is queued goes out in one last round.
        let mut batch = Vec::new();
        while let Ok(s) = rx.try_recv() {
            batch.push(s);
            if batch.len() == MAX_BATCH {
                t.export(&exporter, std::mem::take(&mut batch)).await;
            }
        }
        if !batch.is_empty() {
            t.export(&exporter, batch).await;
        }
    }
}

impl Telemetry {
    async fn export(&self, exporter: &opentelemetry_otlp::SpanExporter, batch: Vec<SpanData>) {
        let n = batch.len() as u64;
        match exporter.export(batch).await {
            Ok(()) => self.exported.inc_by(n),
            Err(e) => {
                self.failed.inc_by(n);
                log::warn!("telemetry: exporting {n} spans failed: {e}");
            }
        }
    }
}

/// The exporter's HTTP client: the gateway's own reqwest, bounded by the
/// export timeout (the collector's answer is read whole, capped).
#[derive(Debug)]
struct OtlpClient {
    client: reqwest::Client,
}

const MAX_COLLECTOR_ANSWER: usize = 1 << 20;

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for OtlpClient {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let (parts, body) = request.into_parts();
        let mut resp = self
            .client
            .request(parts.method, parts.uri.to_string())
            .headers(parts.headers)
            .body(body)
            .send()
            .await?;
        let mut answer = http::Response::builder().status(resp.status());
        if let Some(h) = answer.headers_mut() {
            *h = std::mem::take(resp.headers_mut());
        }
        let mut body = Vec::new();
        while let Some(chunk) = resp.chunk().await? {
            if body.len() + chunk.len() > MAX_COLLECTOR_ANSWER {
                return Err("the collector's answer is over 1 MiB".into());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(answer.body(bytes::Bytes::from(body))?)
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
        assert_eq!(trace.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(parent.to_string(), "00f067aa0ba902b7");
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
        assert_eq!(span_name(&f), "chat m");
    }
}
