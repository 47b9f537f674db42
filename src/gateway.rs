//! The gateway's shared state: the current routing snapshot, the binding
//! table, health and metrics. Services (proxy, metrics, sweeper) hold an
//! `Arc<Gateway>`; a reload swaps the routing snapshot in place.

use crate::affinity::policy::DefaultPolicy;
use crate::affinity::Affinity;
use crate::config::{BackendConfig, Config};
use crate::metrics::Metrics;
use crate::upstream::health::ReloadableCheck;
use crate::upstream::{Routing, Slots, TooManyTiers};
use arc_swap::ArcSwap;
use pingora_load_balancing::health_check::HealthCheck;
use pingora_load_balancing::HealthRegistry;
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What a reload changed.
#[derive(Debug, Default)]
pub struct ReloadSummary {
    pub backends_added: Vec<String>,
    pub backends_removed: Vec<String>,
    /// Bindings to removed backends: each rebinds at its session's next turn.
    pub bindings_broken: u64,
    /// Keys that only a restart applies (listeners, table size, ...).
    pub needs_restart: Vec<&'static str>,
}

/// The affinity policy and placement a configuration asks for.
fn configure_affinity(affinity: &Affinity, config: &Config) {
    affinity.set_policy(DefaultPolicy {
        mode: config.affinity.mode,
        soft: config.affinity.soft_policy,
        soft_max_in_flight: config.affinity.soft_max_in_flight,
        cost: config.affinity.cost,
    });
    let p = &config.placement;
    affinity.set_placement(crate::affinity::Placement::new(
        p.first,
        crate::affinity::placement::bounded_hrw::BoundedHrw {
            balance_factor: p.balance_factor,
            speed_aware: p.speed_aware,
            queue_aware: p.queue_aware,
            prior_us_per_token: config.affinity.cost.prior_prefill_us_per_token,
        },
        p.load,
    ));
}

pub struct Gateway {
    routing: ArcSwap<Routing>,
    pub affinity: Arc<Affinity>,
    pub metrics: Arc<Metrics>,
    pub slots: Slots,
    pub health_registry: Arc<HealthRegistry>,
    pub health_check: Arc<ReloadableCheck>,
    /// The file `run --config` named, re-read on SIGHUP.
    pub config_path: Option<PathBuf>,
    /// The request trace log, when `trace.path` is set.
    pub trace: Option<crate::trace::TraceLog>,
    /// OpenTelemetry spans, when an OTLP endpoint is configured.
    pub telemetry: Option<Arc<crate::telemetry::Telemetry>>,
    /// Certificates of the TLS listeners, reloaded on SIGHUP.
    pub tls: Option<Arc<crate::tls::SniResolver>>,
    /// Request bodies held in memory (routing pre-reads, replay copies).
    pub body_budget: Arc<BodyBudget>,
    gauge_refresh: parking_lot::Mutex<()>,
    /// One configuration change at a time (a reload, a DNS answer).
    applying: parking_lot::Mutex<()>,
    /// Discovering tiers' last good backends, by tier.
    discovered: parking_lot::Mutex<HashMap<String, Vec<BackendConfig>>>,
    /// The fleet's shared bindings (`affinity.store: redis`).
    pub store: Option<Arc<crate::fleet::store::SharedStore>>,
    /// The same store, as admission reserves tenants' per-minute limits in it.
    pub fleet_rates: Option<Arc<dyn crate::admission::reserve::FleetRates>>,
    /// Prompts, their conversations and where their prefixes are cached
    /// (`affinity.prefix`).
    pub prefix: crate::affinity::prefix::Prefix,
    /// Which backend stored which response (`previous_response_id`).
    pub responses: crate::affinity::responses::ResponseRoutes,
    /// The lifecycle service handles SIGHUP (reload) now: `/healthz` says
    /// `starting` until then.
    pub lifecycle_started: std::sync::atomic::AtomicBool,
    /// Slots per backend and the queue for them (`admission`).
    pub admission: Arc<crate::admission::Admission>,
    /// Client keys (`auth.keys_file`).
    pub auth: crate::auth::Auth,
    /// The counters of requests without a known key.
    pub other_tenant: std::sync::OnceLock<crate::metrics::TenantCounters>,
}

/// Each backend's slots as `config` sets them: its `max_in_flight` with
/// admission on, else none (every request goes straight on).
fn configure_admission(admission: &crate::admission::Admission, routing: &Routing) {
    use crate::admission::{Limit, Prefill};
    let adm = &routing.config.admission;
    admission.set_fleet(routing.config.affinity.store.kind == crate::fleet::StoreKind::Redis);
    // None configured: one at a time where the answers show the engine's
    // prefills queue (a prefill budget counts work instead).
    let prefill = match adm.max_prefilling {
        0 if adm.prefill_queue.is_zero() => Prefill::Learn,
        0 => Prefill::None,
        n => Prefill::Fixed(n),
    };
    for (tier, tc) in routing.tiers.iter().zip(&routing.config.tiers) {
        for bc in &tc.backends {
            if let Some(b) = tier.backend_by_id(&bc.id) {
                let limit = match (adm.enabled, bc.max_in_flight) {
                    (false, _) => Limit::None,
                    // None configured: learned from the engine's gauges.
                    (true, 0) => Limit::Learn,
                    (true, n) => Limit::Fixed(n),
                };
                admission.set_limit(b.slot, limit, prefill);
            }
        }
    }
}

/// The tiers of the configuration in force, for the fleet's store (which
/// names backends by id, and outlives reloads).
impl crate::affinity::shared::Tiers for Gateway {
    fn by_name(&self, name: &str) -> Option<Arc<dyn crate::affinity::shared::TierBackends>> {
        let t = Arc::clone(self.routing().tier_by_name(name)?);
        Some(t)
    }
    fn by_index(&self, index: u16) -> Option<Arc<dyn crate::affinity::shared::TierBackends>> {
        let t = Arc::clone(self.routing().tiers.iter().find(|t| t.index == index)?);
        Some(t)
    }
}

impl Gateway {
    pub fn new(
        config: Arc<Config>,
        health_registry: Arc<HealthRegistry>,
        health_check: Arc<ReloadableCheck>,
        config_path: Option<PathBuf>,
        tls: Option<Arc<crate::tls::SniResolver>>,
    ) -> Result<Arc<Gateway>, TooManyTiers> {
        let metrics = Arc::new(Metrics::new());
        let slots = Slots::default();
        let routing = Routing::build(Arc::clone(&config), &slots, &health_registry, &metrics)?;
        let affinity = Affinity::new(config.affinity.max_bindings, config.affinity.sticky_ttl);
        let trace = config.trace.path.clone().and_then(|path| {
            match crate::trace::TraceLog::open(
                path.clone(),
                config.trace.max_bytes,
                config.trace.keep,
            ) {
                Ok(t) => Some(t),
                Err(e) => {
                    log::error!(
                        "request traces disabled: cannot open {}: {e}",
                        path.display()
                    );
                    None
                }
            }
        });
        let telemetry = crate::telemetry::Telemetry::new(&config.telemetry, &metrics).map(Arc::new);
        // Discovering tiers start with their first answer (`discovery::first_answers`).
        for t in config.tiers.iter().filter(|t| t.discovery.is_some()) {
            metrics
                .discovery_backends
                .with_label_values(&[&t.name])
                .set(t.backends.len() as i64);
        }
        configure_affinity(&affinity, &config);
        let store = match config.affinity.store.kind {
            crate::fleet::store::StoreKind::Local => None,
            crate::fleet::store::StoreKind::Redis => {
                match crate::fleet::store::SharedStore::new(
                    config.affinity.store.clone(),
                    Arc::clone(&metrics),
                ) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        log::error!("binding store disabled: {e}");
                        None
                    }
                }
            }
        };
        if let Some(store) = &store {
            affinity.set_store(Arc::new(crate::fleet::Fleet {
                store: Arc::clone(store),
            }));
        }
        let prefix = crate::affinity::prefix::Prefix::new(
            &config.affinity.prefix,
            routing.hasher.prefix_seed(),
            config.affinity.sticky_ttl.unwrap_or_default(),
        );
        let responses = crate::affinity::responses::ResponseRoutes::new(
            config.affinity.max_bindings,
            responses_ttl_ms(&config),
        );
        let admission = crate::admission::Admission::new(config.admission.max_queued);
        if let Some(store) = &store {
            admission.set_fleet_slots(Arc::clone(store) as _);
        }
        configure_admission(&admission, &routing);
        let auth = crate::auth::Auth::default();
        if let Some(path) = &config.auth.keys_file {
            // `check` and `run` load it first and refuse a bad one; here it
            // can only have changed since.
            if let Err(e) = auth.load(path) {
                log::error!("{e}: no client keys in force");
            }
        }
        Ok(Arc::new(Gateway {
            admission,
            auth,
            other_tenant: Default::default(),
            prefix,
            responses,
            lifecycle_started: Default::default(),
            routing: ArcSwap::from_pointee(routing),
            affinity,
            metrics,
            slots,
            health_registry,
            health_check,
            config_path,
            trace,
            telemetry,
            tls,
            body_budget: Default::default(),
            gauge_refresh: Default::default(),
            applying: Default::default(),
            discovered: parking_lot::Mutex::new(
                config
                    .tiers
                    .iter()
                    .filter(|t| t.discovery.is_some() && !t.backends.is_empty())
                    .map(|t| (t.name.clone(), t.backends.clone()))
                    .collect(),
            ),
            fleet_rates: store
                .clone()
                .map(|s| s as Arc<dyn crate::admission::reserve::FleetRates>),
            store,
        }))
    }

    /// Re-read the config file and apply it; on error keep serving the old one.
    /// Counted in `agentserve_config_reload_total{result}`.
    pub fn reload_from_file(self: &Arc<Self>) -> Result<ReloadSummary, String> {
        let result = match &self.config_path {
            None => Err("no config file to reload".to_string()),
            Some(path) => Config::load(path)
                .map_err(|e| e.to_string().replace('\n', "; "))
                .and_then(|c| self.apply(c)),
        };
        let label = if result.is_ok() { "success" } else { "error" };
        self.metrics
            .config_reloads
            .with_label_values(&[label])
            .inc();
        match &result {
            Ok(s) => log::info!(
                "config reloaded: backends added {:?}, removed {:?}, {} sessions on removed backends (they rebind at their next turn){}",
                s.backends_added,
                s.backends_removed,
                s.bindings_broken,
                if s.needs_restart.is_empty() {
                    String::new()
                } else {
                    format!("; needs a restart to apply: {}", s.needs_restart.join(", "))
                }
            ),
            Err(e) => log::error!("config reload failed, still serving the previous config: {e}"),
        }
        result
    }

    /// Apply a new configuration without touching listeners: surviving
    /// backends keep their bindings, health and in-flight counts; removed
    /// backends' bindings are broken (and counted); added backends take new
    /// sessions only after a health check passes.
    pub fn apply(self: &Arc<Self>, config: Config) -> Result<ReloadSummary, String> {
        let _one = self.applying.lock();
        self.apply_locked(config)
    }

    /// A discovering tier's latest DNS answer (`discovery.rs`): a changed
    /// set of backends is applied as a reload would apply it; a failed or
    /// empty answer keeps the last good set.
    pub fn discovered(
        self: &Arc<Self>,
        tier: &str,
        name: &str,
        answer: Result<Vec<BackendConfig>, String>,
    ) {
        let m = &self.metrics;
        let stale = m.discovery_stale.with_label_values(&[tier]);
        let result = match answer {
            Ok(backends) if !backends.is_empty() => {
                stale.set(0);
                m.discovery_backends
                    .with_label_values(&[tier])
                    .set(backends.len() as i64);
                let _one = self.applying.lock();
                let mut known = self.discovered.lock();
                if known.get(tier) == Some(&backends) {
                    "unchanged"
                } else {
                    known.insert(tier.to_string(), backends);
                    drop(known);
                    match self.apply_locked((*self.routing().config).clone()) {
                        Ok(s) => log::info!(
                            "tier {tier}: {name} changed: backends added {:?}, removed {:?}, {} sessions on removed backends (they rebind at their next turn)",
                            s.backends_added,
                            s.backends_removed,
                            s.bindings_broken
                        ),
                        Err(e) => log::error!("tier {tier}: applying {name}'s answer failed: {e}"),
                    }
                    "changed"
                }
            }
            kept => {
                let (result, why) = match kept {
                    Err(e) => ("failed", format!("looking up {name} failed ({e})")),
                    Ok(_) => ("empty", format!("{name} has no addresses")),
                };
                if stale.get() == 0 {
                    log::warn!("tier {tier}: {why}; keeping its last good backends");
                }
                stale.set(1);
                result
            }
        };
        m.discovery_refreshes
            .with_label_values(&[tier, result])
            .inc();
    }

    /// Discovering tiers get the backends of their last good answer.
    fn with_discovered(&self, mut config: Config) -> Config {
        let known = self.discovered.lock();
        for t in config.tiers.iter_mut().filter(|t| t.discovery.is_some()) {
            t.backends = known.get(&t.name).cloned().unwrap_or_default();
        }
        config
    }

    fn apply_locked(self: &Arc<Self>, config: Config) -> Result<ReloadSummary, String> {
        let config = Arc::new(self.with_discovered(config));
        let old = self.routing();
        let mut summary = ReloadSummary::default();
        let (o, n) = (&old.config, &config);
        if o.affinity.hash_key != n.affinity.hash_key {
            // Every binding key and HRW order derives from it: applying it
            // live would orphan every session. A restart starts over cleanly.
            return Err(
                "affinity.hash_key changed: that needs a restart (a reload would \
                        orphan every binding); nothing was applied"
                    .to_string(),
            );
        }
        let tls_listeners = |c: &Config| c.server.tls.as_ref().map(|t| (t.listen.clone(), t.h2));
        for (changed, key) in [
            (o.server.listen != n.server.listen, "server.listen"),
            (o.metrics.listen != n.metrics.listen, "metrics.listen"),
            (o.admin.listen != n.admin.listen, "admin.listen"),
            (
                o.affinity.max_bindings != n.affinity.max_bindings,
                "affinity.max_bindings",
            ),
            (o.health.interval != n.health.interval, "health.interval_ms"),
            (o.server.threads != n.server.threads, "server.threads"),
            (o.trace != n.trace, "trace"),
            (
                (&o.telemetry.otlp, o.telemetry.max_queued_spans)
                    != (&n.telemetry.otlp, n.telemetry.max_queued_spans),
                "telemetry.otlp / max_queued_spans",
            ),
            (o.affinity.store != n.affinity.store, "affinity.store"),
            (
                (
                    o.affinity.prefix.block_bytes,
                    o.affinity.prefix.max_memory_bytes,
                    o.affinity.prefix.ttl,
                ) != (
                    n.affinity.prefix.block_bytes,
                    n.affinity.prefix.max_memory_bytes,
                    n.affinity.prefix.ttl,
                ),
                "affinity.prefix.block_bytes / max_memory_bytes / ttl_seconds",
            ),
            (
                tls_listeners(o) != tls_listeners(n),
                "server.tls.listen / h2",
            ),
            (
                o.server.upstream_ca_file != n.server.upstream_ca_file,
                "server.upstream_ca_file",
            ),
        ] {
            if changed {
                summary.needs_restart.push(key);
            }
        }
        if o.admission.max_queued != n.admission.max_queued {
            summary.needs_restart.push("admission.max_queued");
        }
        // New keys and certificates first: if they do not load, nothing changes.
        if let Some(path) = &n.auth.keys_file {
            let keys = self.auth.load(path)?;
            log::info!("client keys reloaded: {keys} keys");
        }
        if let (Some(resolver), Some(tls)) = (&self.tls, &n.server.tls) {
            resolver.reload(&tls.certificates)?;
        }
        let new = Routing::build(
            Arc::clone(&config),
            &self.slots,
            &self.health_registry,
            &self.metrics,
        )
        .map_err(|_| "too many tiers".to_string())?;
        let old_slots: HashSet<u32> = old.all_backends().map(|(_, b)| b.slot).collect();
        let new_slots: HashSet<u32> = new.all_backends().map(|(_, b)| b.slot).collect();
        let mut probation = Vec::new();
        for (_, b) in new.all_backends() {
            if !old_slots.contains(&b.slot)
                && !probation
                    .iter()
                    .any(|x: &Arc<crate::upstream::Backend>| x.slot == b.slot)
            {
                b.stats.admitted.store(false, Ordering::Relaxed);
                summary.backends_added.push(b.id.to_string());
                probation.push(Arc::clone(b));
            }
        }
        for (_, b) in old.all_backends() {
            if !new_slots.contains(&b.slot) && !summary.backends_removed.contains(&b.id.to_string())
            {
                summary.backends_removed.push(b.id.to_string());
            }
        }
        self.health_check.update(&config);
        self.affinity.set_ttl(config.affinity.sticky_ttl);
        configure_affinity(&self.affinity, &config);
        self.prefix.configure(
            &config.affinity.prefix,
            config.affinity.sticky_ttl.unwrap_or_default(),
        );
        self.responses
            .configure(config.affinity.max_bindings, responses_ttl_ms(&config));
        let live: HashSet<(u16, u32)> = new
            .tiers
            .iter()
            .flat_map(|t| t.backends.iter().map(move |b| (t.index, b.slot)))
            .collect();
        configure_admission(&self.admission, &new);
        if let Some(t) = &self.telemetry {
            t.set_sample_ratio(config.telemetry.sample_ratio);
        }
        let new = Arc::new(new);
        // A scrape that read the old routing would set a removed backend's
        // gauges again after they are forgotten: swap and forget under the
        // lock scrapes refresh under.
        let scrapes = self.gauges_lock();
        self.routing.store(Arc::clone(&new));
        for (t, b) in old.all_backends() {
            if new
                .tier_by_name(&t.name)
                .is_none_or(|nt| nt.backend_by_slot(b.slot).is_none())
            {
                self.metrics.forget_backend(&t.name, &b.id);
            }
        }
        drop(scrapes);
        // Bindings to backends that left their tier stay: each breaks at its
        // session's next turn, which rebinds it and says so (`broken`, and
        // counted then), like a binding to a backend that went down.
        summary.bindings_broken = self
            .affinity
            .count_bindings_where(|tier, slot| !live.contains(&(tier, slot)));
        // Slots of backends gone from both this configuration and the one
        // before it (which requests may still be routing by) and named by no
        // binding go back to be reused: otherwise a process that sees many
        // backends come and go over reloads runs out of them.
        let live: HashSet<u32> = old_slots.union(&new_slots).copied().collect();
        let affinity = &self.affinity;
        for slot in self
            .slots
            .retire_unused(&live, |slot| affinity.backend_bindings(slot) > 0)
        {
            self.prefix.forget_backend(slot);
            self.responses.forget_backend(slot);
        }
        for b in probation {
            let gw = Arc::clone(self);
            tokio::spawn(async move { gw.admit(b).await });
        }
        Ok(summary)
    }

    /// Health-check a newly added backend until it passes, then let it take sessions.
    async fn admit(self: Arc<Self>, b: Arc<crate::upstream::Backend>) {
        loop {
            if !self.routing().all_backends().any(|(_, x)| x.slot == b.slot) {
                return; // removed again before it was admitted
            }
            if self.health_check.check(&b.lb).await.is_ok() {
                b.stats.admitted.store(true, Ordering::Relaxed);
                log::info!("backend {} passed its first health check", b.id);
                return;
            }
            let interval = self.routing().config.health.interval;
            tokio::time::sleep(interval).await;
        }
    }

    /// Eject the backends that stopped answering (`upstream::stall`): their
    /// waiters are placed again, the requests they held are cut (sent
    /// elsewhere once, or 504: `outlier.on_hung`), their sessions rebind at
    /// their next turn.
    pub fn eject_stalled(&self) {
        let routing = self.routing();
        let cfg = &routing.config.outlier;
        let now = crate::clock::now_ms();
        for tier in &routing.tiers {
            for stalled in tier.eject_stalled(cfg, now) {
                let b = &stalled.backend;
                let what = match stalled.out_for {
                    Some(span) => format!("ejected for {} s", span.as_secs()),
                    None => "failing its health checks".to_string(),
                };
                log::warn!(
                    "backend {} {what}: no first byte for {} ms with requests waiting; the {} it held: {}",
                    b.id,
                    stalled.silent_ms,
                    stalled.cut,
                    match cfg.on_hung {
                        crate::config::OnHung::Resend => "sent elsewhere once",
                        crate::config::OnHung::Fail => "answered 504",
                    }
                );
                if stalled.out_for.is_none() {
                    continue;
                }
                self.metrics
                    .backend_ejections
                    .with_label_values(&[&tier.name, &b.id])
                    .inc();
            }
        }
    }

    /// The tables routing decides with, lent for one call.
    pub fn tables(&self) -> crate::routing::Tables<'_> {
        crate::routing::Tables {
            affinity: &self.affinity,
            prefix: &self.prefix,
            responses: &self.responses,
            store: self.store.as_ref(),
            admission: &self.admission,
            metrics: &self.metrics,
        }
    }

    /// The routing snapshot requests are served with now.
    pub fn routing(&self) -> Arc<Routing> {
        self.routing.load_full()
    }

    /// Held while per-backend gauges are written or forgotten.
    pub(crate) fn gauges_lock(&self) -> parking_lot::MutexGuard<'_, ()> {
        self.gauge_refresh.lock()
    }

    /// Bring gauges up to date before a scrape.
    pub fn refresh_gauges(&self) {
        // One scrape at a time: the eviction counter catches up by a
        // difference, which two concurrent scrapes would both add.
        let _one = self.gauges_lock();
        let routing = self.routing();
        let m = &self.metrics;
        if let Some(store) = &self.store {
            m.store_up
                .with_label_values(&[])
                .set(store.healthy() as i64);
        }
        m.prefix_index_entries
            .with_label_values(&[])
            .set(self.prefix.index.len() as i64);
        m.prefix_index_bytes
            .with_label_values(&[])
            .set(self.prefix.index.heap_bytes() as i64);
        m.prefix_conversations
            .with_label_values(&[])
            .set(self.prefix.conversations.len() as i64);
        m.prefix_probation
            .with_label_values(&[])
            .set(self.prefix.conversations.probation_total() as i64);
        let evicted = self.prefix.index.stats.evicted.load(Ordering::Relaxed);
        let counter = m.prefix_index_evictions.with_label_values(&[]);
        if evicted > counter.get() {
            counter.inc_by(evicted - counter.get());
        }
        for tier in &routing.tiers {
            let (bindings, evicted) = self.affinity.tier_bindings(tier.index);
            m.bindings.with_label_values(&[&tier.name]).set(bindings);
            let counter = m.bindings_evicted.with_label_values(&[&tier.name]);
            if evicted > counter.get() {
                counter.inc_by(evicted - counter.get());
            }
            for b in &tier.backends {
                let labels = [&*tier.name, &*b.id];
                m.backend_healthy
                    .with_label_values(&labels)
                    .set(tier.healthy(b) as i64);
                m.backend_in_flight
                    .with_label_values(&labels)
                    .set(b.in_flight() as i64);
                m.backend_ejected
                    .with_label_values(&labels)
                    .set(b.stats.outlier.ejected(crate::clock::now_ms()) as i64);
            }
        }
    }
}

/// Bytes of request bodies held in memory at once, across all requests.
/// Routing pre-reads are taken while the total stays within
/// `server.preread_budget_bytes` (else the request gets a 503); copies kept
/// only for replay while it stays within `server.replay_budget_bytes`.
#[derive(Debug, Default)]
pub struct BodyBudget {
    held: AtomicU64,
}

/// Bytes counted against a [`BodyBudget`] until dropped.
#[derive(Debug)]
pub struct BodyHold {
    budget: Arc<BodyBudget>,
    bytes: u64,
}

impl BodyBudget {
    /// Hold `bytes` if the total stays within `limit`.
    pub fn try_hold(self: &Arc<Self>, bytes: u64, limit: u64) -> Option<BodyHold> {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(bytes).filter(|&total| total <= limit)
            })
            .ok()?;
        Some(BodyHold {
            budget: Arc::clone(self),
            bytes,
        })
    }

    /// Hold `bytes` whatever the total (a body routing cannot do without).
    pub fn hold(self: &Arc<Self>, bytes: u64) -> BodyHold {
        self.held.fetch_add(bytes, Ordering::AcqRel);
        BodyHold {
            budget: Arc::clone(self),
            bytes,
        }
    }

    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Acquire)
    }
}

impl Drop for BodyHold {
    fn drop(&mut self) {
        self.budget.held.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

/// How long a stored response routes its follow-ups: as long as a binding
/// lives (`sticky_ttl_seconds`; with affinity off, as long as the default).
fn responses_ttl_ms(config: &crate::config::Config) -> u64 {
    let ttl = config
        .affinity
        .sticky_ttl
        .unwrap_or(std::time::Duration::from_secs(1800));
    ttl.as_millis() as u64
}

/// The backends whose engines' KV events the `kv events` service follows.
impl crate::kv::subscribe::EventSources for Gateway {
    fn followed(&self) -> Vec<crate::kv::subscribe::Followed> {
        self.routing()
            .all_backends()
            .filter_map(|(_, b)| {
                Some(crate::kv::subscribe::Followed {
                    slot: b.slot,
                    name: Arc::clone(&b.id),
                    view: Arc::clone(&b.stats.kv),
                    cfg: b.kv_events.clone()?,
                })
            })
            .collect()
    }

    fn engine_lost(&self, slot: u32) {
        self.prefix.index.forget_backend(slot);
    }
}
