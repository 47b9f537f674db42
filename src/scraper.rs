//! The load scraper: a background service that reads every backend's own
//! `/metrics` on `load.interval_ms` (vLLM, SGLang and llama.cpp gauges, see
//! `upstream/load.rs`) and refreshes the per-backend load gauges.

use crate::admission::LEARN_SCRAPE_MS;
use crate::upstream::load::EngineGauges;

/// Scrapes every backend's `/metrics` on `load.interval_ms` and refreshes the
/// per-backend load gauges (gateway-local ones too, scraping or not).
pub struct LoadScraper(pub std::sync::Arc<crate::gateway::Gateway>);

#[async_trait::async_trait]
impl pingora_core::services::background::BackgroundService for LoadScraper {
    async fn start(&self, mut shutdown: pingora_core::server::ShutdownWatch) {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .build()
            .expect("an HTTP client without TLS builds");
        loop {
            let routing = self.0.routing();
            let cfg = &routing.config.load;
            if cfg.scrape {
                self.scrape_where(&client, &routing, |_| true).await;
            }
            self.export();
            // Until the next round, a backend whose learned limit is being
            // tried is read again sooner: a request its engine cannot run
            // yet waits inside it meanwhile.
            let next = tokio::time::Instant::now() + cfg.interval;
            let quick = std::time::Duration::from_millis(LEARN_SCRAPE_MS).min(cfg.interval);
            let learns = cfg.scrape && routing.config.admission.enabled;
            loop {
                let left = next.saturating_duration_since(tokio::time::Instant::now());
                let pause = if learns { quick.min(left) } else { left };
                tokio::select! {
                    _ = shutdown.changed() => return,
                    _ = tokio::time::sleep(pause) => {}
                }
                if tokio::time::Instant::now() >= next {
                    break;
                }
                let admission = &self.0.admission;
                self.scrape_where(&client, &routing, |b| admission.learning(b.slot))
                    .await;
            }
        }
    }
}

impl LoadScraper {
    /// Scrape, at once, every backend `pick` takes (none over TLS).
    async fn scrape_where(
        &self,
        client: &reqwest::Client,
        routing: &crate::upstream::Routing,
        pick: impl Fn(&crate::upstream::Backend) -> bool,
    ) {
        let cfg = &routing.config.load;
        let scrapes = routing
            .all_backends()
            .filter(|(_, b)| b.tls.is_none() && pick(b))
            .map(|(tier, b)| self.scrape(client, cfg, tier, b));
        futures_util::future::join_all(scrapes).await;
    }

    async fn scrape(
        &self,
        client: &reqwest::Client,
        cfg: &crate::config::LoadConfig,
        tier: &crate::upstream::Tier,
        b: &crate::upstream::Backend,
    ) {
        let url = format!("http://{}{}", b.addr, cfg.path);
        let fetched = async {
            let resp = client.get(&url).send().await?.error_for_status()?;
            resp.text().await
        };
        match tokio::time::timeout(cfg.timeout, fetched).await {
            Ok(Ok(text)) => {
                let g = EngineGauges::parse(&text);
                b.stats.engine.record(&g, cfg.stale);
                if let (Some(seconds), Some(tokens)) = (g.decode_seconds, g.decode_tokens) {
                    b.stats.cost.observe_engine_decode(seconds, tokens);
                }
                if let (Some(running), Some(waiting)) = (g.running, g.waiting) {
                    self.0.admission.observe(
                        b.slot,
                        running as u64,
                        waiting as u64,
                        crate::clock::now_ms(),
                    );
                }
            }
            outcome => {
                log::debug!("load scrape of {} failed: {outcome:?}", b.id);
                self.0
                    .metrics
                    .load_scrape_failures
                    .with_label_values(&[&tier.name, &b.id])
                    .inc();
            }
        }
    }

    /// Export under the gauges' lock, with the routing of now: one read
    /// before the scrapes would set the gauges of a backend a reload removed
    /// meanwhile after the reload forgot them.
    fn export(&self) {
        let _gauges = self.0.gauges_lock();
        let routing = self.0.routing();
        let m = &self.0.metrics;
        for (tier, b) in routing.all_backends() {
            let labels = [&*tier.name, &*b.id];
            m.backend_bindings
                .with_label_values(&labels)
                .set(self.0.affinity.backend_bindings(b.slot) as i64);
            let (running, waiting, kv) = b.stats.engine.snapshot().unwrap_or_default();
            for (state, v) in [("running", running), ("waiting", waiting)] {
                m.backend_engine_requests
                    .with_label_values(&[&*tier.name, &*b.id, state])
                    .set(v.map_or(-1, |v| v as i64));
            }
            m.backend_kv_usage
                .with_label_values(&labels)
                .set(kv.unwrap_or(-1.0));
            if b.kv_events.is_some() {
                let (exact, _, applied, replayed) = b.stats.kv.snapshot();
                m.kv_index_exact
                    .with_label_values(&labels)
                    .set(exact as i64);
                let lost = b.stats.kv.lost();
                for (c, total) in [
                    (&m.kv_events, applied),
                    (&m.kv_replayed, replayed),
                    (&m.kv_connections_lost, lost),
                ] {
                    let c = c.with_label_values(&labels);
                    c.inc_by(total.saturating_sub(c.get()));
                }
            }
            let cost = &b.stats.cost;
            m.backend_prefill_cost
                .with_label_values(&labels)
                .set(cost.learned_us_per_token().map_or(-1.0, |us| us / 1e6));
            m.backend_queue
                .with_label_values(&labels)
                .set(cost.queue_us() as f64 / 1e6);
        }
    }
}
