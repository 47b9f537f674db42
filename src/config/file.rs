//! The config file's schema: what the operator writes (SPEC §6), section by
//! section, with each key's default. Unknown keys are errors. Nothing here is
//! trusted: [`super::validate`] turns it into [`super::Config`].

use super::types::{OutlierConfig, TlsCertConfig};
use serde::Deserialize;
use std::collections::BTreeMap;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileConfig {
    #[serde(default)]
    pub(crate) server: FileServer,
    pub(crate) tiers: BTreeMap<String, FileTier>,
    #[serde(default)]
    pub(crate) affinity: FileAffinity,
    #[serde(default)]
    pub(crate) health: FileHealth,
    #[serde(default)]
    pub(crate) metrics: FileMetrics,
    #[serde(default)]
    pub(crate) admin: FileAdmin,
    #[serde(default)]
    pub(crate) trace: FileTrace,
    #[serde(default)]
    pub(crate) placement: FilePlacement,
    #[serde(default)]
    pub(crate) load: FileLoad,
    #[serde(default)]
    pub(crate) outlier: FileOutlier,
    #[serde(default)]
    pub(crate) admission: FileAdmission,
    #[serde(default)]
    pub(crate) auth: FileAuth,
    #[serde(default)]
    pub(crate) telemetry: FileTelemetry,
    #[serde(default)]
    pub(crate) discovery: FileDiscovery,
}

/// `telemetry`: OpenTelemetry traces (a span per request, OTLP export).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileTelemetry {
    pub(crate) otlp: FileOtlp,
    /// Share of new traces (no sampled parent) that are recorded, 0..1.
    pub(crate) sample_ratio: f64,
    /// Finished spans waiting for export; past it spans are dropped (counted).
    pub(crate) max_queued_spans: usize,
}

impl Default for FileTelemetry {
    fn default() -> Self {
        FileTelemetry {
            otlp: FileOtlp::default(),
            sample_ratio: 1.0,
            max_queued_spans: 4096,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileOtlp {
    /// The collector's base URL (`/v1/traces` is added); absent: the
    /// `OTEL_EXPORTER_OTLP_*ENDPOINT` variables; neither: telemetry off.
    pub(crate) endpoint: Option<String>,
    pub(crate) protocol: String,
    pub(crate) timeout_ms: u64,
}

impl Default for FileOtlp {
    fn default() -> Self {
        FileOtlp {
            endpoint: None,
            protocol: "http/protobuf".into(),
            timeout_ms: 10_000,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileAdmission {
    pub(crate) enabled: bool,
    /// Per backend, unless its tier or itself says otherwise (0: learned
    /// from the engine's gauges).
    pub(crate) max_in_flight: u32,
    pub(crate) max_prefilling: u32,
    pub(crate) prefill_queue_ms: u64,
    pub(crate) max_wait_ms: u64,
    pub(crate) max_queued: usize,
    pub(crate) priority_header: String,
    pub(crate) max_wait_header: String,
    pub(crate) default_priority: String,
}

impl Default for FileAdmission {
    fn default() -> Self {
        FileAdmission {
            enabled: false,
            max_in_flight: 0,
            max_prefilling: 0,
            prefill_queue_ms: 0,
            max_wait_ms: 30_000,
            max_queued: 10_000,
            priority_header: "x-agent-serve-priority".into(),
            max_wait_header: "x-agent-serve-max-wait-ms".into(),
            default_priority: "normal".into(),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileAuth {
    pub(crate) keys_file: Option<String>,
    pub(crate) required: bool,
    /// `pass` (default) | `strip` | `set`.
    pub(crate) upstream_authorization: Option<String>,
    /// The header value sent upstream with `upstream_authorization: set`.
    pub(crate) upstream_key: Option<String>,
    /// `finish` (default) | `cut`.
    pub(crate) stream_over_limit: Option<String>,
    /// `off` (default) | `tenant`.
    pub(crate) cache_salt: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileOutlier {
    pub(crate) enabled: bool,
    pub(crate) consecutive_failures: u32,
    pub(crate) base_ejection_ms: u64,
    pub(crate) max_ejection_ms: u64,
    pub(crate) max_ejected_percent: u32,
    /// 0: learned.
    pub(crate) first_byte_timeout_ms: u64,
    /// `resend` (default) | `fail`.
    pub(crate) on_hung: Option<String>,
}

impl Default for FileOutlier {
    fn default() -> Self {
        let d = OutlierConfig::default();
        FileOutlier {
            enabled: d.enabled,
            consecutive_failures: d.consecutive_failures,
            base_ejection_ms: d.base_ejection.as_millis() as u64,
            max_ejection_ms: d.max_ejection.as_millis() as u64,
            max_ejected_percent: d.max_ejected_percent,
            first_byte_timeout_ms: 0,
            on_hung: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FilePlacement {
    pub(crate) first: String,
    pub(crate) balance_factor: f64,
    pub(crate) load: String,
    pub(crate) speed_aware: bool,
    pub(crate) queue_aware: bool,
}

impl Default for FilePlacement {
    fn default() -> Self {
        FilePlacement {
            first: "bounded_hrw".into(),
            // Strict, not the customary 1.25: measured, 1.25 leaves HRW's
            // lumpiness (1.1-1.25 × the mean at tens of sessions) in place.
            balance_factor: 1.0,
            load: "sessions".into(),
            // Off: learned per-token costs include each request's fixed
            // overheads, so on fast or lightly loaded replicas they are noise
            // that would move bounds and split gateways' choices.
            speed_aware: false,
            // On: a first turn goes where no long prefill queues, among
            // backends equally within the bound; idle queues tie, so it is
            // bounded HRW whenever nothing queues.
            queue_aware: true,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileLoad {
    pub(crate) scrape: bool,
    pub(crate) path: String,
    pub(crate) interval_ms: u64,
    pub(crate) timeout_ms: u64,
    pub(crate) stale_ms: u64,
}

impl Default for FileLoad {
    fn default() -> Self {
        FileLoad {
            scrape: true,
            path: "/metrics".into(),
            interval_ms: 1000,
            timeout_ms: 500,
            stale_ms: 5000,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileTrace {
    /// JSON-lines request log; absent = off.
    pub(crate) path: Option<String>,
    pub(crate) max_bytes: u64,
    pub(crate) keep: usize,
}

impl Default for FileTrace {
    fn default() -> Self {
        FileTrace {
            path: None,
            max_bytes: 100 * 1024 * 1024,
            keep: 3,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileAdmin {
    pub(crate) listen: String,
    /// When set, every admin request needs `Authorization: Bearer <token>`.
    pub(crate) token: Option<String>,
    /// Allow a non-loopback admin listener without a token (not recommended:
    /// anyone who reaches it can drain backends and delete sessions).
    pub(crate) insecure: bool,
}

impl Default for FileAdmin {
    fn default() -> Self {
        FileAdmin {
            listen: "127.0.0.1:9092".into(),
            token: None,
            insecure: false,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileServer {
    pub(crate) listen: Vec<String>,
    pub(crate) max_body_bytes: u64,
    pub(crate) threads: usize,
    pub(crate) connect_timeout_ms: u64,
    /// TCP connect plus TLS handshake to a TLS backend, in all.
    pub(crate) tls_handshake_timeout_ms: u64,
    /// The longest a backend may stay silent: before its first byte (queue
    /// plus prefill, which can take minutes) and between stream chunks.
    /// `0` = none.
    pub(crate) read_timeout_ms: u64,
    /// A client's request headers, from its first byte (or from accepting a
    /// new connection) to the end of the headers, in all: 408 after that.
    pub(crate) header_timeout_ms: u64,
    /// The longest a client may pause while sending its body.
    pub(crate) body_idle_timeout_ms: u64,
    /// Slower bodies are cut with a 408, measured from `body_rate_grace_ms`
    /// into the body; `0` = no minimum.
    pub(crate) body_min_rate_bytes_per_s: u64,
    pub(crate) body_rate_grace_ms: u64,
    /// The longest one write to a client may block (a client that stops
    /// reading a stream is cut, and its backend connection released).
    pub(crate) client_write_timeout_ms: u64,
    /// A request's line and headers together; over it: 431.
    pub(crate) max_header_bytes: usize,
    /// Open client connections over all proxy listeners; over it a new
    /// connection is answered 503 and closed. `0` = no limit.
    pub(crate) max_connections: usize,
    /// How long an idle upstream connection is kept for reuse. Below the
    /// engines' own keep-alive (llama.cpp, uvicorn/vLLM: 5 s) so the gateway
    /// closes an idle connection before the engine does.
    pub(crate) upstream_idle_timeout_ms: u64,
    /// Request bodies up to this size are kept whole until the response
    /// starts, so a request that meets a dead pooled connection is replayed.
    pub(crate) replay_body_bytes: u64,
    /// Bytes all requests together may hold for replay (over it: no replay copy).
    pub(crate) replay_budget_bytes: u64,
    /// Bytes all requests together may hold while the gateway reads bodies
    /// to route them (by `model`, or a body session field); over it new such
    /// requests get a 503 with `Retry-After`.
    pub(crate) preread_budget_bytes: u64,
    pub(crate) grace_period_seconds: u64,
    pub(crate) graceful_shutdown_timeout_seconds: u64,
    pub(crate) pid_file: String,
    pub(crate) upgrade_sock: String,
    /// Where bindings are saved (atomically) so they survive restarts and upgrades.
    pub(crate) state_file: Option<String>,
    pub(crate) state_save_interval_ms: u64,
    pub(crate) tls: Option<FileTls>,
    /// CA bundle for verifying TLS backends (default: the system's roots).
    pub(crate) upstream_ca_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileTls {
    pub(crate) listen: Vec<String>,
    #[serde(default = "yes")]
    pub(crate) h2: bool,
    pub(crate) certificates: Vec<TlsCertConfig>,
}

fn yes() -> bool {
    true
}

impl Default for FileServer {
    fn default() -> Self {
        FileServer {
            listen: vec!["0.0.0.0:8080".into()],
            max_body_bytes: 32 * 1024 * 1024,
            threads: 0,
            connect_timeout_ms: 1000,
            tls_handshake_timeout_ms: 5000,
            read_timeout_ms: 600_000,
            header_timeout_ms: 30_000,
            body_idle_timeout_ms: 30_000,
            body_min_rate_bytes_per_s: 1024,
            body_rate_grace_ms: 10_000,
            client_write_timeout_ms: 60_000,
            max_header_bytes: 64 * 1024,
            max_connections: 10_000,
            upstream_idle_timeout_ms: 4000,
            replay_body_bytes: 4 * 1024 * 1024,
            replay_budget_bytes: 256 * 1024 * 1024,
            preread_budget_bytes: 256 * 1024 * 1024,
            grace_period_seconds: 5,
            graceful_shutdown_timeout_seconds: 30,
            pid_file: "/tmp/agent-gateway.pid".into(),
            upgrade_sock: "/tmp/agent-gateway-upgrade.sock".into(),
            state_file: None,
            state_save_interval_ms: 5000,
            tls: None,
            upstream_ca_file: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileTier {
    #[serde(default)]
    pub(crate) default: bool,
    #[serde(default)]
    pub(crate) models: Vec<String>,
    #[serde(default)]
    pub(crate) backends: Vec<FileBackend>,
    /// Each backend's requests at once (admission).
    pub(crate) max_in_flight: Option<u32>,
    /// This tier's own `auth.upstream_authorization` / `upstream_key`.
    pub(crate) upstream_authorization: Option<String>,
    pub(crate) upstream_key: Option<String>,
    /// Backends from DNS instead of `backends`.
    pub(crate) discovery: Option<FileTierDiscovery>,
}

/// A tier's `discovery`: `{dns: NAME, port: P}` (each A/AAAA address is a
/// backend) or `{srv: NAME}` (targets and ports from SRV records).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileTierDiscovery {
    pub(crate) dns: Option<String>,
    pub(crate) port: Option<u16>,
    pub(crate) srv: Option<String>,
    #[serde(default = "default_refresh_ms")]
    pub(crate) refresh_ms: u64,
}

fn default_refresh_ms() -> u64 {
    5_000
}

/// The top-level `discovery`: which DNS servers tiers' names are asked of.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileDiscovery {
    /// `host:port` or an IP (port 53); empty: the system's (/etc/resolv.conf).
    pub(crate) resolvers: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileBackend {
    pub(crate) id: String,
    pub(crate) addr: String,
    #[serde(default = "one")]
    pub(crate) weight: u32,
    #[serde(default)]
    pub(crate) draining: bool,
    /// Connect to this backend over TLS, verifying its certificate.
    #[serde(default)]
    pub(crate) tls: bool,
    /// Name to send and verify (default: the host part of `addr`).
    pub(crate) sni: Option<String>,
    /// Requests it runs at once (admission).
    pub(crate) max_in_flight: Option<u32>,
    /// Its engine's KV-cache events (vLLM `--kv-events-config`).
    pub(crate) kv_events: Option<FileKvEvents>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct FileKvEvents {
    /// The engine's publisher: `tcp://host:port` or `ipc:///path`.
    pub(crate) endpoint: String,
    /// Its replay socket, for batches missed.
    pub(crate) replay: Option<String>,
    /// Topic to subscribe to (default: every topic).
    #[serde(default)]
    pub(crate) topic: String,
    /// The largest message the engine may send; a larger one drops the
    /// connection before any of it is read.
    #[serde(default = "default_kv_max_message_bytes")]
    pub(crate) max_message_bytes: u64,
}

/// vLLM's batches are a few KB; 16 MiB leaves room for a huge one.
fn default_kv_max_message_bytes() -> u64 {
    16 * 1024 * 1024
}

fn one() -> u32 {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileAffinity {
    pub(crate) sticky_ttl_seconds: u64,
    pub(crate) session_headers: Vec<String>,
    pub(crate) parent_session_headers: Vec<String>,
    /// JSON body fields tried, in order, when no session header is present.
    /// Dotted paths reach into objects (`metadata.user_id`). Empty disables.
    pub(crate) body_session_fields: Vec<String>,
    pub(crate) hash_key: String,
    /// Earlier secrets: response ids issued under them still open.
    pub(crate) retired_hash_keys: Vec<String>,
    pub(crate) max_bindings: usize,
    pub(crate) mode: String,
    /// `cost` or `in_flight`; absent: `in_flight` when `soft_max_in_flight`
    /// is set, else `cost`.
    pub(crate) soft_policy: Option<String>,
    pub(crate) soft_max_in_flight: u64,
    pub(crate) move_hysteresis_ms: u64,
    pub(crate) move_cooldown_ms: u64,
    pub(crate) max_moves_per_session: u8,
    pub(crate) prior_prefill_us_per_token: f64,
    pub(crate) single_flight_wait_ms: u64,
    pub(crate) session_final_headers: Vec<String>,
    pub(crate) parent_agent_headers: Vec<String>,
    pub(crate) allow_explicit_target: bool,
    /// `gateway` (the ids of stored responses the client sees carry their
    /// route) or `engine` (the engines' own, routed by what was learned).
    pub(crate) response_ids: String,
    pub(crate) tenant_header: Option<String>,
    pub(crate) tenant_from_authorization: bool,
    /// Where bindings live: this process only, or shared by a fleet in Redis.
    pub(crate) store: FileStore,
    /// Prefix-aware routing, also for requests without a session key.
    pub(crate) prefix: FilePrefix,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FilePrefix {
    pub(crate) enabled: bool,
    pub(crate) block_bytes: usize,
    pub(crate) max_memory_bytes: usize,
    pub(crate) max_read_bytes: usize,
    pub(crate) ttl_seconds: u64,
    pub(crate) probation_seconds: u64,
}

impl Default for FilePrefix {
    fn default() -> Self {
        let d = crate::affinity::prefix::PrefixConfig::default();
        FilePrefix {
            enabled: d.enabled,
            block_bytes: d.block_bytes,
            max_memory_bytes: d.max_memory_bytes,
            max_read_bytes: d.max_read_bytes,
            ttl_seconds: d.ttl.as_secs(),
            probation_seconds: d.probation.as_secs(),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileStore {
    pub(crate) kind: String,
    pub(crate) url: String,
    pub(crate) key_prefix: String,
    pub(crate) timeout_ms: u64,
    /// How long a local binding is trusted before it is checked against the
    /// store again (default: a quarter of the TTL, at most a minute).
    pub(crate) revalidate_ms: Option<u64>,
    pub(crate) tls_ca_file: Option<String>,
    pub(crate) tls_cert_file: Option<String>,
    pub(crate) tls_key_file: Option<String>,
    /// `/healthz` fails while the store is unreachable.
    pub(crate) required: bool,
    /// How often the gateway publishes a heartbeat on the bindings channel.
    pub(crate) heartbeat_ms: u64,
}

impl Default for FileStore {
    fn default() -> Self {
        FileStore {
            kind: "local".into(),
            url: "redis://127.0.0.1:6379".into(),
            key_prefix: "agentserve:".into(),
            timeout_ms: 50,
            revalidate_ms: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            required: false,
            heartbeat_ms: 5000,
        }
    }
}

impl Default for FileAffinity {
    fn default() -> Self {
        FileAffinity {
            sticky_ttl_seconds: 1800,
            session_headers: DEFAULT_SESSION_HEADERS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            parent_session_headers: DEFAULT_PARENT_HEADERS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            body_session_fields: DEFAULT_BODY_FIELDS.iter().map(|s| s.to_string()).collect(),
            hash_key: String::new(),
            retired_hash_keys: Vec::new(),
            max_bindings: 1_000_000,
            mode: "hard".into(),
            soft_policy: None,
            soft_max_in_flight: 0,
            move_hysteresis_ms: 150,
            move_cooldown_ms: 30_000,
            max_moves_per_session: 3,
            prior_prefill_us_per_token: 100.0,
            single_flight_wait_ms: 5000,
            session_final_headers: vec!["x-dynamo-session-final".into()],
            parent_agent_headers: vec!["x-claude-code-parent-agent-id".into()],
            allow_explicit_target: false,
            response_ids: "gateway".into(),
            tenant_header: None,
            tenant_from_authorization: false,
            store: FileStore::default(),
            prefix: FilePrefix::default(),
        }
    }
}

/// Precedence order: the first header present wins.
pub const DEFAULT_SESSION_HEADERS: &[&str] = &[
    "x-session-id",
    "x-dynamo-session-id",
    "x-claude-code-session-id",
    "x-codex-session-id",
    "x-codex-conversation-id",
    // Codex today (older builds: `session_id`), then its thread.
    "session-id",
    "session_id",
    "thread-id",
    // aiperf's multi-turn benchmarks; opencode.
    "x-session-affinity",
    "x-opencode-session",
];
pub const DEFAULT_PARENT_HEADERS: &[&str] = &["x-parent-session-id", "x-dynamo-parent-session-id"];
pub const DEFAULT_BODY_FIELDS: &[&str] = &["prompt_cache_key", "user", "metadata.user_id"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileHealth {
    pub(crate) path: String,
    pub(crate) interval_ms: u64,
    pub(crate) timeout_ms: u64,
    pub(crate) consecutive_failures: usize,
    pub(crate) consecutive_successes: usize,
}

impl Default for FileHealth {
    fn default() -> Self {
        FileHealth {
            path: "/health".into(),
            interval_ms: 1000,
            timeout_ms: 1000,
            // One slow probe on a busy host must not take a backend out;
            // requests that fail are caught sooner by passive health.
            consecutive_failures: 3,
            consecutive_successes: 1,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(crate) struct FileMetrics {
    pub(crate) listen: String,
}

impl Default for FileMetrics {
    fn default() -> Self {
        FileMetrics {
            listen: "127.0.0.1:9091".into(),
        }
    }
}
