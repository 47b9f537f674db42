//! The YAML file (SPEC §6) and the validated, typed [`Config`] the rest of the
//! gateway trusts. Every error names the key that is wrong.

mod file;
mod validate;

use file::FileConfig;
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
        let config = Config::from_yaml(&text)?;
        // A keys file that does not load is refused with the config: with
        // `auth.required` no one could get in.
        if let Some(keys) = &config.auth.keys_file {
            if let Err(e) = crate::auth::Auth::default().load(keys) {
                return Err(ConfigErrors(vec![err("auth.keys_file", e)]));
            }
        }
        Ok(config)
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
        validate::validate(file)
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
    fn a_tier_lists_backends_or_names_discovery() {
        let tier = |d: &str| {
            format!(
                "tiers:\n  default:\n    default: true\n    discovery: {d}\n\
                 discovery:\n  resolvers: [\"127.0.0.1:5353\", \"10.0.0.10\"]\n"
            )
        };
        let c = Config::from_yaml(&tier("{ dns: vllm.default.svc.cluster.local, port: 8000 }"))
            .unwrap();
        let d = c.tiers[0].discovery.as_ref().unwrap();
        assert_eq!(
            d.target,
            DnsTarget::Host {
                name: "vllm.default.svc.cluster.local".into(),
                port: 8000
            }
        );
        assert_eq!(d.refresh, Duration::from_secs(5));
        assert!(c.tiers[0].backends.is_empty());
        assert_eq!(c.resolvers[1], "10.0.0.10:53".parse().unwrap());
        let c = Config::from_yaml(&tier("{ srv: _http._tcp.vllm, refresh_ms: 1000 }")).unwrap();
        assert_eq!(
            c.tiers[0].discovery.as_ref().unwrap().target,
            DnsTarget::Srv {
                name: "_http._tcp.vllm".into()
            }
        );
        for (d, key) in [
            ("{ dns: vllm }", "tiers.default.discovery.port"),
            (
                "{ srv: _h._tcp.vllm, port: 80 }",
                "tiers.default.discovery.port",
            ),
            (
                "{ dns: vllm, srv: _h._tcp.vllm, port: 80 }",
                "tiers.default.discovery",
            ),
            ("{ dns: \"bad name\", port: 80 }", "tiers.default.discovery"),
            (
                "{ dns: vllm, port: 80, refresh_ms: 10 }",
                "tiers.default.discovery.refresh_ms",
            ),
        ] {
            assert_eq!(keys(&tier(d)), vec![key.to_string()], "{d}");
        }
        let both = GOOD.replace(
            "    backends:\n",
            "    discovery: { dns: vllm, port: 80 }\n    backends:\n",
        );
        assert_eq!(keys(&both), vec!["tiers.default.discovery".to_string()]);
        let bad_resolver = format!("{GOOD}discovery:\n  resolvers: [\"dns.example\"]\n");
        assert_eq!(keys(&bad_resolver), vec!["discovery.resolvers".to_string()]);
    }

    #[test]
    fn telemetry_takes_the_files_endpoint_else_the_otel_variables() {
        let run = |yaml: &str, vars: &[(&str, &str)]| {
            let file: file::FileTelemetry = serde_yaml::from_str(yaml).unwrap();
            let env = |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            };
            let mut errors = Vec::new();
            let t = validate::validate_telemetry(&file, &env, &mut errors);
            (t, errors.into_iter().map(|e| e.key).collect::<Vec<_>>())
        };
        let url = |t: &TelemetryConfig| t.otlp.as_ref().map(|o| o.traces_url.clone());
        let (t, e) = run("{}", &[]);
        assert_eq!((url(&t), e.len()), (None, 0), "off without an endpoint");
        assert_eq!(t.service_name, "agent-gateway");
        let base = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")];
        assert_eq!(
            url(&run("{}", &base).0).as_deref(),
            Some("http://collector:4318/v1/traces")
        );
        let traces = [("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://c:4318/custom")];
        assert_eq!(
            url(&run("{}", &traces).0).as_deref(),
            Some("http://c:4318/custom")
        );
        let file = "otlp: { endpoint: \"http://127.0.0.1:4318\" }";
        assert_eq!(
            url(&run(file, &base).0).as_deref(),
            Some("http://127.0.0.1:4318/v1/traces"),
            "the file wins"
        );
        let keyed = [
            base[0],
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "api-key=s%3Dcret, x-team=edge",
            ),
        ];
        let (t, e) = run("{}", &keyed);
        let headers = &t.otlp.unwrap().headers;
        assert!(e.is_empty());
        assert_eq!(headers.len(), 2);
        assert_eq!(
            (headers[0].0.as_str(), headers[0].1.to_str().unwrap()),
            ("api-key", "s=cret")
        );
        let bad = [base[0], ("OTEL_EXPORTER_OTLP_HEADERS", "no-equals-sign")];
        assert_eq!(
            run("{}", &bad).1,
            vec!["OTEL_EXPORTER_OTLP_HEADERS".to_string()]
        );
        let disabled = [
            base[0],
            ("OTEL_SDK_DISABLED", "true"),
            ("OTEL_SERVICE_NAME", "edge"),
        ];
        let (t, _) = run("{}", &disabled);
        assert_eq!((url(&t), t.service_name.as_str()), (None, "edge"));
        for (bad, key) in [
            (
                "otlp: { protocol: grpc, endpoint: \"http://c:4317\" }",
                "telemetry.otlp.protocol",
            ),
            (
                "otlp: { endpoint: \"https://c:4318\" }",
                "telemetry.otlp.endpoint",
            ),
            ("otlp: { endpoint: \"c:4318\" }", "telemetry.otlp.endpoint"),
            ("sample_ratio: 1.5", "telemetry.sample_ratio"),
            ("max_queued_spans: 0", "telemetry.max_queued_spans"),
        ] {
            assert_eq!(run(bad, &[]).1, vec![key.to_string()], "{bad}");
        }
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
