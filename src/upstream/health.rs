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
use std::sync::Arc;

/// The checks in force: one for plain backends, one per TLS backend (each
/// verifies its own server name).
struct Checks {
    plain: HttpHealthCheck,
    tls: HashMap<std::net::SocketAddr, HttpHealthCheck>,
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
    Checks {
        plain: http_check(&config.health, "localhost", false),
        tls,
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

#[async_trait]
impl HealthCheck for ReloadableCheck {
    async fn check(&self, target: &Backend) -> Result<()> {
        let checks = self.inner.load_full();
        let tls = target.addr.as_inet().and_then(|addr| checks.tls.get(addr));
        match tls {
            Some(check) => check.check(target).await,
            None => checks.plain.check(target).await,
        }
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
