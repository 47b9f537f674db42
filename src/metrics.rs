//! Every metric the gateway exports (SPEC §5), defined in one place, and the
//! `GET /metrics` listener. Names are fixed: dashboards depend on them.

use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Request duration buckets: LLM requests run from milliseconds to minutes.
const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
];

pub struct Metrics {
    pub registry: Registry,
    pub affinity_hits: IntCounterVec,
    pub affinity_misses: IntCounterVec,
    pub affinity_broken: IntCounterVec,
    pub affinity_moves: IntCounterVec,
    pub bindings_evicted: IntCounterVec,
    pub requests: IntCounterVec,
    pub gateway_errors: IntCounterVec,
    pub request_duration: HistogramVec,
    pub time_to_first_byte: HistogramVec,
    pub bindings: IntGaugeVec,
    pub backend_healthy: IntGaugeVec,
    pub backend_in_flight: IntGaugeVec,
    pub prompt_tokens: IntCounterVec,
    pub cached_prompt_tokens: IntCounterVec,
    pub config_reloads: IntCounterVec,
    pub upstream_retries: IntCounterVec,
    pub backend_bindings: IntGaugeVec,
    pub backend_engine_requests: IntGaugeVec,
    pub backend_kv_usage: GaugeVec,
    pub backend_prefill_cost: GaugeVec,
    pub backend_queue: GaugeVec,
    pub load_scrape_failures: IntCounterVec,
    pub otel_spans: IntCounterVec,
    pub discovery_backends: IntGaugeVec,
    pub discovery_stale: IntGaugeVec,
    pub discovery_refreshes: IntCounterVec,
    pub backend_ejections: IntCounterVec,
    pub backend_ejected: IntGaugeVec,
    pub timeouts: IntCounterVec,
    pub connections_refused: IntCounterVec,
    pub store_ops: IntCounterVec,
    pub store_errors: IntCounterVec,
    pub store_latency: HistogramVec,
    pub store_unsynced_dropped: IntCounter,
    pub tenant_limits_local: IntCounter,
    pub websockets: IntCounter,
    pub store_reseeds: IntCounter,
    pub store_up: IntGaugeVec,
    pub prefix_index_entries: IntGaugeVec,
    pub prefix_index_bytes: IntGaugeVec,
    pub prefix_conversations: IntGaugeVec,
    pub prefix_probation: IntGaugeVec,
    pub prefix_index_evictions: IntCounterVec,
    pub prefix_index_lookups: IntCounterVec,
    pub prefix_index_corrections: IntCounterVec,
    pub admission_queued: IntGaugeVec,
    pub admission_wait: HistogramVec,
    pub admission_admitted: IntCounterVec,
    pub admission_rejected: IntCounterVec,
    pub client_rejected: IntCounterVec,
    pub tenant_requests: IntCounterVec,
    pub tenant_tokens: IntCounterVec,
    pub kv_events: IntCounterVec,
    pub kv_index_exact: IntGaugeVec,
    pub kv_replayed: IntCounterVec,
    pub kv_connections_lost: IntCounterVec,
    pub kv_predictions: IntCounterVec,
}

/// A tier's hot-path counters, resolved once per config load.
#[derive(Clone)]
pub struct TierMetrics {
    pub hits: IntCounter,
    pub misses: IntCounter,
    pub broken: IntCounter,
    pub duration: Histogram,
    pub ttfb: Histogram,
    /// `agentserve_prefix_index_lookups_total{result="matched"|"none"}`.
    pub prefix_matched: IntCounter,
    pub prefix_none: IntCounter,
    /// `agentserve_admission_admitted_total{path="now"}` by class.
    pub admitted_now: [IntCounter; 3],
    /// `agentserve_kv_predictions_total`: `[index, events][right, wrong]`.
    pub predictions: [[IntCounter; 2]; 2],
}

/// The `class` label's values, in the order of `admission::Class::ALL`
/// (its unit tests hold the two together).
pub const CLASS_LABELS: [&str; 3] = ["interactive", "normal", "batch"];

/// A tenant's counters (`agentserve_tenant_*`), resolved once.
pub struct TenantCounters {
    pub requests: IntCounter,
    pub prompt_tokens: IntCounter,
    pub completion_tokens: IntCounter,
}

/// One backend's per-request counters in one tier, each resolved from its
/// labels on first use: a label lookup per request costs more than the rest
/// of the accounting at proxy speeds.
#[derive(Default)]
pub struct BackendCounters {
    ok_requests: std::sync::OnceLock<IntCounter>,
    prompt_tokens: std::sync::OnceLock<IntCounter>,
    cached_prompt_tokens: std::sync::OnceLock<IntCounter>,
}

impl BackendCounters {
    /// `agentserve_requests_total{tier, backend, status="200"}`.
    pub fn ok_requests(&self, m: &Metrics, tier: &str, backend: &str) -> &IntCounter {
        self.ok_requests
            .get_or_init(|| m.requests.with_label_values(&[tier, backend, "200"]))
    }

    pub fn prompt_tokens(&self, m: &Metrics, tier: &str, backend: &str) -> &IntCounter {
        self.prompt_tokens
            .get_or_init(|| m.prompt_tokens.with_label_values(&[tier, backend]))
    }

    pub fn cached_prompt_tokens(&self, m: &Metrics, tier: &str, backend: &str) -> &IntCounter {
        self.cached_prompt_tokens
            .get_or_init(|| m.cached_prompt_tokens.with_label_values(&[tier, backend]))
    }
}

fn plain_counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn float_gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> GaugeVec {
    let g = GaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

fn histogram(r: &Registry, name: &str, help: &str, labels: &[&str]) -> HistogramVec {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(DURATION_BUCKETS.to_vec()),
        labels,
    )
    .expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

impl Metrics {
    pub fn new() -> Self {
        let r = Registry::new();
        Metrics {
            affinity_hits: counter(
                &r,
                "agentserve_affinity_hits_total",
                "Requests that reused a live session binding",
                &["tier"],
            ),
            affinity_misses: counter(
                &r,
                "agentserve_affinity_misses_total",
                "Requests that needed a new binding (first turn, expired, or replaced)",
                &["tier"],
            ),
            affinity_broken: counter(
                &r,
                "agentserve_affinity_broken_total",
                "Bindings invalidated because the backend went down, was removed or failed",
                &["tier"],
            ),
            affinity_moves: counter(
                &r,
                "agentserve_affinity_moves_total",
                "Live bindings deliberately moved to another backend",
                &["tier", "reason"],
            ),
            bindings_evicted: counter(
                &r,
                "agentserve_bindings_evicted_total",
                "Idle bindings evicted because the table was full",
                &["tier"],
            ),
            requests: counter(
                &r,
                "agentserve_requests_total",
                "Requests by tier, backend and response status",
                &["tier", "backend", "status"],
            ),
            gateway_errors: counter(
                &r,
                "agentserve_gateway_errors_total",
                "Error responses the gateway produced itself, by status",
                &["tier", "status"],
            ),
            request_duration: histogram(
                &r,
                "agentserve_request_duration_seconds",
                "Time from request start to the last response byte",
                &["tier"],
            ),
            time_to_first_byte: histogram(
                &r,
                "agentserve_time_to_first_byte_seconds",
                "Time from request start to the first response body byte",
                &["tier"],
            ),
            bindings: gauge(
                &r,
                "agentserve_bindings",
                "Live session bindings",
                &["tier"],
            ),
            backend_healthy: gauge(
                &r,
                "agentserve_backend_healthy",
                "1 when the backend passes health checks",
                &["tier", "backend"],
            ),
            backend_in_flight: gauge(
                &r,
                "agentserve_backend_in_flight",
                "Requests in flight to the backend",
                &["tier", "backend"],
            ),
            prompt_tokens: counter(
                &r,
                "agentserve_prompt_tokens_total",
                "Prompt tokens reported in responses' usage",
                &["tier", "backend"],
            ),
            backend_bindings: gauge(
                &r,
                "agentserve_backend_bindings",
                "Live session bindings per backend (the sessions placement balances)",
                &["tier", "backend"],
            ),
            backend_engine_requests: gauge(
                &r,
                "agentserve_backend_engine_requests",
                "Requests the engine itself reports running or waiting (-1: not reported or stale)",
                &["tier", "backend", "state"],
            ),
            kv_events: counter(
                &r,
                "agentserve_kv_events_total",
                "KV-cache events applied from an engine (its kv_events)",
                &["tier", "backend"],
            ),
            kv_index_exact: gauge(
                &r,
                "agentserve_kv_index_exact",
                "1 while the backend's cache holdings come from its own current KV events, 0 while they are inferred",
                &["tier", "backend"],
            ),
            kv_replayed: counter(
                &r,
                "agentserve_kv_replayed_batches_total",
                "KV event batches missed live and recovered from the engine's replay socket",
                &["tier", "backend"],
            ),
            kv_connections_lost: counter(
                &r,
                "agentserve_kv_connections_lost_total",
                "Connections to an engine's KV-event publisher lost: closed, or dropped for a message over kv_events.max_message_bytes or one not understood",
                &["tier", "backend"],
            ),
            kv_predictions: counter(
                &r,
                "agentserve_kv_predictions_total",
                "Answered turns by whether the cached share of their prompt the gateway predicted was within 0.1 of what the engine reported (source: events or index)",
                &["tier", "source", "outcome"],
            ),
            backend_kv_usage: float_gauge(
                &r,
                "agentserve_backend_kv_usage_ratio",
                "KV-cache usage the engine reports, 0..1 (-1: not reported or stale)",
                &["tier", "backend"],
            ),
            backend_prefill_cost: float_gauge(
                &r,
                "agentserve_backend_prefill_seconds_per_token",
                "Learned prefill cost per uncached prompt token (-1: not learned yet, fewer than 5 responses and 4,096 explained tokens)",
                &["tier", "backend"],
            ),
            backend_queue: float_gauge(
                &r,
                "agentserve_backend_queue_seconds",
                "Learned queueing delay before a request's prefill starts (moving average)",
                &["tier", "backend"],
            ),
            discovery_backends: gauge(
                &r,
                "agentserve_discovery_backends",
                "Backends a discovering tier has: the addresses of its last good DNS answer",
                &["tier"],
            ),
            discovery_stale: gauge(
                &r,
                "agentserve_discovery_stale",
                "1 while a discovering tier keeps an earlier answer because its latest lookup failed or came back empty",
                &["tier"],
            ),
            discovery_refreshes: counter(
                &r,
                "agentserve_discovery_refreshes_total",
                "DNS lookups of discovering tiers by result: changed, unchanged, empty (kept the last good set) or failed (kept it too)",
                &["tier", "result"],
            ),
            otel_spans: counter(
                &r,
                "agentserve_otel_spans_total",
                "Sampled request spans by fate: exported to the OTLP collector, dropped (the export queue was full) or failed (the collector refused or was unreachable)",
                &["result"],
            ),
            load_scrape_failures: counter(
                &r,
                "agentserve_load_scrape_failures_total",
                "Failed or timed-out scrapes of a backend's /metrics (placement then uses local counts)",
                &["tier", "backend"],
            ),
            backend_ejections: counter(
                &r,
                "agentserve_backend_ejections_total",
                "Backends ejected by passive health (consecutive failed requests while health checks passed)",
                &["tier", "backend"],
            ),
            backend_ejected: gauge(
                &r,
                "agentserve_backend_ejected",
                "1 while a backend is ejected by passive health",
                &["tier", "backend"],
            ),
            timeouts: counter(
                &r,
                "agentserve_timeouts_total",
                "Requests cut by a timeout, by kind (header, body_idle, body_rate, client_write, upstream_connect, upstream_read)",
                &["kind"],
            ),
            store_ops: counter(
                &r,
                "agentserve_store_ops_total",
                "Operations on the shared binding store (affinity.store: redis), by op",
                &["op"],
            ),
            store_errors: counter(
                &r,
                "agentserve_store_errors_total",
                "Failed or timed-out operations on the shared binding store (requests went on with local state)",
                &["op"],
            ),
            store_latency: {
                let h = HistogramVec::new(
                    HistogramOpts::new(
                        "agentserve_store_latency_seconds",
                        "Latency of operations on the shared binding store",
                    )
                    .buckets(vec![0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25]),
                    &["op"],
                )
                .expect("valid metric");
                r.register(Box::new(h.clone())).expect("unique metric");
                h
            },
            connections_refused: counter(
                &r,
                "agentserve_connections_refused_total",
                "Client connections refused because server.max_connections were open",
                &["reason"],
            ),
            upstream_retries: counter(
                &r,
                "agentserve_upstream_retries_total",
                "Requests re-sent once on a fresh connection because a reused upstream connection closed before any response byte",
                &["tier", "backend"],
            ),
            cached_prompt_tokens: counter(
                &r,
                "agentserve_cached_prompt_tokens_total",
                "Cached prompt tokens reported in responses' usage (prompt_tokens_details.cached_tokens)",
                &["tier", "backend"],
            ),
            config_reloads: counter(
                &r,
                "agentserve_config_reload_total",
                "Configuration reloads by result",
                &["result"],
            ),
            store_unsynced_dropped: plain_counter(
                &r,
                "agentserve_store_unsynced_dropped_total",
                "Bindings made while the store was unreachable that were not remembered for write-back (over 100,000 waiting)",
            ),
            store_reseeds: plain_counter(
                &r,
                "agentserve_store_reseeds_total",
                "Times this gateway found the store had lost its data (a new epoch) and wrote its bindings back",
            ),
            tenant_limits_local: plain_counter(
                &r,
                "agentserve_tenant_limits_local_total",
                "Requests whose tenant's requests_per_minute / tokens_per_minute this gateway checked alone, the fleet's store being unreachable",
            ),
            websockets: plain_counter(
                &r,
                "agentserve_websockets_total",
                "WebSocket upgrades a backend accepted (/v1/responses in WebSocket mode: each socket carries turns until it closes)",
            ),
            store_up: gauge(
                &r,
                "agentserve_store_up",
                "1 while the shared binding store (affinity.store: redis) answers, 0 while this gateway places sessions alone",
                &[],
            ),
            admission_queued: gauge(
                &r,
                "agentserve_admission_queued",
                "Requests waiting in the gateway for a slot at their backend (admission)",
                &["tier", "class"],
            ),
            admission_wait: histogram(
                &r,
                "agentserve_admission_wait_seconds",
                "Time requests waited in the gateway for a slot, whether they got one or not",
                &["tier", "class"],
            ),
            admission_admitted: counter(
                &r,
                "agentserve_admission_admitted_total",
                "Requests given a slot at their backend: at once (now) or after waiting (queued)",
                &["tier", "class", "path"],
            ),
            admission_rejected: counter(
                &r,
                "agentserve_admission_rejected_total",
                "Requests refused a slot: queue_full, deadline (429) or client_gone (left while waiting)",
                &["tier", "class", "reason"],
            ),
            client_rejected: counter(
                &r,
                "agentserve_client_rejected_total",
                "Requests refused by client keys: unauthorized (401) or over a tenant's limit (429)",
                &["tenant", "reason"],
            ),
            tenant_requests: counter(
                &r,
                "agentserve_tenant_requests_total",
                "Requests by tenant (tenants of auth.keys_file; everyone else is `other`)",
                &["tenant"],
            ),
            tenant_tokens: counter(
                &r,
                "agentserve_tenant_tokens_total",
                "Tokens in responses' usage by tenant and kind (prompt, completion)",
                &["tenant", "kind"],
            ),
            prefix_index_entries: gauge(
                &r,
                "agentserve_prefix_index_entries",
                "Prompt blocks the prefix index holds (affinity.prefix)",
                &[],
            ),
            prefix_index_bytes: gauge(
                &r,
                "agentserve_prefix_index_bytes",
                "Heap bytes the prefix index takes (bounded by affinity.prefix.max_memory_bytes)",
                &[],
            ),
            prefix_conversations: gauge(
                &r,
                "agentserve_prefix_conversations",
                "Keyless conversations whose latest turn this gateway remembers (their ends; bounded by affinity.prefix.max_memory_bytes)",
                &[],
            ),
            prefix_probation: gauge(
                &r,
                "agentserve_prefix_probation",
                "New keyless conversations on probation: not bound, counted as sessions of their backend for affinity.prefix.probation_seconds",
                &[],
            ),
            prefix_index_evictions: counter(
                &r,
                "agentserve_prefix_index_evictions_total",
                "Prompt blocks the prefix index dropped to stay within its memory cap",
                &[],
            ),
            prefix_index_lookups: counter(
                &r,
                "agentserve_prefix_index_lookups_total",
                "Requests whose prompt was looked up in the prefix index, by whether some backend held part of it",
                &["tier", "result"],
            ),
            prefix_index_corrections: counter(
                &r,
                "agentserve_prefix_index_corrections_total",
                "Answers whose cached tokens showed the backend had evicted what the prefix index said it held",
                &["tier", "backend"],
            ),
            registry: r,
        }
    }

    /// Drop the gauges of a backend that left a tier (a reload removed it),
    /// so dashboards stop showing its last values. Counters stay: they are
    /// history.
    pub fn forget_backend(&self, tier: &str, backend: &str) {
        let labels = [tier, backend];
        for g in [
            &self.backend_healthy,
            &self.backend_in_flight,
            &self.backend_bindings,
            &self.backend_ejected,
            &self.kv_index_exact,
        ] {
            let _ = g.remove_label_values(&labels);
        }
        for g in [
            &self.backend_kv_usage,
            &self.backend_prefill_cost,
            &self.backend_queue,
        ] {
            let _ = g.remove_label_values(&labels);
        }
        for state in ["running", "waiting"] {
            let _ = self
                .backend_engine_requests
                .remove_label_values(&[tier, backend, state]);
        }
    }

    pub fn tier(&self, tier: &str) -> TierMetrics {
        TierMetrics {
            hits: self.affinity_hits.with_label_values(&[tier]),
            misses: self.affinity_misses.with_label_values(&[tier]),
            broken: self.affinity_broken.with_label_values(&[tier]),
            duration: self.request_duration.with_label_values(&[tier]),
            ttfb: self.time_to_first_byte.with_label_values(&[tier]),
            prefix_matched: self
                .prefix_index_lookups
                .with_label_values(&[tier, "matched"]),
            prefix_none: self.prefix_index_lookups.with_label_values(&[tier, "none"]),
            admitted_now: CLASS_LABELS
                .map(|c| self.admission_admitted.with_label_values(&[tier, c, "now"])),
            predictions: ["index", "events"].map(|source| {
                ["right", "wrong"].map(|outcome| {
                    self.kv_predictions
                        .with_label_values(&[tier, source, outcome])
                })
            }),
        }
    }

    pub fn tenant(&self, tenant: &str) -> TenantCounters {
        TenantCounters {
            requests: self.tenant_requests.with_label_values(&[tenant]),
            prompt_tokens: self.tenant_tokens.with_label_values(&[tenant, "prompt"]),
            completion_tokens: self
                .tenant_tokens
                .with_label_values(&[tenant, "completion"]),
        }
    }

    /// Every metric name this gateway can export (families appear in
    /// `/metrics` once they have a sample).
    pub fn names(&self) -> Vec<String> {
        use prometheus::core::Collector;
        let collectors: [&dyn Collector; 17] = [
            &self.affinity_hits,
            &self.affinity_misses,
            &self.affinity_broken,
            &self.affinity_moves,
            &self.bindings_evicted,
            &self.requests,
            &self.gateway_errors,
            &self.request_duration,
            &self.time_to_first_byte,
            &self.bindings,
            &self.backend_healthy,
            &self.backend_in_flight,
            &self.prompt_tokens,
            &self.cached_prompt_tokens,
            &self.config_reloads,
            &self.backend_prefill_cost,
            &self.backend_queue,
        ];
        collectors
            .iter()
            .flat_map(|c| c.desc().into_iter().map(|d| d.fq_name.clone()))
            .collect()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
