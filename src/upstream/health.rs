//! Active health checks: Pingora's `HttpHealthCheck` (`GET health.path`, 200 =
//! healthy) over one shared registry, behind a wrapper whose settings a reload
//! can replace (Pingora allows setting a registry's check only once).

use crate::config::{Config, HealthConfig};
use arc_swap::ArcSwap;
use async_trait::async_trait;
use pingora_core::connectors::http::Connector as HttpConnector;
use pingora_core::connectors::ConnectorOptions;
use pingora_core::Result;
use pingora_http::RequestHeader;
use pingora_load_balancing::health_check::{HealthCheck, HttpHealthCheck};
use pingora_load_balancing::{Backend, HealthCheckService, HealthRegistry};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Counts the flips of any backend's active-health verdict. Pingora calls
/// `health_status_change` after its own state holds the new verdict, so a
/// readiness read from its registry stays true until this moves.
static FLIPS: AtomicU64 = AtomicU64::new(1);

fn flips() -> u64 {
    FLIPS.load(Ordering::Acquire)
}

fn flipped() {
    FLIPS.fetch_add(1, Ordering::AcqRel);
}

/// What Pingora's registry last said of one backend's health checks, kept
/// until a verdict flips. Asking the registry hashes the backend's identity
/// and looks it up in a map (~650 instructions); the request path asks for
/// every backend of the tier on every request, so a fleet of 8 paid ~5,000
/// instructions per request for an answer that changes once in many
/// health-check intervals.
#[derive(Debug, Default)]
pub struct ReadyCache {
    /// `flips << 1 | ready`; 0 before the first read.
    cached: AtomicU64,
}

impl ReadyCache {
    /// The cached verdict, or `read()`'s when a flip happened since.
    pub fn get(&self, read: impl FnOnce() -> bool) -> bool {
        // Read the count first: a flip after this makes the stored value stale
        // at once, so a racing read of the old verdict is never kept.
        let now = flips();
        let cached = self.cached.load(Ordering::Acquire);
        if cached >> 1 == now {
            return cached & 1 == 1;
        }
        let ready = read();
        self.cached
            .store(now << 1 | ready as u64, Ordering::Release);
        ready
    }
}

/// The checks in force: one for plain backends, one per TLS backend (each
/// verifies its own server name).
struct Checks {
    plain: HttpHealthCheck,
    tls: HashMap<std::net::SocketAddr, HttpHealthCheck>,
    /// Each address's backends as the configuration names them
    /// (`tier/id`): what a verdict's log line says.
    names: HashMap<std::net::SocketAddr, String>,
}

pub struct ReloadableCheck {
    inner: ArcSwap<Checks>,
}

fn checks(config: &Config) -> Checks {
    let tls = config
        .tiers
        .iter()
        .flat_map(|t| &t.backends)
        .filter_map(|b| {
            let sni = b.tls.as_ref()?;
            let mut check = http_check(&config.health, sni, true);
            let mut opts = ConnectorOptions::new(1);
            opts.ca_file = config.server.upstream_ca_file.clone();
            check.set_connector(HttpConnector::new(Some(opts)));
            Some((b.addr, check))
        })
        .collect();
    let mut names: HashMap<std::net::SocketAddr, String> = HashMap::new();
    for t in &config.tiers {
        for b in &t.backends {
            let name = names.entry(b.addr).or_default();
            if !name.is_empty() {
                name.push_str(", ");
            }
            name.push_str(&format!("{}/{}", t.name, b.id));
        }
    }
    Checks {
        plain: http_check(&config.health, "localhost", false),
        tls,
        names,
    }
}

fn http_check(cfg: &HealthConfig, host: &str, tls: bool) -> HttpHealthCheck {
    let mut check = HttpHealthCheck::new(host, tls);
    let mut req = RequestHeader::build("GET", cfg.path.as_bytes(), None)
        .expect("a validated path builds a request");
    let _ = req.append_header("Host", host);
    let _ = req.append_header("User-Agent", "agent-gateway-health");
    check.req = req;
    check.peer_template.options.connection_timeout = Some(cfg.timeout);
    check.peer_template.options.read_timeout = Some(cfg.timeout);
    check.peer_template.options.total_connection_timeout = Some(cfg.timeout);
    check.consecutive_failure = cfg.consecutive_failures;
    check.consecutive_success = cfg.consecutive_successes;
    check
}

impl ReloadableCheck {
    pub fn new(config: &Config) -> Arc<Self> {
        Arc::new(ReloadableCheck {
            inner: ArcSwap::from_pointee(checks(config)),
        })
    }

    pub fn update(&self, config: &Config) {
        self.inner.store(Arc::new(checks(config)));
    }
}

impl Checks {
    /// A TLS backend is checked over TLS with its own server name, the
    /// rest with the plain check.
    async fn check(&self, target: &Backend) -> Result<()> {
        let tls = target.addr.as_inet().and_then(|addr| self.tls.get(addr));
        match tls {
            Some(check) => check.check(target).await,
            None => self.plain.check(target).await,
        }
    }
}

#[async_trait]
impl HealthCheck for ReloadableCheck {
    async fn check(&self, target: &Backend) -> Result<()> {
        self.inner.load_full().check(target).await
    }

    fn health_threshold(&self, success: bool) -> usize {
        self.inner.load().plain.health_threshold(success)
    }
}

/// Forward to the shared wrapper (the registry wants an owned box).
struct Shared(Arc<ReloadableCheck>);

#[async_trait]
impl HealthCheck for Shared {
    async fn check(&self, target: &Backend) -> Result<()> {
        self.0.check(target).await
    }
    async fn health_status_change(&self, target: &Backend, healthy: bool) {
        flipped();
        // Pingora's own line names the backend by a debug struct; this one
        // by its tier and id.
        let Some(addr) = target.addr.as_inet() else {
            return;
        };
        let checks = self.0.inner.load();
        let name = checks
            .names
            .get(addr)
            .map_or("(discovered)", String::as_str);
        let path = checks.plain.req.uri.path();
        match healthy {
            true => log::info!("backend {name} ({addr}) passes its health checks (GET {path}) again"),
            false => log::warn!("backend {name} ({addr}) fails its health checks (GET {path}): no new requests go to it"),
        }
    }
    fn health_threshold(&self, success: bool) -> usize {
        self.0.health_threshold(success)
    }
}

/// A registry checked by `check`, and the background service that runs it
/// every `health.interval` (checking all targets in parallel).
pub fn registry_and_service(
    cfg: &HealthConfig,
    check: &Arc<ReloadableCheck>,
) -> (Arc<HealthRegistry>, HealthCheckService) {
    // Health is keyed by address alone, so a reload that changes a backend's
    // weight keeps its health state.
    let registry = Arc::new(HealthRegistry::with_equivalence(|b: &Backend| {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        b.addr.hash(&mut h);
        h.finish()
    }));
    registry.set_health_check(Box::new(Shared(Arc::clone(check))));
    let mut service = HealthCheckService::new(Arc::clone(&registry));
    service.health_check_frequency = Some(cfg.interval);
    service.parallel_health_check = true;
    (registry, service)
}

/// `check --connect`: every backend of `config` checked once, as the
/// gateway checks it (`GET health.path`, 200 healthy; a TLS backend over
/// TLS), in configuration order: its tier, id and address, and why it
/// failed. Blocking: the command runs before any runtime.
pub fn check_once(config: &Config) -> Vec<(String, String, std::net::SocketAddr, Option<String>)> {
    let checks = checks(config);
    let backends = config
        .tiers
        .iter()
        .flat_map(|t| t.backends.iter().map(move |b| (t, b)));
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return backends
                .map(|(t, b)| (t.name.clone(), b.id.clone(), b.addr, Some(e.to_string())))
                .collect()
        }
    };
    rt.block_on(async {
        let mut out = Vec::new();
        for (t, b) in backends {
            let failed = match Backend::new(&b.addr.to_string()) {
                Ok(target) => checks
                    .check(&target)
                    .await
                    .err()
                    .map(|e| e.to_string().trim().to_string()),
                Err(e) => Some(e.to_string()),
            };
            out.push((t.name.clone(), b.id.clone(), b.addr, failed));
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn ready_cache_asks_again_only_after_a_flip() {
        let cache = ReadyCache::default();
        let asked = &Cell::new(0);
        let ask = |verdict: bool| {
            move || {
                asked.set(asked.get() + 1);
                verdict
            }
        };
        assert!(cache.get(ask(true)));
        assert!(cache.get(ask(false)), "no flip: the cached verdict stands");
        assert_eq!(asked.get(), 1);
        flipped();
        assert!(
            !cache.get(ask(false)),
            "a flip: the registry is asked again"
        );
        assert!(!cache.get(ask(true)));
        assert_eq!(asked.get(), 2);
    }
}
