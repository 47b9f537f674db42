//! The validated configuration ([`Config`]) the rest of the gateway
//! trusts, and its errors, each naming its key.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

/// Certificates are TLS's business; the config only names them.
pub use crate::tls::TlsCertConfig;

// ---------------------------------------------------------------------------
// Validated configuration.
// ---------------------------------------------------------------------------

/// `outlier`: passive health (see `upstream/outlier.rs`).
#[derive(Debug, Clone, PartialEq)]
pub struct OutlierConfig {
    pub enabled: bool,
    pub consecutive_failures: u32,
    pub base_ejection: Duration,
    pub max_ejection: Duration,
    pub max_ejected_percent: u32,
    /// A backend that answers no first byte for this long while requests
    /// wait for one is ejected (`upstream::stall`); `None`: learned from
    /// its own first bytes.
    pub first_byte_timeout: Option<Duration>,
    /// What becomes of the requests a backend held when it is ejected as
    /// hung.
    pub on_hung: OnHung,
}

/// `outlier.on_hung`: the requests a backend ejected as hung held, still
/// waiting for their first byte (`upstream::stall`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnHung {
    /// Sent once to another backend (a request already re-sent, or whose
    /// body the gateway did not keep, is answered 504).
    #[default]
    Resend,
    /// Answered 504 `backend_timeout` at once.
    Fail,
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            enabled: true,
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(30),
            max_ejection: Duration::from_secs(300),
            max_ejected_percent: 50,
            first_byte_timeout: None,
            on_hung: OnHung::Resend,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    /// Sorted by name; exactly one is the default.
    pub tiers: Vec<TierConfig>,
    pub affinity: AffinityConfig,
    pub health: HealthConfig,
    pub metrics: MetricsConfig,
    pub admin: AdminConfig,
    pub trace: TraceConfig,
    pub placement: PlacementConfig,
    pub load: LoadConfig,
    pub outlier: OutlierConfig,
    pub admission: AdmissionConfig,
    pub auth: AuthConfig,
    pub telemetry: TelemetryConfig,
    /// DNS servers for tiers with `discovery` (empty: the system's).
    pub resolvers: Vec<SocketAddr>,
    /// Things that are allowed but probably a mistake.
    pub warnings: Vec<String>,
}

#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub listen: Vec<SocketAddr>,
    pub max_body_bytes: u64,
    pub threads: usize,
    pub connect_timeout: Duration,
    pub tls_handshake_timeout: Duration,
    pub read_timeout: Option<Duration>,
    pub client: ClientLimits,
    pub upstream_idle_timeout: Duration,
    pub replay_body_bytes: u64,
    pub replay_budget_bytes: u64,
    pub preread_budget_bytes: u64,
    pub grace_period_seconds: u64,
    pub graceful_shutdown_timeout_seconds: u64,
    pub pid_file: String,
    pub upgrade_sock: String,
    pub state_file: Option<std::path::PathBuf>,
    pub state_save_interval: Duration,
    pub tls: Option<TlsConfig>,
    pub upstream_ca_file: Option<String>,
}

/// What a client connection may take (see `proxy::conn_guard`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClientLimits {
    pub header_timeout: Duration,
    pub body_idle_timeout: Duration,
    pub body_min_rate_bytes_per_s: u64,
    pub body_rate_grace: Duration,
    pub write_timeout: Duration,
    pub max_header_bytes: usize,
    pub max_connections: usize,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TlsConfig {
    pub listen: Vec<SocketAddr>,
    pub h2: bool,
    /// The first is the default for clients that send no (or an unknown) SNI name.
    pub certificates: Vec<TlsCertConfig>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TierConfig {
    pub name: String,
    pub default: bool,
    pub models: Vec<String>,
    pub backends: Vec<BackendConfig>,
    /// Overrides what goes upstream as `Authorization` for this tier.
    pub upstream_authorization: Option<UpstreamAuthorization>,
    /// Its backends come from DNS: `backends` is the last good answer.
    pub discovery: Option<TierDiscovery>,
    /// Each backend's `max_in_flight` (the tier's, else admission's), for
    /// backends that discovery adds.
    pub max_in_flight: u32,
}

/// A tier's `discovery`.
#[derive(Debug, Clone, PartialEq)]
pub struct TierDiscovery {
    pub target: DnsTarget,
    pub refresh: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub enum DnsTarget {
    /// Every A/AAAA address of `name` is a backend on `port`.
    Host { name: String, port: u16 },
    /// The targets (and ports) of `name`'s SRV records of the best priority.
    Srv { name: String },
}

impl TierDiscovery {
    /// The DNS name it asks for.
    pub fn name(&self) -> &str {
        match &self.target {
            DnsTarget::Host { name, .. } | DnsTarget::Srv { name } => name,
        }
    }
}

impl TierConfig {
    /// A discovered backend: its id is its address, so the same address
    /// keeps its id (and its sessions) from one answer to the next.
    pub fn discovered_backend(&self, addr: SocketAddr, weight: u32) -> BackendConfig {
        BackendConfig {
            id: addr.to_string(),
            addr,
            weight: weight.clamp(1, 10_000),
            draining: false,
            tls: None,
            max_in_flight: self.max_in_flight,
            kv_events: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct BackendConfig {
    pub id: String,
    pub addr: SocketAddr,
    pub weight: u32,
    pub draining: bool,
    /// `Some(sni)` for a TLS backend.
    pub tls: Option<String>,
    /// Requests it runs at once before admission queues the rest in the
    /// gateway (its own `max_in_flight`, else its tier's, else
    /// `admission.max_in_flight`; 0: no limit).
    pub max_in_flight: u32,
    /// Where its engine publishes its KV-cache events (`kv_events`).
    pub kv_events: Option<KvEventsConfig>,
}

/// A backend's `kv_events`, validated: ZeroMQ endpoints to connect to
/// (`tcp://host:port`, or `ipc:///path` for an engine on the same host).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvEventsConfig {
    pub endpoint: String,
    pub replay: Option<String>,
    pub topic: String,
    /// A message over this many bytes (live or replayed) drops the
    /// connection, never the gateway.
    pub max_message_bytes: usize,
}

/// `admission`: a queue in the gateway, by priority class and fair share
/// across tenants, for requests whose backend runs its `max_in_flight`.
#[derive(Debug, Clone, PartialEq)]
pub struct AdmissionConfig {
    /// Off: every request goes straight on (the behaviour before issue 29).
    pub enabled: bool,
    /// Of a backend's running requests, how many may be prefilling (sent,
    /// no first byte back) at once (0: no limit).
    pub max_prefilling: u32,
    /// Without `max_prefilling`: how much prefill work (ms, at the
    /// backend's learned cost a token) may be sent to a backend and not
    /// yet answered, beyond one request (0: no limit, the default).
    /// Requests inside an engine are served in arrival order; past this
    /// they wait here, in order of class and fair share. For engines that
    /// prefill one prompt at a time: where prefills run side by side it
    /// holds back work the engine would have done at once.
    pub prefill_queue: Duration,
    /// The longest a request waits for a slot before a 429.
    pub max_wait: Duration,
    /// Requests waiting at once, over all backends; more get a 429 at once.
    pub max_queued: usize,
    /// `interactive` | `normal` | `batch`.
    pub priority_header: http::HeaderName,
    /// A request's own, shorter deadline (ms).
    pub max_wait_header: http::HeaderName,
    /// The class of a request that names none (and has no key that does).
    pub default_priority: crate::admission::Class,
}

/// `auth`: client keys.
#[derive(Debug, Clone, PartialEq)]
pub struct AuthConfig {
    /// Hashed client keys -> tenant, class, weight, limits (re-read on SIGHUP).
    pub keys_file: Option<std::path::PathBuf>,
    /// Refuse (401) a request without a known key.
    pub required: bool,
    /// What goes upstream as `Authorization`.
    pub upstream_authorization: UpstreamAuthorization,
    /// What happens to a stream whose tenant's `tokens_per_minute` it
    /// spends past zero.
    pub stream_over_limit: StreamOverLimit,
    /// What keeps tenants' prompts apart in the engines' prefix caches.
    pub cache_salt: CacheSalt,
}

/// `auth.cache_salt`: whether each request carries its tenant's
/// `cache_salt`, the field vLLM and SGLang hash into a prompt's first
/// block, so that one tenant's prompts never find another's cached blocks
/// (nor learn from a cached-token count or a fast first token that another
/// sent the same prefix).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CacheSalt {
    /// Requests go as the client sent them.
    #[default]
    Off,
    /// The gateway sets every prompt's `cache_salt` from its tenant (and
    /// any salt the client sent): a tenant cannot name another's.
    Tenant,
}

/// `auth.stream_over_limit`: a stream that takes its tenant over its
/// `tokens_per_minute` (the tenant's next requests get 429 either way).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StreamOverLimit {
    /// It runs to its end.
    #[default]
    Finish,
    /// It is ended: an SSE error event (`rate_limit_exceeded`), then the
    /// response ends and the backend's request with it.
    Cut,
}

#[derive(Debug, Clone, PartialEq)]
pub enum UpstreamAuthorization {
    /// The client's own header, as sent.
    Pass,
    /// None: the client's key stays at the gateway.
    Strip,
    /// This value (say `Bearer <backend key>`) instead of the client's.
    Set(http::HeaderValue),
}

#[derive(Debug, Clone)]
pub struct AffinityConfig {
    /// `None` disables affinity (SPEC §3.7: TTL 0).
    pub sticky_ttl: Option<Duration>,
    pub session_headers: Vec<http::HeaderName>,
    pub parent_session_headers: Vec<http::HeaderName>,
    pub body_session_fields: Vec<Vec<String>>,
    /// The fleet's secret ([`crate::secret`]).
    pub hash_key: String,
    /// Earlier secrets, whose response ids still open (rotation).
    pub retired_hash_keys: Vec<String>,
    pub max_bindings: usize,
    pub mode: crate::affinity::policy::Mode,
    /// Soft mode: move a session off a backend with this many requests in flight (0 = never).
    pub soft_max_in_flight: u64,
    pub soft_policy: crate::affinity::policy::SoftPolicy,
    pub cost: crate::affinity::policy::CostParams,
    /// How long concurrent first requests wait for the first one's placement.
    pub single_flight_wait: Duration,
    /// A header here with value `true`/`1` closes the session's binding after the request.
    pub session_final_headers: Vec<http::HeaderName>,
    /// Headers naming the parent *agent* of a subagent within the request's session.
    pub parent_agent_headers: Vec<http::HeaderName>,
    pub allow_explicit_target: bool,
    /// Stored responses' ids as the client sees them carry their route
    /// (`response_ids: gateway`, the default); `false`: the engines' own.
    pub gateway_response_ids: bool,
    pub tenant: TenantSource,
    pub store: crate::fleet::store::StoreConfig,
    pub prefix: crate::affinity::prefix::PrefixConfig,
}

/// Where the tenant that scopes bindings comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantSource {
    None,
    Header(http::HeaderName),
    /// A keyed hash of the `Authorization` header (the key is never stored).
    Authorization,
}

/// `telemetry`: OpenTelemetry traces.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// Where spans go; `None`: no spans, and `traceparent` passes through
    /// untouched.
    pub otlp: Option<OtlpConfig>,
    pub sample_ratio: f64,
    pub max_queued_spans: usize,
    /// `OTEL_SERVICE_NAME`, else `agent-gateway`.
    pub service_name: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct OtlpConfig {
    /// The traces URL spans are posted to (OTLP/HTTP protobuf).
    pub traces_url: String,
    pub timeout: Duration,
    /// Sent with every export: `OTEL_EXPORTER_OTLP_(TRACES_)HEADERS`
    /// (`key=value,...`, values percent-decoded), a collector's key say.
    pub headers: Vec<(http::HeaderName, http::HeaderValue)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TraceConfig {
    pub path: Option<std::path::PathBuf>,
    pub max_bytes: u64,
    pub keep: usize,
}

#[derive(Debug, Clone)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    pub token: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct PlacementConfig {
    pub first: crate::affinity::placement::FirstKind,
    pub balance_factor: f64,
    pub load: crate::affinity::placement::LoadMeasure,
    /// Bounded HRW: scale each backend's share by its learned speed.
    pub speed_aware: bool,
    /// Bounded HRW: among backends within the bound, the least queued prefill.
    pub queue_aware: bool,
}

#[derive(Debug, Clone, PartialEq)]
pub struct LoadConfig {
    pub scrape: bool,
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub stale: Duration,
}

#[derive(Debug, Clone, PartialEq)]
pub struct HealthConfig {
    pub path: String,
    pub interval: Duration,
    pub timeout: Duration,
    pub consecutive_failures: usize,
    pub consecutive_successes: usize,
}

#[derive(Debug, Clone)]
pub struct MetricsConfig {
    pub listen: SocketAddr,
}

/// A configuration error: the key path and what is wrong with it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.key.is_empty() {
            write!(f, "{}", self.message)
        } else {
            write!(f, "{}: {}", self.key, self.message)
        }
    }
}

#[derive(Debug)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

pub(super) fn err(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        message: message.into(),
    }
}
