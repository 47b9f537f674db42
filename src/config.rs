//! The YAML file (SPEC §6) and the validated, typed [`Config`] the rest of the
//! gateway trusts. Every error names the key that is wrong.

use serde::Deserialize;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::time::Duration;

/// Certificates are TLS's business; the config only names them.
pub use crate::tls::TlsCertConfig;

/// The hash key shipped in the example config; running with it is allowed but warned about.
pub const PLACEHOLDER_HASH_KEY: &str = "change-me";

// ---------------------------------------------------------------------------
// File schema: what the operator writes. Unknown keys are errors.
// ---------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    server: FileServer,
    tiers: BTreeMap<String, FileTier>,
    #[serde(default)]
    affinity: FileAffinity,
    #[serde(default)]
    health: FileHealth,
    #[serde(default)]
    metrics: FileMetrics,
    #[serde(default)]
    admin: FileAdmin,
    #[serde(default)]
    trace: FileTrace,
    #[serde(default)]
    placement: FilePlacement,
    #[serde(default)]
    load: FileLoad,
    #[serde(default)]
    outlier: FileOutlier,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileOutlier {
    enabled: bool,
    consecutive_failures: u32,
    base_ejection_ms: u64,
    max_ejection_ms: u64,
    max_ejected_percent: u32,
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
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FilePlacement {
    first: String,
    balance_factor: f64,
    load: String,
    speed_aware: bool,
    queue_aware: bool,
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
struct FileLoad {
    scrape: bool,
    path: String,
    interval_ms: u64,
    timeout_ms: u64,
    stale_ms: u64,
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
struct FileTrace {
    /// JSON-lines request log; absent = off.
    path: Option<String>,
    max_bytes: u64,
    keep: usize,
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
struct FileAdmin {
    listen: String,
    /// When set, every admin request needs `Authorization: Bearer <token>`.
    token: Option<String>,
    /// Allow a non-loopback admin listener without a token (not recommended:
    /// anyone who reaches it can drain backends and delete sessions).
    insecure: bool,
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
struct FileServer {
    listen: Vec<String>,
    max_body_bytes: u64,
    threads: usize,
    connect_timeout_ms: u64,
    /// TCP connect plus TLS handshake to a TLS backend, in all.
    tls_handshake_timeout_ms: u64,
    /// The longest a backend may stay silent: before its first byte (queue
    /// plus prefill, which can take minutes) and between stream chunks.
    /// `0` = none.
    read_timeout_ms: u64,
    /// A client's request headers, from its first byte (or from accepting a
    /// new connection) to the end of the headers, in all: 408 after that.
    header_timeout_ms: u64,
    /// The longest a client may pause while sending its body.
    body_idle_timeout_ms: u64,
    /// Slower bodies are cut with a 408, measured from `body_rate_grace_ms`
    /// into the body; `0` = no minimum.
    body_min_rate_bytes_per_s: u64,
    body_rate_grace_ms: u64,
    /// The longest one write to a client may block (a client that stops
    /// reading a stream is cut, and its backend connection released).
    client_write_timeout_ms: u64,
    /// A request's line and headers together; over it: 431.
    max_header_bytes: usize,
    /// Open client connections over all proxy listeners; over it a new
    /// connection is answered 503 and closed. `0` = no limit.
    max_connections: usize,
    /// How long an idle upstream connection is kept for reuse. Below the
    /// engines' own keep-alive (llama.cpp, uvicorn/vLLM: 5 s) so the gateway
    /// closes an idle connection before the engine does.
    upstream_idle_timeout_ms: u64,
    /// Request bodies up to this size are kept whole until the response
    /// starts, so a request that meets a dead pooled connection is replayed.
    replay_body_bytes: u64,
    /// Bytes all requests together may hold for replay (over it: no replay copy).
    replay_budget_bytes: u64,
    /// Bytes all requests together may hold while the gateway reads bodies
    /// to route them (by `model`, or a body session field); over it new such
    /// requests get a 503 with `Retry-After`.
    preread_budget_bytes: u64,
    grace_period_seconds: u64,
    graceful_shutdown_timeout_seconds: u64,
    pid_file: String,
    upgrade_sock: String,
    /// Where bindings are saved (atomically) so they survive restarts and upgrades.
    state_file: Option<String>,
    state_save_interval_ms: u64,
    tls: Option<FileTls>,
    /// CA bundle for verifying TLS backends (default: the system's roots).
    upstream_ca_file: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileTls {
    listen: Vec<String>,
    #[serde(default = "yes")]
    h2: bool,
    certificates: Vec<TlsCertConfig>,
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
struct FileTier {
    #[serde(default)]
    default: bool,
    #[serde(default)]
    models: Vec<String>,
    #[serde(default)]
    backends: Vec<FileBackend>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBackend {
    id: String,
    addr: String,
    #[serde(default = "one")]
    weight: u32,
    #[serde(default)]
    draining: bool,
    /// Connect to this backend over TLS, verifying its certificate.
    #[serde(default)]
    tls: bool,
    /// Name to send and verify (default: the host part of `addr`).
    sni: Option<String>,
}

fn one() -> u32 {
    1
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileAffinity {
    sticky_ttl_seconds: u64,
    session_headers: Vec<String>,
    parent_session_headers: Vec<String>,
    /// JSON body fields tried, in order, when no session header is present.
    /// Dotted paths reach into objects (`metadata.user_id`). Empty disables.
    body_session_fields: Vec<String>,
    hash_key: String,
    max_bindings: usize,
    mode: String,
    /// `cost` or `in_flight`; absent: `in_flight` when `soft_max_in_flight`
    /// is set, else `cost`.
    soft_policy: Option<String>,
    soft_max_in_flight: u64,
    move_hysteresis_ms: u64,
    move_cooldown_ms: u64,
    max_moves_per_session: u8,
    prior_prefill_us_per_token: f64,
    single_flight_wait_ms: u64,
    session_final_headers: Vec<String>,
    parent_agent_headers: Vec<String>,
    allow_explicit_target: bool,
    tenant_header: Option<String>,
    tenant_from_authorization: bool,
    /// Where bindings live: this process only, or shared by a fleet in Redis.
    store: FileStore,
    /// Prefix-aware routing, also for requests without a session key.
    prefix: FilePrefix,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FilePrefix {
    enabled: bool,
    block_bytes: usize,
    max_memory_bytes: usize,
    max_read_bytes: usize,
    ttl_seconds: u64,
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
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileStore {
    kind: String,
    url: String,
    key_prefix: String,
    timeout_ms: u64,
    /// How long a local binding is trusted before it is checked against the
    /// store again (default: a quarter of the TTL, at most a minute).
    revalidate_ms: Option<u64>,
    tls_ca_file: Option<String>,
    tls_cert_file: Option<String>,
    tls_key_file: Option<String>,
    /// `/healthz` fails while the store is unreachable.
    required: bool,
    /// How often the gateway publishes a heartbeat on the bindings channel.
    heartbeat_ms: u64,
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
            hash_key: PLACEHOLDER_HASH_KEY.into(),
            max_bindings: 1_000_000,
            mode: "hard".into(),
            soft_policy: None,
            soft_max_in_flight: 0,
            move_hysteresis_ms: 50,
            move_cooldown_ms: 30_000,
            max_moves_per_session: 3,
            prior_prefill_us_per_token: 100.0,
            single_flight_wait_ms: 5000,
            session_final_headers: vec!["x-dynamo-session-final".into()],
            parent_agent_headers: vec!["x-claude-code-parent-agent-id".into()],
            allow_explicit_target: false,
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
    "session_id",
];
pub const DEFAULT_PARENT_HEADERS: &[&str] = &["x-parent-session-id", "x-dynamo-parent-session-id"];
pub const DEFAULT_BODY_FIELDS: &[&str] = &["prompt_cache_key", "user", "metadata.user_id"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct FileHealth {
    path: String,
    interval_ms: u64,
    timeout_ms: u64,
    consecutive_failures: usize,
    consecutive_successes: usize,
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
struct FileMetrics {
    listen: String,
}

impl Default for FileMetrics {
    fn default() -> Self {
        FileMetrics {
            listen: "127.0.0.1:9091".into(),
        }
    }
}

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
}

impl Default for OutlierConfig {
    fn default() -> Self {
        OutlierConfig {
            enabled: true,
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(30),
            max_ejection: Duration::from_secs(300),
            max_ejected_percent: 50,
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
}

#[derive(Debug, Clone, PartialEq)]
pub struct BackendConfig {
    pub id: String,
    pub addr: SocketAddr,
    pub weight: u32,
    pub draining: bool,
    /// `Some(sni)` for a TLS backend.
    pub tls: Option<String>,
}

#[derive(Debug, Clone)]
pub struct AffinityConfig {
    /// `None` disables affinity (SPEC §3.7: TTL 0).
    pub sticky_ttl: Option<Duration>,
    pub session_headers: Vec<http::HeaderName>,
    pub parent_session_headers: Vec<http::HeaderName>,
    pub body_session_fields: Vec<Vec<String>>,
    pub hash_key: String,
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
    pub tenant: TenantSource,
    pub store: crate::affinity::store::StoreConfig,
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

fn err(key: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.into(),
        message: message.into(),
    }
}

impl Config {
    pub fn load(path: &Path) -> Result<Config, ConfigErrors> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigErrors(vec![err(
                "",
                format!("cannot read {}: {e}", path.display()),
            )])
        })?;
        Config::from_yaml(&text)
    }

    pub fn from_yaml(text: &str) -> Result<Config, ConfigErrors> {
        if let Err(message) = shape_check(text) {
            return Err(ConfigErrors(vec![err("", message)]));
        }
        let de = serde_yaml::Deserializer::from_str(text);
        let file: FileConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let key = if key == "." { String::new() } else { key };
            ConfigErrors(vec![err(key, e.into_inner().to_string())])
        })?;
        validate(file)
    }

    pub fn default_tier(&self) -> &TierConfig {
        self.tiers
            .iter()
            .find(|t| t.default)
            .expect("validated config has a default tier")
    }
}

/// Refuse, before parsing, what no real config looks like and what would
/// make the YAML parser work for minutes (its cost grows with the square of
/// the nesting depth).
fn shape_check(text: &str) -> Result<(), String> {
    const MAX_BYTES: usize = 1024 * 1024;
    const MAX_DEPTH: usize = 32;
    const MAX_INDENT: usize = 128;
    if text.len() > MAX_BYTES {
        return Err(format!("the file is over {MAX_BYTES} bytes"));
    }
    for (i, line) in text.lines().enumerate() {
        let indent = line.len() - line.trim_start_matches([' ', '-']).len();
        if indent > MAX_INDENT {
            return Err(format!(
                "line {}: nested deeper than any config needs ({indent} columns of indentation)",
                i + 1
            ));
        }
    }
    let (mut depth, mut quote) = (0usize, None::<char>);
    for c in text.chars() {
        match (quote, c) {
            // A comment runs to the end of its line.
            (Some('#'), '\n') => quote = None,
            (None, '#') => quote = Some('#'),
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"' | '\'') => quote = Some(c),
            (None, '[' | '{') => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(format!(
                        "brackets nested deeper than {MAX_DEPTH} levels: no config needs that"
                    ));
                }
            }
            (None, ']' | '}') => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    Ok(())
}

fn parse_addr(key: &str, value: &str, errors: &mut Vec<ConfigError>) -> Option<SocketAddr> {
    if let Ok(a) = value.parse::<SocketAddr>() {
        return Some(a);
    }
    match value.to_socket_addrs() {
        Ok(mut it) => match it.next() {
            Some(a) => Some(a),
            None => {
                errors.push(err(key, format!("`{value}` resolves to no address")));
                None
            }
        },
        Err(e) => {
            errors.push(err(
                key,
                format!("`{value}` is not a host:port address ({e})"),
            ));
            None
        }
    }
}

fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// A configured header name, lower-cased and parsed once (lookups by a
/// parsed name skip re-parsing it on every request).
fn header_name(h: &str) -> Option<http::HeaderName> {
    let lower = h.to_ascii_lowercase();
    valid_header_name(&lower)
        .then(|| http::HeaderName::from_bytes(lower.as_bytes()).ok())
        .flatten()
}

fn validate_headers(
    key: &str,
    list: &[String],
    errors: &mut Vec<ConfigError>,
) -> Vec<http::HeaderName> {
    let mut out = Vec::new();
    for (i, h) in list.iter().enumerate() {
        match header_name(h) {
            None => errors.push(err(
                format!("{key}[{i}]"),
                format!("`{h}` is not a valid header name"),
            )),
            Some(name) if !out.contains(&name) => out.push(name),
            Some(_) => {}
        }
    }
    out
}

fn validate_placement(
    p: &FilePlacement,
    l: &FileLoad,
    errors: &mut Vec<ConfigError>,
) -> (PlacementConfig, LoadConfig) {
    use crate::affinity::placement::{FirstKind, LoadMeasure};
    let first = FirstKind::parse(&p.first).unwrap_or_else(|| {
        errors.push(err(
            "placement.first",
            format!("`{}` is not one of {}", p.first, FirstKind::NAMES),
        ));
        FirstKind::BoundedHrw
    });
    if !(p.balance_factor.is_finite() && p.balance_factor >= 1.0) {
        errors.push(err(
            "placement.balance_factor",
            "must be a number ≥ 1 (1.25 is customary)",
        ));
    }
    let measure = LoadMeasure::parse(&p.load).unwrap_or_else(|| {
        errors.push(err(
            "placement.load",
            format!("`{}` is not one of sessions | requests | combined", p.load),
        ));
        LoadMeasure::Sessions
    });
    for (key, v) in [
        ("load.interval_ms", l.interval_ms),
        ("load.timeout_ms", l.timeout_ms),
        ("load.stale_ms", l.stale_ms),
    ] {
        if v == 0 {
            errors.push(err(key, "must be greater than 0"));
        }
    }
    if !l.path.starts_with('/') {
        errors.push(err("load.path", "must start with `/`"));
    }
    (
        PlacementConfig {
            first,
            balance_factor: p.balance_factor,
            load: measure,
            speed_aware: p.speed_aware,
            queue_aware: p.queue_aware,
        },
        LoadConfig {
            scrape: l.scrape,
            path: l.path.clone(),
            interval: Duration::from_millis(l.interval_ms),
            timeout: Duration::from_millis(l.timeout_ms),
            stale: Duration::from_millis(l.stale_ms),
        },
    )
}

fn validate_outlier(o: &FileOutlier, errors: &mut Vec<ConfigError>) -> OutlierConfig {
    if o.consecutive_failures == 0 {
        errors.push(err("outlier.consecutive_failures", "must be at least 1"));
    }
    if o.base_ejection_ms == 0 {
        errors.push(err("outlier.base_ejection_ms", "must be greater than 0"));
    }
    if o.max_ejection_ms < o.base_ejection_ms {
        errors.push(err(
            "outlier.max_ejection_ms",
            "must be at least outlier.base_ejection_ms",
        ));
    }
    if o.max_ejected_percent > 100 {
        errors.push(err("outlier.max_ejected_percent", "must be 0..=100"));
    }
    OutlierConfig {
        enabled: o.enabled,
        consecutive_failures: o.consecutive_failures.max(1),
        base_ejection: Duration::from_millis(o.base_ejection_ms),
        max_ejection: Duration::from_millis(o.max_ejection_ms),
        max_ejected_percent: o.max_ejected_percent.min(100),
    }
}

/// Every section checked, every problem collected (not just the first).
fn validate(file: FileConfig) -> Result<Config, ConfigErrors> {
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let server = validate_server(&file.server, &mut errors);
    let tiers = validate_tiers(&file.tiers, &mut errors);
    let affinity = validate_affinity(&file.affinity, &mut errors, &mut warnings);
    let admin = validate_admin(&file.admin, &mut errors);
    let health = validate_health(&file.health, &mut errors);
    let (placement, load) = validate_placement(&file.placement, &file.load, &mut errors);
    let outlier = validate_outlier(&file.outlier, &mut errors);
    let metrics = MetricsConfig {
        listen: parse_addr("metrics.listen", &file.metrics.listen, &mut errors)
            .unwrap_or(UNSPECIFIED),
    };
    if !errors.is_empty() {
        return Err(ConfigErrors(errors));
    }
    Ok(Config {
        server,
        tiers,
        affinity,
        health,
        metrics,
        admin,
        trace: TraceConfig {
            path: file.trace.path.as_ref().map(std::path::PathBuf::from),
            max_bytes: file.trace.max_bytes,
            keep: file.trace.keep,
        },
        placement,
        load,
        outlier,
        warnings,
    })
}

/// Stands in for an address that did not parse (the config is refused anyway).
const UNSPECIFIED: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);

/// `server`: listeners, limits and timeouts.
fn validate_server(s: &FileServer, errors: &mut Vec<ConfigError>) -> ServerConfig {
    if s.listen.is_empty() && s.tls.is_none() {
        errors.push(err(
            "server.listen",
            "at least one listener (plain or TLS) is required",
        ));
    }
    let listen: Vec<SocketAddr> = s
        .listen
        .iter()
        .enumerate()
        .filter_map(|(i, a)| parse_addr(&format!("server.listen[{i}]"), a, errors))
        .collect();
    let tls = s.tls.as_ref().map(|t| {
        if t.listen.is_empty() {
            errors.push(err(
                "server.tls.listen",
                "at least one TLS listener is required",
            ));
        }
        if t.certificates.is_empty() {
            errors.push(err(
                "server.tls.certificates",
                "at least one certificate is required",
            ));
        }
        for (i, c) in t.certificates.iter().enumerate() {
            if let Err(e) = crate::tls::load_cert(c) {
                errors.push(err(format!("server.tls.certificates[{i}]"), e));
            }
        }
        TlsConfig {
            listen: t
                .listen
                .iter()
                .enumerate()
                .filter_map(|(i, a)| parse_addr(&format!("server.tls.listen[{i}]"), a, errors))
                .collect(),
            h2: t.h2,
            certificates: t.certificates.clone(),
        }
    });
    if let Some(ca) = &s.upstream_ca_file {
        if std::fs::metadata(ca).is_err() {
            errors.push(err(
                "server.upstream_ca_file",
                format!("cannot read `{ca}`"),
            ));
        }
    }
    if s.max_body_bytes == 0 {
        errors.push(err("server.max_body_bytes", "must be greater than 0"));
    }
    for (key, v) in [
        ("server.connect_timeout_ms", s.connect_timeout_ms),
        (
            "server.tls_handshake_timeout_ms",
            s.tls_handshake_timeout_ms,
        ),
        ("server.header_timeout_ms", s.header_timeout_ms),
        ("server.body_idle_timeout_ms", s.body_idle_timeout_ms),
        ("server.client_write_timeout_ms", s.client_write_timeout_ms),
        ("server.max_header_bytes", s.max_header_bytes as u64),
    ] {
        if v == 0 {
            errors.push(err(key, "must be greater than 0"));
        }
    }
    if s.upstream_idle_timeout_ms == 0 {
        errors.push(err(
            "server.upstream_idle_timeout_ms",
            "must be greater than 0",
        ));
    }

    ServerConfig {
        listen,
        max_body_bytes: s.max_body_bytes,
        threads: s.threads,
        connect_timeout: Duration::from_millis(s.connect_timeout_ms),
        tls_handshake_timeout: Duration::from_millis(s.tls_handshake_timeout_ms),
        client: ClientLimits {
            header_timeout: Duration::from_millis(s.header_timeout_ms),
            body_idle_timeout: Duration::from_millis(s.body_idle_timeout_ms),
            body_min_rate_bytes_per_s: s.body_min_rate_bytes_per_s,
            body_rate_grace: Duration::from_millis(s.body_rate_grace_ms),
            write_timeout: Duration::from_millis(s.client_write_timeout_ms),
            max_header_bytes: s.max_header_bytes,
            max_connections: s.max_connections,
        },
        read_timeout: (s.read_timeout_ms > 0).then(|| Duration::from_millis(s.read_timeout_ms)),
        upstream_idle_timeout: Duration::from_millis(s.upstream_idle_timeout_ms),
        replay_body_bytes: s.replay_body_bytes,
        replay_budget_bytes: s.replay_budget_bytes,
        preread_budget_bytes: s.preread_budget_bytes,
        grace_period_seconds: s.grace_period_seconds,
        graceful_shutdown_timeout_seconds: s.graceful_shutdown_timeout_seconds,
        pid_file: s.pid_file.clone(),
        upgrade_sock: s.upgrade_sock.clone(),
        state_file: s.state_file.as_ref().map(std::path::PathBuf::from),
        state_save_interval: Duration::from_millis(s.state_save_interval_ms.max(10)),
        tls,
        upstream_ca_file: s.upstream_ca_file.clone(),
    }
}

/// `tiers`: names, models and backends; exactly one default.
fn validate_tiers(
    file_tiers: &BTreeMap<String, FileTier>,
    errors: &mut Vec<ConfigError>,
) -> Vec<TierConfig> {
    if file_tiers.is_empty() {
        errors.push(err("tiers", "at least one tier is required"));
    }
    let mut tiers = Vec::new();
    let mut seen_ids: HashSet<String> = HashSet::new();
    let mut model_owner: BTreeMap<String, String> = BTreeMap::new();
    for (name, t) in file_tiers {
        let key = format!("tiers.{name}");
        if !valid_tier_name(name) {
            errors.push(err(
                &key,
                "tier names use letters, digits, `-`, `_` and `.` only",
            ));
        }
        if t.backends.is_empty() {
            errors.push(err(
                format!("{key}.backends"),
                "a tier needs at least one backend",
            ));
        }
        for m in &t.models {
            if let Some(other) = model_owner.insert(m.clone(), name.clone()) {
                if &other != name {
                    errors.push(err(
                        format!("{key}.models"),
                        format!("model `{m}` is already served by tier `{other}`"),
                    ));
                }
            }
        }
        let mut backends = Vec::new();
        for (i, b) in t.backends.iter().enumerate() {
            let bkey = format!("{key}.backends[{i}]");
            // It travels in the x-agent-serve-backend response header.
            if b.id.is_empty() || b.id.len() > 128 || !b.id.bytes().all(|c| c.is_ascii_graphic()) {
                errors.push(err(
                    format!("{bkey}.id"),
                    "must be 1-128 printable ASCII characters without spaces (it is sent in a header)",
                ));
            }
            if !seen_ids.insert(b.id.clone()) {
                errors.push(err(
                    format!("{bkey}.id"),
                    format!("duplicate backend id `{}`", b.id),
                ));
            }
            if b.weight == 0 || b.weight > 10_000 {
                errors.push(err(format!("{bkey}.weight"), "must be between 1 and 10000"));
            }
            if let Some(addr) = parse_addr(&format!("{bkey}.addr"), &b.addr, errors) {
                let host = b.addr.rsplit_once(':').map_or(b.addr.as_str(), |(h, _)| h);
                backends.push(BackendConfig {
                    id: b.id.clone(),
                    addr,
                    weight: b.weight,
                    draining: b.draining,
                    tls: b.tls.then(|| {
                        b.sni
                            .clone()
                            .unwrap_or_else(|| host.trim_matches(['[', ']']).to_string())
                    }),
                });
            }
        }
        tiers.push(TierConfig {
            name: name.clone(),
            default: t.default,
            models: t.models.clone(),
            backends,
        });
    }
    let defaults = tiers.iter().filter(|t| t.default).count();
    if tiers.len() == 1 && defaults == 0 {
        // One tier serves everything; calling it the default is the only reading.
        tiers[0].default = true;
    } else if defaults == 0 && !tiers.is_empty() {
        errors.push(err(
            "tiers",
            "no default tier: mark exactly one tier `default: true`",
        ));
    } else if defaults > 1 {
        errors.push(err("tiers", "more than one tier is marked `default: true`"));
    }

    tiers
}

/// `affinity`: session keys, TTL, mode and policy, tenants.
fn validate_affinity(
    a: &FileAffinity,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) -> AffinityConfig {
    let session_headers = validate_headers("affinity.session_headers", &a.session_headers, errors);
    let parent_session_headers = validate_headers(
        "affinity.parent_session_headers",
        &a.parent_session_headers,
        errors,
    );
    for h in &parent_session_headers {
        if session_headers.contains(h) {
            errors.push(err(
                "affinity.parent_session_headers",
                format!("`{h}` is also a session header"),
            ));
        }
    }
    let mut body_session_fields = Vec::new();
    for (i, f) in a.body_session_fields.iter().enumerate() {
        let path: Vec<String> = f.split('.').map(str::to_string).collect();
        if path.iter().any(|p| p.is_empty()) {
            errors.push(err(
                format!("affinity.body_session_fields[{i}]"),
                format!("`{f}` is not a dotted field path"),
            ));
        } else {
            body_session_fields.push(path);
        }
    }
    if a.hash_key.is_empty() {
        errors.push(err("affinity.hash_key", "must not be empty"));
    } else if a.hash_key == PLACEHOLDER_HASH_KEY {
        warnings.push(
            "affinity.hash_key: still the placeholder `change-me`; anyone who knows it can aim sessions at a backend"
                .to_string(),
        );
    }
    if a.max_bindings == 0 {
        errors.push(err("affinity.max_bindings", "must be greater than 0"));
    }
    if a.sticky_ttl_seconds > 365 * 24 * 3600 {
        errors.push(err(
            "affinity.sticky_ttl_seconds",
            "must be at most one year",
        ));
    }

    let mode = match a.mode.as_str() {
        "hard" => crate::affinity::policy::Mode::Hard,
        "soft" => crate::affinity::policy::Mode::Soft,
        other => {
            errors.push(err(
                "affinity.mode",
                format!("`{other}` is not `hard` or `soft`"),
            ));
            crate::affinity::policy::Mode::Hard
        }
    };
    let soft_policy = {
        use crate::affinity::policy::SoftPolicy;
        match a.soft_policy.as_deref() {
            Some("cost") => SoftPolicy::Cost,
            Some("in_flight") => SoftPolicy::InFlight,
            None if a.soft_max_in_flight > 0 => SoftPolicy::InFlight,
            None => SoftPolicy::Cost,
            Some(other) => {
                errors.push(err(
                    "affinity.soft_policy",
                    format!("`{other}` is not `cost` or `in_flight`"),
                ));
                SoftPolicy::Cost
            }
        }
    };
    if !(a.prior_prefill_us_per_token.is_finite() && a.prior_prefill_us_per_token > 0.0) {
        errors.push(err(
            "affinity.prior_prefill_us_per_token",
            "must be a number greater than 0",
        ));
    }
    let session_final_headers = validate_headers(
        "affinity.session_final_headers",
        &a.session_final_headers,
        errors,
    );
    let parent_agent_headers = validate_headers(
        "affinity.parent_agent_headers",
        &a.parent_agent_headers,
        errors,
    );
    let store = validate_store(&a.store, a.sticky_ttl_seconds, errors);
    let prefix = validate_prefix(&a.prefix, errors);
    let tenant = match (&a.tenant_header, a.tenant_from_authorization) {
        (Some(_), true) => {
            errors.push(err(
                "affinity.tenant_header",
                "set tenant_header or tenant_from_authorization, not both",
            ));
            TenantSource::None
        }
        (Some(h), false) => match header_name(h) {
            Some(name) => TenantSource::Header(name),
            None => {
                errors.push(err(
                    "affinity.tenant_header",
                    format!("`{h}` is not a valid header name"),
                ));
                TenantSource::None
            }
        },
        (None, true) => TenantSource::Authorization,
        (None, false) => TenantSource::None,
    };

    AffinityConfig {
        sticky_ttl: (a.sticky_ttl_seconds > 0).then(|| Duration::from_secs(a.sticky_ttl_seconds)),
        session_headers,
        parent_session_headers,
        body_session_fields,
        hash_key: a.hash_key.clone(),
        max_bindings: a.max_bindings,
        mode,
        soft_max_in_flight: a.soft_max_in_flight,
        soft_policy,
        cost: crate::affinity::policy::CostParams {
            prior_prefill_us_per_token: a.prior_prefill_us_per_token,
            hysteresis_us: a.move_hysteresis_ms.saturating_mul(1000),
            cooldown_ms: a.move_cooldown_ms,
            max_moves: a.max_moves_per_session,
        },
        single_flight_wait: Duration::from_millis(a.single_flight_wait_ms),
        session_final_headers,
        parent_agent_headers,
        allow_explicit_target: a.allow_explicit_target,
        tenant,
        store,
        prefix,
    }
}

/// `affinity.prefix`: prefix-aware routing.
fn validate_prefix(
    p: &FilePrefix,
    errors: &mut Vec<ConfigError>,
) -> crate::affinity::prefix::PrefixConfig {
    if !(16..=65536).contains(&p.block_bytes) {
        errors.push(err(
            "affinity.prefix.block_bytes",
            "must be between 16 and 65536",
        ));
    }
    if p.max_memory_bytes < 1 << 20 {
        errors.push(err(
            "affinity.prefix.max_memory_bytes",
            "must be at least 1048576 (1 MiB)",
        ));
    }
    if p.max_read_bytes < p.block_bytes {
        errors.push(err(
            "affinity.prefix.max_read_bytes",
            "must be at least block_bytes",
        ));
    }
    if p.ttl_seconds == 0 || p.ttl_seconds > 7 * 24 * 3600 {
        errors.push(err(
            "affinity.prefix.ttl_seconds",
            "must be between 1 and 604800 (a week)",
        ));
    }
    crate::affinity::prefix::PrefixConfig {
        enabled: p.enabled,
        block_bytes: p.block_bytes.clamp(16, 65536),
        max_memory_bytes: p.max_memory_bytes.max(1 << 20),
        max_read_bytes: p.max_read_bytes.max(p.block_bytes),
        ttl: Duration::from_secs(p.ttl_seconds.clamp(1, 7 * 24 * 3600)),
    }
}

/// `affinity.store`: local, or Redis shared by a fleet.
fn validate_store(
    f: &FileStore,
    ttl_s: u64,
    errors: &mut Vec<ConfigError>,
) -> crate::affinity::store::StoreConfig {
    use crate::affinity::store::{StoreConfig, StoreKind};
    let kind = match f.kind.as_str() {
        "local" => StoreKind::Local,
        "redis" => StoreKind::Redis,
        other => {
            errors.push(err(
                "affinity.store.kind",
                format!("`{other}` is not `local` or `redis`"),
            ));
            StoreKind::Local
        }
    };
    let tls = crate::affinity::store::StoreTls {
        ca_file: f.tls_ca_file.clone(),
        cert_file: f.tls_cert_file.clone(),
        key_file: f.tls_key_file.clone(),
    };
    if f.timeout_ms == 0 {
        errors.push(err("affinity.store.timeout_ms", "must be greater than 0"));
    }
    if !(50..=3_600_000).contains(&f.heartbeat_ms) {
        errors.push(err(
            "affinity.store.heartbeat_ms",
            "must be between 50 and 3600000",
        ));
    }
    if f.revalidate_ms == Some(0) {
        errors.push(err(
            "affinity.store.revalidate_ms",
            "must be greater than 0",
        ));
    }
    let revalidate_ms = f
        .revalidate_ms
        .unwrap_or_else(|| (ttl_s.saturating_mul(1000) / 4).clamp(1000, 60_000));
    let cfg = StoreConfig {
        kind,
        url: f.url.clone(),
        key_prefix: f.key_prefix.clone(),
        timeout: Duration::from_millis(f.timeout_ms),
        revalidate: Duration::from_millis(revalidate_ms.max(1)),
        tls,
        required: f.required,
        heartbeat: Duration::from_millis(f.heartbeat_ms.max(1)),
    };
    if cfg.kind == StoreKind::Redis {
        if let Err(e) = crate::affinity::store::client(&cfg) {
            errors.push(err("affinity.store.url", e));
        }
    }
    cfg
}

/// `admin`: where the admin API listens and who may use it.
fn validate_admin(a: &FileAdmin, errors: &mut Vec<ConfigError>) -> AdminConfig {
    let admin_listen = parse_addr("admin.listen", &a.listen, errors);
    if a.token.as_deref() == Some("") {
        errors.push(err("admin.token", "must not be empty (omit it to disable)"));
    }
    if let Some(addr) = admin_listen {
        if !addr.ip().is_loopback() && a.token.is_none() && !a.insecure {
            errors.push(err(
                "admin.listen",
                format!(
                    "{addr} is reachable from other hosts and admin.token is not set: anyone \
                     could drain backends and delete sessions (set admin.token, listen on \
                     127.0.0.1, or set admin.insecure: true)"
                ),
            ));
        }
    }

    AdminConfig {
        listen: admin_listen.unwrap_or(UNSPECIFIED),
        token: a.token.clone(),
    }
}

/// `health`: the active health checks.
fn validate_health(h: &FileHealth, errors: &mut Vec<ConfigError>) -> HealthConfig {
    if !h.path.starts_with('/') {
        errors.push(err("health.path", "must start with `/`"));
    }
    if h.interval_ms < 10 {
        errors.push(err("health.interval_ms", "must be at least 10"));
    }
    if h.timeout_ms == 0 {
        errors.push(err("health.timeout_ms", "must be greater than 0"));
    }
    if h.consecutive_failures == 0 || h.consecutive_successes == 0 {
        errors.push(err(
            "health",
            "consecutive_failures and consecutive_successes must be at least 1",
        ));
    }

    HealthConfig {
        path: h.path.clone(),
        interval: Duration::from_millis(h.interval_ms),
        timeout: Duration::from_millis(h.timeout_ms),
        consecutive_failures: h.consecutive_failures,
        consecutive_successes: h.consecutive_successes,
    }
}

fn valid_tier_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
server:
  listen: ["127.0.0.1:8080"]
tiers:
  default:
    default: true
    models: ["qwen3-8b"]
    backends:
      - { id: vllm-0, addr: "127.0.0.1:8001", weight: 1 }
      - { id: vllm-1, addr: "127.0.0.1:8002", weight: 2 }
affinity:
  sticky_ttl_seconds: 1800
  session_headers: [x-session-id, X-Dynamo-Session-Id]
  parent_session_headers: [x-parent-session-id]
  hash_key: "s3cret"
health:
  path: /health
  interval_ms: 1000
metrics:
  listen: "127.0.0.1:9091"
"#;

    fn keys(text: &str) -> Vec<String> {
        Config::from_yaml(text)
            .unwrap_err()
            .0
            .into_iter()
            .map(|e| e.key)
            .collect()
    }

    #[test]
    fn spec_example_is_valid() {
        let c = Config::from_yaml(GOOD).unwrap();
        assert_eq!(c.tiers.len(), 1);
        assert_eq!(c.tiers[0].backends[1].weight, 2);
        assert_eq!(c.affinity.session_headers[1], "x-dynamo-session-id");
        assert_eq!(c.affinity.sticky_ttl, Some(Duration::from_secs(1800)));
        assert!(c.warnings.is_empty());
    }

    #[test]
    fn header_names_are_validated_once_and_deduplicated() {
        let text = GOOD.replace(
            "session_headers: [x-session-id, X-Dynamo-Session-Id]",
            "session_headers: [x-session-id, X-Session-ID, \"bad header\"]\n  tenant_header: \"x:tenant\"",
        );
        assert_eq!(
            keys(&text),
            ["affinity.session_headers[2]", "affinity.tenant_header"]
        );
        let text = GOOD.replace("X-Dynamo-Session-Id", "X-Session-ID");
        let c = Config::from_yaml(&text).unwrap();
        assert_eq!(c.affinity.session_headers, ["x-session-id"]);
    }

    #[test]
    fn unknown_key_is_named() {
        let text = GOOD.replace("weight: 2", "wieght: 2");
        let e = Config::from_yaml(&text).unwrap_err();
        assert_eq!(e.0[0].key, "tiers.default.backends[1].wieght");
        assert!(e.0[0].message.contains("wieght"), "{}", e);
    }

    #[test]
    fn duplicate_ids_bad_addresses_and_empty_tiers_are_errors() {
        let text = GOOD.replace("id: vllm-1", "id: vllm-0");
        assert_eq!(keys(&text), vec!["tiers.default.backends[1].id"]);
        let text = GOOD.replace("127.0.0.1:8002", "not an address");
        assert_eq!(keys(&text), vec!["tiers.default.backends[1].addr"]);
        let text = r#"
tiers:
  a: { default: true, backends: [] }
"#;
        assert_eq!(keys(text), vec!["tiers.a.backends"]);
    }

    #[test]
    fn default_tier_rules() {
        let two = r#"
tiers:
  a: { backends: [{id: a0, addr: "127.0.0.1:1"}] }
  b: { backends: [{id: b0, addr: "127.0.0.1:2"}] }
"#;
        assert_eq!(keys(two), vec!["tiers"]);
        let one = r#"
tiers:
  only: { backends: [{id: a0, addr: "127.0.0.1:1"}] }
"#;
        let c = Config::from_yaml(one).unwrap();
        assert!(c.default_tier().name == "only");
        assert!(
            !c.warnings.is_empty(),
            "placeholder hash key is warned about"
        );
    }

    #[test]
    fn ttl_zero_disables_affinity() {
        let c =
            Config::from_yaml(&GOOD.replace("sticky_ttl_seconds: 1800", "sticky_ttl_seconds: 0"))
                .unwrap();
        assert_eq!(c.affinity.sticky_ttl, None);
    }

    #[test]
    fn model_in_two_tiers_is_an_error() {
        let text = r#"
tiers:
  a: { default: true, models: [m], backends: [{id: a0, addr: "127.0.0.1:1"}] }
  b: { models: [m], backends: [{id: b0, addr: "127.0.0.1:2"}] }
"#;
        assert_eq!(keys(text), vec!["tiers.b.models"]);
    }

    #[test]
    fn an_admin_api_reachable_from_other_hosts_needs_a_token() {
        let open = format!("{GOOD}admin:\n  listen: \"0.0.0.0:9092\"\n");
        assert_eq!(keys(&open), vec!["admin.listen"]);
        for ok in [
            format!("{GOOD}admin:\n  listen: \"0.0.0.0:9092\"\n  token: t0ken\n"),
            format!("{GOOD}admin:\n  listen: \"0.0.0.0:9092\"\n  insecure: true\n"),
            format!("{GOOD}admin:\n  listen: \"127.0.0.1:9092\"\n"),
        ] {
            assert!(Config::from_yaml(&ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn backend_ids_must_fit_in_a_header() {
        for bad in ["vllm é", "vllm 0", "vllm\\u0007"] {
            let text = GOOD.replace("id: vllm-1", &format!("id: \"{bad}\""));
            assert_eq!(keys(&text), vec!["tiers.default.backends[1].id"], "{bad}");
        }
    }

    #[test]
    fn the_store_section_is_checked() {
        let redis = GOOD.replace(
            "  hash_key: \"s3cret\"\n",
            "  hash_key: \"s3cret\"\n  store: { kind: redis, url: \"redis://127.0.0.1:6379\" }\n",
        );
        let c = Config::from_yaml(&redis).unwrap();
        assert_eq!(
            c.affinity.store.kind,
            crate::affinity::store::StoreKind::Redis
        );
        // A quarter of the 30-minute TTL, capped at a minute.
        assert_eq!(c.affinity.store.revalidate, Duration::from_secs(60));
        let bad = redis.replace("redis://127.0.0.1:6379", "http://x");
        assert_eq!(keys(&bad), vec!["affinity.store.url"]);
        let kind = redis.replace("kind: redis", "kind: etcd");
        assert_eq!(keys(&kind), vec!["affinity.store.kind"]);
        let unix = redis.replace("redis://127.0.0.1:6379", "redis+unix:///run/redis.sock");
        assert!(Config::from_yaml(&unix).is_ok());
        // TLS files need a rediss:// URL, and must be readable.
        let tls_on_plain = redis.replace(
            "url: \"redis://",
            "tls_ca_file: /etc/hostname, url: \"redis://",
        );
        assert_eq!(keys(&tls_on_plain), vec!["affinity.store.url"]);
        let missing = redis.replace(
            "url: \"redis://",
            "tls_ca_file: /nonexistent/ca.pem, url: \"rediss://",
        );
        assert_eq!(keys(&missing), vec!["affinity.store.url"]);
        let half = redis.replace(
            "url: \"redis://",
            "tls_cert_file: /etc/hostname, url: \"rediss://",
        );
        assert_eq!(keys(&half), vec!["affinity.store.url"]);
        // A file that is there but holds no PEM certificate is refused too.
        let garbage = redis.replace(
            "url: \"redis://",
            "tls_ca_file: /etc/hostname, url: \"rediss://",
        );
        assert_eq!(keys(&garbage), vec!["affinity.store.url"]);
    }

    #[test]
    fn the_prefix_section_is_on_by_default_and_checked() {
        let c = Config::from_yaml(GOOD).unwrap();
        assert!(c.affinity.prefix.enabled);
        assert_eq!(c.affinity.prefix.max_memory_bytes, 64 << 20);
        let off = GOOD.replace(
            "  hash_key: \"s3cret\"\n",
            "  hash_key: \"s3cret\"\n  prefix: { enabled: false }\n",
        );
        assert!(!Config::from_yaml(&off).unwrap().affinity.prefix.enabled);
        let bad = GOOD.replace(
            "  hash_key: \"s3cret\"\n",
            "  hash_key: \"s3cret\"\n  prefix: { block_bytes: 4, max_memory_bytes: 10, ttl_seconds: 0 }\n",
        );
        assert_eq!(
            keys(&bad),
            vec![
                "affinity.prefix.block_bytes",
                "affinity.prefix.max_memory_bytes",
                "affinity.prefix.ttl_seconds"
            ]
        );
        let unknown = GOOD.replace(
            "  hash_key: \"s3cret\"\n",
            "  hash_key: \"s3cret\"\n  prefix: { blocks: 1 }\n",
        );
        assert_eq!(keys(&unknown), vec!["affinity.prefix.blocks"]);
    }
}
