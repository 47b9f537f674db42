//! DNS discovery (a tier's `discovery`): its backends are the addresses a
//! DNS name resolves to (A/AAAA, one port) or the targets of its SRV records,
//! asked of `discovery.resolvers` (else the system's) every `refresh_ms`:
//! what a Kubernetes headless Service or Consul's DNS gives.
//!
//! [`DnsDiscovery`] is Pingora's `ServiceDiscovery` for one name. The
//! [`Discovery`] service asks it on each tier's schedule; a changed answer
//! becomes the tier's membership through the same path as a reload
//! ([`Gateway::apply`]): a new address is health-checked before it takes
//! sessions, a vanished one is a removed backend (its sessions `broken` and
//! placed again at their next turn). A backend's id is its address, so an
//! address that stays keeps every binding. A failed or empty answer keeps the
//! last good set, and `agentserve_discovery_stale{tier}` says so.

use crate::config::{BackendConfig, Config, DnsTarget, TierConfig, TierDiscovery};
use crate::gateway::Gateway;
use hickory_resolver::config::{ConnectionConfig, NameServerConfig, ResolverConfig};
use hickory_resolver::net::runtime::TokioRuntimeProvider;
use hickory_resolver::proto::rr::RData;
use hickory_resolver::TokioResolver;
use pingora_load_balancing::discovery::ServiceDiscovery;
use pingora_load_balancing::Backend;
use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A lookup that takes longer than this counts as failed.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the service looks for tiers a reload gave `discovery`.
const IDLE_TICK: Duration = Duration::from_secs(1);

/// The resolver for `discovery.resolvers` (empty: /etc/resolv.conf). It
/// keeps no cache: each refresh asks the servers.
pub fn resolver(servers: &[SocketAddr]) -> Result<Arc<TokioResolver>, String> {
    let mut builder = if servers.is_empty() {
        TokioResolver::builder_tokio().map_err(|e| format!("the system's resolver: {e}"))?
    } else {
        let name_servers = servers
            .iter()
            .map(|s| {
                let conn = |mut c: ConnectionConfig| {
                    c.port = s.port();
                    c
                };
                NameServerConfig::new(
                    s.ip(),
                    true,
                    vec![conn(ConnectionConfig::udp()), conn(ConnectionConfig::tcp())],
                )
            })
            .collect();
        TokioResolver::builder_with_config(
            ResolverConfig::from_name_servers(name_servers),
            TokioRuntimeProvider::default(),
        )
    };
    let opts = builder.options_mut();
    opts.cache_size = 0;
    opts.timeout = Duration::from_secs(2);
    opts.attempts = 2;
    builder
        .build()
        .map(Arc::new)
        .map_err(|e| format!("building the resolver: {e}"))
}

/// Pingora's service discovery for one tier's DNS name.
pub struct DnsDiscovery {
    resolver: Arc<TokioResolver>,
    target: DnsTarget,
}

impl DnsDiscovery {
    pub fn new(resolver: Arc<TokioResolver>, target: DnsTarget) -> DnsDiscovery {
        DnsDiscovery { resolver, target }
    }

    /// The addresses (with SRV weights) the name resolves to now.
    async fn lookup(&self) -> Result<BTreeSet<(SocketAddr, u32)>, String> {
        let mut out = BTreeSet::new();
        match &self.target {
            DnsTarget::Host { name, port } => {
                let ips = self
                    .resolver
                    .lookup_ip(name.as_str())
                    .await
                    .map_err(|e| format!("{name}: {e}"))?;
                out.extend(ips.iter().map(|ip| (SocketAddr::new(ip, *port), 1)));
            }
            DnsTarget::Srv { name } => {
                let records = self
                    .resolver
                    .srv_lookup(name.as_str())
                    .await
                    .map_err(|e| format!("{name}: {e}"))?;
                let srvs: Vec<_> = records
                    .answers()
                    .iter()
                    .filter_map(|r| match &r.data {
                        RData::SRV(s) => Some(s.clone()),
                        _ => None,
                    })
                    .collect();
                // The best (lowest) priority's targets; the rest are fallbacks
                // for when those are unreachable, which health checks handle.
                let best = srvs.iter().map(|s| s.priority).min();
                for s in srvs.iter().filter(|s| Some(s.priority) == best) {
                    let target = s.target.to_utf8();
                    let ips = self
                        .resolver
                        .lookup_ip(s.target.clone())
                        .await
                        .map_err(|e| format!("{name}: SRV target {target}: {e}"))?;
                    let weight = u32::from(s.weight).max(1);
                    out.extend(ips.iter().map(|ip| (SocketAddr::new(ip, s.port), weight)));
                }
            }
        }
        Ok(out)
    }
}

#[async_trait::async_trait]
impl ServiceDiscovery for DnsDiscovery {
    async fn discover(&self) -> pingora_core::Result<(BTreeSet<Backend>, HashMap<u64, bool>)> {
        let found = tokio::time::timeout(LOOKUP_TIMEOUT, self.lookup())
            .await
            .map_err(|_| "timed out".to_string())
            .and_then(|r| r)
            .map_err(|e| pingora_core::Error::explain(pingora_core::ErrorType::InternalError, e))?;
        let backends = found
            .into_iter()
            .map(|(addr, weight)| Backend {
                addr: pingora_core::protocols::l4::socket::SocketAddr::Inet(addr),
                weight: weight as usize,
                ext: Default::default(),
            })
            .collect();
        Ok((backends, HashMap::new()))
    }
}

/// Ask `d` for `tier`'s backends, as the tier would configure them (an
/// empty list: the name has no addresses).
async fn ask(d: &DnsDiscovery, tier: &TierConfig) -> Result<Vec<BackendConfig>, String> {
    let (set, _) = d.discover().await.map_err(|e| e.to_string())?;
    Ok(set
        .iter()
        .filter_map(|b| Some(tier.discovered_backend(*b.addr.as_inet()?, b.weight as u32)))
        .collect())
}

/// Before the gateway serves: each discovering tier's first answer, so its
/// backends are there from the first request (a tier whose name does not
/// resolve yet starts empty and is asked again on its schedule).
pub fn first_answers(config: &mut Config) {
    if config.tiers.iter().all(|t| t.discovery.is_none()) {
        return;
    }
    let snapshot = config.clone();
    let found = std::thread::scope(|s| {
        s.spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let resolver = resolver(&snapshot.resolvers)?;
                let mut found = HashMap::new();
                for t in &snapshot.tiers {
                    let Some(d) = &t.discovery else { continue };
                    let dns = DnsDiscovery::new(Arc::clone(&resolver), d.target.clone());
                    match ask(&dns, t).await {
                        Ok(b) if b.is_empty() => log::warn!(
                            "tier {}: {} has no addresses yet; the tier starts empty",
                            t.name,
                            d.name()
                        ),
                        Ok(b) => {
                            found.insert(t.name.clone(), b);
                        }
                        Err(e) => log::warn!(
                            "tier {}: discovery failed ({e}); the tier starts empty",
                            t.name
                        ),
                    }
                }
                Ok::<_, String>(found)
            })
        })
        .join()
        .unwrap_or_else(|_| Err("the first lookup panicked".into()))
    });
    match found {
        Ok(found) => {
            for t in &mut config.tiers {
                if let Some(b) = found.get(&t.name) {
                    t.backends = b.clone();
                }
            }
        }
        Err(e) => log::warn!("DNS discovery: {e}; discovering tiers start empty"),
    }
}

/// Refreshes every discovering tier on its own schedule.
pub struct Discovery(pub Arc<Gateway>);

#[async_trait::async_trait]
impl pingora_core::services::background::BackgroundService for Discovery {
    async fn start(&self, mut shutdown: pingora_core::server::ShutdownWatch) {
        let gw = &self.0;
        let mut resolvers: Option<(Vec<SocketAddr>, Arc<TokioResolver>)> = None;
        let mut due: HashMap<String, Instant> = HashMap::new();
        loop {
            let routing = gw.routing();
            let config = &routing.config;
            let now = Instant::now();
            let tiers: Vec<(&TierConfig, &TierDiscovery)> = config
                .tiers
                .iter()
                .filter_map(|t| t.discovery.as_ref().map(|d| (t, d)))
                .collect();
            // Tiers asked now: new ones at once, the rest when due.
            let asked: Vec<_> = tiers
                .iter()
                .filter(|(t, _)| due.get(&t.name).is_none_or(|&at| at <= now))
                .collect();
            if !asked.is_empty() {
                let fresh = resolvers
                    .as_ref()
                    .filter(|(servers, _)| *servers == config.resolvers)
                    .map(|(_, r)| Arc::clone(r));
                let resolver = match fresh {
                    Some(r) => Ok(r),
                    None => resolver(&config.resolvers).inspect(|r| {
                        resolvers = Some((config.resolvers.clone(), Arc::clone(r)));
                    }),
                };
                let answers = futures_util::future::join_all(asked.iter().map(|(t, d)| {
                    let resolver = resolver.clone();
                    async move {
                        match resolver {
                            Ok(r) => ask(&DnsDiscovery::new(r, d.target.clone()), t).await,
                            Err(e) => Err(e),
                        }
                    }
                }))
                .await;
                for ((t, d), answer) in asked.iter().zip(answers) {
                    gw.discovered(&t.name, d.name(), answer);
                    due.insert(t.name.clone(), Instant::now() + d.refresh);
                }
            }
            due.retain(|name, _| tiers.iter().any(|(t, _)| &t.name == name));
            let next = due
                .values()
                .min()
                .map_or(IDLE_TICK, |at| at.saturating_duration_since(Instant::now()))
                .min(IDLE_TICK);
            tokio::select! {
                _ = shutdown.changed() => return,
                _ = tokio::time::sleep(next) => {}
            }
        }
    }
}
