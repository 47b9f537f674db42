//! Validation, section by section: each `validate_*` reads one section of
//! the file ([`super::file`]) and returns its validated part of
//! [`super::Config`], adding an error that names the key for each value it
//! refuses; [`validate`] puts the sections together.

use super::file::*;
use super::types::*;
use std::collections::{BTreeMap, HashSet};
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

mod telemetry;
pub(super) use telemetry::validate_telemetry;

pub(super) fn parse_addr(
    key: &str,
    value: &str,
    errors: &mut Vec<ConfigError>,
) -> Option<SocketAddr> {
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

/// A key that names one of two settings: the first (also when the key is
/// absent) or the second; anything else is an error, and the first.
fn one_of_two<T: Copy>(
    key: &str,
    value: Option<&str>,
    [(a, first), (b, second)]: [(&str, T); 2],
    errors: &mut Vec<ConfigError>,
) -> T {
    match value {
        None => first,
        Some(v) if v == a => first,
        Some(v) if v == b => second,
        Some(other) => {
            errors.push(err(key, format!("`{other}`: must be `{a}` or `{b}`")));
            first
        }
    }
}

pub(super) fn valid_header_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

/// A configured header name, lower-cased and parsed once (lookups by a
/// parsed name skip re-parsing it on every request).
pub(super) fn header_name(h: &str) -> Option<http::HeaderName> {
    let lower = h.to_ascii_lowercase();
    valid_header_name(&lower)
        .then(|| http::HeaderName::from_bytes(lower.as_bytes()).ok())
        .flatten()
}

pub(super) fn validate_headers(
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

pub(super) fn validate_placement(
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

pub(super) fn validate_outlier(o: &FileOutlier, errors: &mut Vec<ConfigError>) -> OutlierConfig {
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
    let on_hung = one_of_two(
        "outlier.on_hung",
        o.on_hung.as_deref(),
        [("resend", OnHung::Resend), ("fail", OnHung::Fail)],
        errors,
    );
    OutlierConfig {
        enabled: o.enabled,
        consecutive_failures: o.consecutive_failures.max(1),
        base_ejection: Duration::from_millis(o.base_ejection_ms),
        max_ejection: Duration::from_millis(o.max_ejection_ms),
        max_ejected_percent: o.max_ejected_percent.min(100),
        first_byte_timeout: (o.first_byte_timeout_ms > 0)
            .then(|| Duration::from_millis(o.first_byte_timeout_ms)),
        on_hung,
    }
}

/// Every section checked, every problem collected (not just the first).
pub(super) fn validate(file: FileConfig) -> Result<Config, ConfigErrors> {
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    let server = validate_server(&file.server, &mut errors);
    let tiers = validate_tiers(&file.tiers, file.admission.max_in_flight, &mut errors);
    let admission = validate_admission(&file.admission, &mut errors);
    let auth = validate_auth(&file.auth, &mut errors);
    let affinity = validate_affinity(&file.affinity, &mut errors);
    if auth.cache_salt == CacheSalt::Tenant
        && auth.keys_file.is_none()
        && affinity.tenant == TenantSource::None
    {
        errors.push(err(
            "auth.cache_salt",
            "`tenant` needs tenants: auth.keys_file, or affinity.tenant_header / tenant_from_authorization",
        ));
    }
    validate_secret(&affinity, &auth, &mut errors, &mut warnings);
    let admin = validate_admin(&file.admin, &mut errors);
    let health = validate_health(&file.health, &mut errors);
    let (placement, load) = validate_placement(&file.placement, &file.load, &mut errors);
    let outlier = validate_outlier(&file.outlier, &mut errors);
    let resolvers = validate_resolvers(&file.discovery, &mut errors);
    let telemetry = validate_telemetry(&file.telemetry, &|k| std::env::var(k).ok(), &mut errors);
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
        admission,
        auth,
        telemetry,
        resolvers,
        warnings,
    })
}

/// A tier's `discovery`: a DNS name with a port, or an SRV name.
fn tier_discovery(
    key: &str,
    d: &FileTierDiscovery,
    errors: &mut Vec<ConfigError>,
) -> Option<TierDiscovery> {
    let key = format!("{key}.discovery");
    let name_ok = |n: &str| {
        !n.is_empty()
            && n.len() <= 253
            && n.bytes()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'.' | b'-' | b'_'))
    };
    if !(100..=3_600_000).contains(&d.refresh_ms) {
        errors.push(err(
            format!("{key}.refresh_ms"),
            "must be between 100 and 3600000",
        ));
    }
    let target = match (&d.dns, &d.srv, d.port) {
        (Some(name), None, Some(port)) if name_ok(name) && port > 0 => DnsTarget::Host {
            name: name.clone(),
            port,
        },
        (Some(name), None, Some(_)) if name_ok(name) => {
            errors.push(err(format!("{key}.port"), "must be between 1 and 65535"));
            return None;
        }
        (Some(_), None, None) => {
            errors.push(err(
                format!("{key}.port"),
                "`dns` needs the port its addresses serve on",
            ));
            return None;
        }
        (None, Some(name), None) if name_ok(name) => DnsTarget::Srv { name: name.clone() },
        (None, Some(_), Some(_)) => {
            errors.push(err(
                format!("{key}.port"),
                "`srv` records carry their own ports",
            ));
            return None;
        }
        (Some(n), None, _) | (None, Some(n), _) => {
            errors.push(err(
                &key,
                format!("`{n}` is not a DNS name (letters, digits, `.`, `-`, `_`)"),
            ));
            return None;
        }
        _ => {
            errors.push(err(
                &key,
                "name exactly one of `dns` (with `port`) or `srv`",
            ));
            return None;
        }
    };
    Some(TierDiscovery {
        target,
        refresh: Duration::from_millis(d.refresh_ms),
    })
}

/// `discovery.resolvers`: `ip:port`, or an IP alone (port 53).
fn validate_resolvers(d: &FileDiscovery, errors: &mut Vec<ConfigError>) -> Vec<SocketAddr> {
    d.resolvers
        .iter()
        .filter_map(|r| {
            r.parse::<SocketAddr>()
                .ok()
                .or_else(|| {
                    r.parse::<std::net::IpAddr>()
                        .ok()
                        .map(|ip| SocketAddr::new(ip, 53))
                })
                .or_else(|| {
                    errors.push(err(
                        "discovery.resolvers",
                        format!("`{r}` is not an IP address or ip:port"),
                    ));
                    None
                })
        })
        .collect()
}

/// `admission`: the queue's bounds, deadline and headers.
pub(super) fn validate_admission(
    a: &FileAdmission,
    errors: &mut Vec<ConfigError>,
) -> AdmissionConfig {
    let mut header = |key: &str, h: &str, fallback: &'static str| {
        header_name(h).unwrap_or_else(|| {
            errors.push(err(key, format!("`{h}` is not a valid header name")));
            http::HeaderName::from_static(fallback)
        })
    };
    let priority_header = header(
        "admission.priority_header",
        &a.priority_header,
        "x-agent-serve-priority",
    );
    let max_wait_header = header(
        "admission.max_wait_header",
        &a.max_wait_header,
        "x-agent-serve-max-wait-ms",
    );
    let default_priority =
        crate::admission::Class::parse(&a.default_priority).unwrap_or_else(|| {
            errors.push(err(
                "admission.default_priority",
                "must be interactive | normal | batch",
            ));
            crate::admission::Class::Normal
        });
    if a.max_wait_ms > 3_600_000 {
        errors.push(err(
            "admission.max_wait_ms",
            "must be at most 3600000 (an hour)",
        ));
    }
    if a.prefill_queue_ms > 600_000 {
        errors.push(err(
            "admission.prefill_queue_ms",
            "must be at most 600000 (ten minutes; 0 turns it off)",
        ));
    }
    if a.max_queued == 0 || a.max_queued > 1_000_000 {
        errors.push(err("admission.max_queued", "must be between 1 and 1000000"));
    }
    AdmissionConfig {
        enabled: a.enabled,
        max_prefilling: a.max_prefilling,
        prefill_queue: Duration::from_millis(a.prefill_queue_ms.min(600_000)),
        max_wait: Duration::from_millis(a.max_wait_ms),
        max_queued: a.max_queued.clamp(1, 1_000_000),
        priority_header,
        max_wait_header,
        default_priority,
    }
}

/// What goes upstream as `Authorization`: `pass` | `strip` | `set` (with `key`).
fn upstream_authorization(
    at: &str,
    mode: Option<&str>,
    key: Option<&str>,
    errors: &mut Vec<ConfigError>,
) -> Option<UpstreamAuthorization> {
    let key_at = format!("{at}.upstream_key");
    match (mode, key) {
        (None, None) => None,
        (Some("pass"), None) => Some(UpstreamAuthorization::Pass),
        (Some("strip"), None) => Some(UpstreamAuthorization::Strip),
        (Some("set"), Some(k)) => match http::HeaderValue::from_str(k) {
            Ok(mut v) => {
                v.set_sensitive(true);
                Some(UpstreamAuthorization::Set(v))
            }
            Err(_) => {
                errors.push(err(key_at, "is not a valid header value"));
                None
            }
        },
        (Some("set"), None) => {
            errors.push(err(key_at, "`upstream_authorization: set` needs it"));
            None
        }
        (Some("pass" | "strip") | None, Some(_)) => {
            errors.push(err(
                key_at,
                "is used only with `upstream_authorization: set`",
            ));
            None
        }
        (Some(_), _) => {
            errors.push(err(
                format!("{at}.upstream_authorization"),
                "must be pass | strip | set",
            ));
            None
        }
    }
}

/// `auth`: client keys.
pub(super) fn validate_auth(a: &FileAuth, errors: &mut Vec<ConfigError>) -> AuthConfig {
    if a.required && a.keys_file.is_none() {
        errors.push(err("auth.required", "needs auth.keys_file"));
    }
    if a.keys_file.as_deref() == Some("") {
        errors.push(err("auth.keys_file", "must not be empty"));
    }
    let stream_over_limit = one_of_two(
        "auth.stream_over_limit",
        a.stream_over_limit.as_deref(),
        [
            ("finish", StreamOverLimit::Finish),
            ("cut", StreamOverLimit::Cut),
        ],
        errors,
    );
    let cache_salt = one_of_two(
        "auth.cache_salt",
        a.cache_salt.as_deref(),
        [("off", CacheSalt::Off), ("tenant", CacheSalt::Tenant)],
        errors,
    );
    AuthConfig {
        cache_salt,
        keys_file: a.keys_file.as_ref().map(std::path::PathBuf::from),
        required: a.required,
        stream_over_limit,
        upstream_authorization: upstream_authorization(
            "auth",
            a.upstream_authorization.as_deref(),
            a.upstream_key.as_deref(),
            errors,
        )
        // Once the gateway authenticates clients, their keys are its own
        // business: none goes upstream unless asked for.
        .unwrap_or(match a.keys_file {
            Some(_) => UpstreamAuthorization::Strip,
            None => UpstreamAuthorization::Pass,
        }),
    }
}

/// Stands in for an address that did not parse (the config is refused anyway).
const UNSPECIFIED: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0);

/// `server`: listeners, limits and timeouts.
pub(super) fn validate_server(s: &FileServer, errors: &mut Vec<ConfigError>) -> ServerConfig {
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
pub(super) fn validate_tiers(
    file_tiers: &BTreeMap<String, FileTier>,
    max_in_flight: u32,
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
        let discovery = t
            .discovery
            .as_ref()
            .and_then(|d| tier_discovery(&key, d, errors));
        match (&t.discovery, t.backends.is_empty()) {
            (None, true) => errors.push(err(
                format!("{key}.backends"),
                "a tier needs at least one backend (or `discovery`)",
            )),
            (Some(_), false) => errors.push(err(
                format!("{key}.discovery"),
                "a tier either lists `backends` or names `discovery`, not both",
            )),
            _ => {}
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
                    max_in_flight: b.max_in_flight.or(t.max_in_flight).unwrap_or(max_in_flight),
                    kv_events: b
                        .kv_events
                        .as_ref()
                        .and_then(|k| kv_events(&format!("{bkey}.kv_events"), k, errors)),
                });
            }
        }
        tiers.push(TierConfig {
            name: name.clone(),
            default: t.default,
            models: t.models.clone(),
            backends,
            upstream_authorization: upstream_authorization(
                &key,
                t.upstream_authorization.as_deref(),
                t.upstream_key.as_deref(),
                errors,
            ),
            discovery,
            max_in_flight: t.max_in_flight.unwrap_or(max_in_flight),
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

/// `affinity.hash_key` and `retired_hash_keys`: the fleet's secret. Where it
/// guards tenants' data or what clients are handed (response ids the
/// gateway issues, cache salts, client keys), a weak one is refused: one
/// issued id is enough to test guesses offline. Elsewhere (placement only)
/// it is a warning.
fn validate_secret(
    a: &AffinityConfig,
    auth: &AuthConfig,
    errors: &mut Vec<ConfigError>,
    warnings: &mut Vec<String>,
) {
    let guards =
        a.gateway_response_ids || auth.cache_salt == CacheSalt::Tenant || auth.keys_file.is_some();
    if let Some(why) = crate::secret::weakness(&a.hash_key) {
        if guards || a.hash_key.is_empty() {
            errors.push(err(
                "affinity.hash_key",
                format!(
                    "{why} (it keys the response ids the gateway issues, cache salts \
                     and tenants' fingerprints)"
                ),
            ));
        } else {
            warnings.push(format!(
                "affinity.hash_key {why}; anyone who guesses it can aim sessions at a backend"
            ));
        }
    }
    for (i, old) in a.retired_hash_keys.iter().enumerate() {
        let key = format!("affinity.retired_hash_keys[{i}]");
        if old.is_empty() || *old == a.hash_key {
            errors.push(err(
                key,
                "must be an earlier key, not empty nor the current one",
            ));
        } else if let Some(why) = crate::secret::weakness(old).filter(|_| guards) {
            // Ids forged under it would still open.
            errors.push(err(
                key,
                format!("{why}: a weak key retired still opens ids forged under it; leave it out"),
            ));
        }
    }
    if !a.gateway_response_ids && auth.keys_file.is_some() {
        errors.push(err(
            "affinity.response_ids",
            "`engine` with client keys on: an engine's own id is the same for every tenant \
             and shows where it lives; keep `gateway` (ids sealed for their tenant)",
        ));
    }
}

/// `affinity`: session keys, TTL, mode and policy, tenants.
pub(super) fn validate_affinity(a: &FileAffinity, errors: &mut Vec<ConfigError>) -> AffinityConfig {
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
    if a.max_bindings == 0 {
        errors.push(err("affinity.max_bindings", "must be greater than 0"));
    }
    if a.sticky_ttl_seconds > 365 * 24 * 3600 {
        errors.push(err(
            "affinity.sticky_ttl_seconds",
            "must be at most one year",
        ));
    }

    let gateway_response_ids = match a.response_ids.as_str() {
        "gateway" => true,
        "engine" => false,
        other => {
            errors.push(err(
                "affinity.response_ids",
                format!("`{other}` is not `gateway` or `engine`"),
            ));
            true
        }
    };
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
        retired_hash_keys: a.retired_hash_keys.clone(),
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
        gateway_response_ids,
        tenant,
        store,
        prefix,
    }
}

/// `affinity.prefix`: prefix-aware routing.
pub(super) fn validate_prefix(
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
    if p.probation_seconds == 0 || p.probation_seconds > 24 * 3600 {
        errors.push(err(
            "affinity.prefix.probation_seconds",
            "must be between 1 and 86400 (a day)",
        ));
    }
    crate::affinity::prefix::PrefixConfig {
        enabled: p.enabled,
        block_bytes: p.block_bytes.clamp(16, 65536),
        max_memory_bytes: p.max_memory_bytes.max(1 << 20),
        max_read_bytes: p.max_read_bytes.max(p.block_bytes),
        ttl: Duration::from_secs(p.ttl_seconds.clamp(1, 7 * 24 * 3600)),
        probation: Duration::from_secs(p.probation_seconds.clamp(1, 24 * 3600)),
    }
}

/// `affinity.store`: local, or Redis shared by a fleet.
pub(super) fn validate_store(
    f: &FileStore,
    ttl_s: u64,
    errors: &mut Vec<ConfigError>,
) -> crate::fleet::store::StoreConfig {
    use crate::fleet::store::{StoreConfig, StoreKind};
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
    let tls = crate::fleet::store::StoreTls {
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
        if let Err(e) = crate::fleet::store::client(&cfg) {
            errors.push(err("affinity.store.url", e));
        }
    }
    cfg
}

/// `admin`: where the admin API listens and who may use it.
pub(super) fn validate_admin(a: &FileAdmin, errors: &mut Vec<ConfigError>) -> AdminConfig {
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
pub(super) fn validate_health(h: &FileHealth, errors: &mut Vec<ConfigError>) -> HealthConfig {
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

pub(super) fn valid_tier_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

/// A backend's `kv_events`: `tcp://host:port` endpoints (a name or an
/// address; `*` is a publisher's bind-all, not a place to connect to), or
/// `ipc:///path` (an engine on the same host).
fn kv_events(
    key: &str,
    k: &super::file::FileKvEvents,
    errors: &mut Vec<ConfigError>,
) -> Option<super::types::KvEventsConfig> {
    let check = |field: &str, v: &str, errors: &mut Vec<ConfigError>| -> bool {
        let tcp = v.strip_prefix("tcp://").is_some_and(|hp| {
            hp.rsplit_once(':').is_some_and(|(h, p)| {
                !h.is_empty() && h != "*" && p.parse::<u16>().is_ok_and(|p| p > 0)
            })
        });
        let ipc = v.strip_prefix("ipc://").is_some_and(|p| p.starts_with('/'));
        let ok = tcp || ipc;
        if !ok {
            errors.push(err(
                format!("{key}.{field}"),
                format!(
                    "`{v}` is not a ZeroMQ endpoint to connect to (tcp://host:port or ipc:///path)"
                ),
            ));
        }
        ok
    };
    let mut ok = check("endpoint", &k.endpoint, errors);
    if let Some(r) = &k.replay {
        ok &= check("replay", r, errors);
    }
    const MAX: u64 = 1 << 30;
    if !(1024..=MAX).contains(&k.max_message_bytes) {
        errors.push(err(
            format!("{key}.max_message_bytes"),
            format!("must be between 1024 and {MAX} (1 GiB)"),
        ));
        ok = false;
    }
    ok.then(|| super::types::KvEventsConfig {
        endpoint: k.endpoint.clone(),
        replay: k.replay.clone(),
        topic: k.topic.clone(),
        max_message_bytes: k.max_message_bytes as usize,
    })
}
