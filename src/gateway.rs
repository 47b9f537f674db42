//! The gateway's shared state: the current routing snapshot, the binding
//! table, health and metrics. Services (proxy, metrics, sweeper) hold an
//! `Arc<Gateway>`; a reload swaps the routing snapshot in place.

use crate::affinity::policy::DefaultPolicy;
use crate::affinity::Affinity;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::upstream::health::ReloadableCheck;
use crate::upstream::{Routing, Slots, TooManyTiers};
use arc_swap::ArcSwap;
use pingora_load_balancing::HealthRegistry;
use std::sync::Arc;

pub struct Gateway {
    routing: ArcSwap<Routing>,
    pub affinity: Arc<Affinity>,
    pub metrics: Arc<Metrics>,
    pub slots: Slots,
    pub health_registry: Arc<HealthRegistry>,
    pub health_check: Arc<ReloadableCheck>,
}

impl Gateway {
    pub fn new(
        config: Arc<Config>,
        health_registry: Arc<HealthRegistry>,
        health_check: Arc<ReloadableCheck>,
    ) -> Result<Arc<Gateway>, TooManyTiers> {
        let metrics = Arc::new(Metrics::new());
        let slots = Slots::default();
        let routing = Routing::build(Arc::clone(&config), &slots, &health_registry, &metrics)?;
        let affinity = Affinity::new(config.affinity.max_bindings, config.affinity.sticky_ttl);
        affinity.set_policy(DefaultPolicy {
            mode: config.affinity.mode,
            soft_max_in_flight: config.affinity.soft_max_in_flight,
        });
        Ok(Arc::new(Gateway {
            routing: ArcSwap::from_pointee(routing),
            affinity,
            metrics,
            slots,
            health_registry,
            health_check,
        }))
    }

    /// The routing snapshot requests are served with now.
    pub fn routing(&self) -> Arc<Routing> {
        self.routing.load_full()
    }

    /// Bring gauges up to date before a scrape.
    pub fn refresh_gauges(&self) {
        let routing = self.routing();
        let m = &self.metrics;
        let table = self.affinity.table();
        for tier in &routing.tiers {
            m.bindings
                .with_label_values(&[&tier.name])
                .set(table.tier_len(tier.index));
            let evicted = table.tier_evictions(tier.index);
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
            }
        }
    }
}
