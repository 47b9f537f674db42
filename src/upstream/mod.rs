//! Tiers and backends, and the health state Pingora's health checks keep for them.
//!
//! A [`Routing`] is one immutable snapshot built from one [`Config`]; the proxy
//! reads the current snapshot per request and a reload swaps in a new one.
//! Backends and tiers keep stable numbers ("slots") across snapshots, so the
//! binding table, in-flight counts and health survive a reload.

pub mod cost;
pub mod health;
pub mod load;
pub mod outlier;
pub mod stall;
pub mod stats;

pub use stats::{BackendStats, InFlight, REUSES_ON_PROBATION};

use crate::affinity::hrw::HrwHasher;
use crate::affinity::Candidate;
use crate::affinity::MAX_TIERS;
use crate::config::{BackendConfig, Config};
use crate::metrics::{Metrics, TierMetrics};
use futures_util::FutureExt;
use parking_lot::RwLock;
use pingora_load_balancing::discovery::Static;
use pingora_load_balancing::{Backend as LbBackend, Backends, HealthRegistry};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Backend id → slot, and slot → live state.
#[derive(Default)]
struct BackendSlots {
    by_id: HashMap<String, u32>,
    stats: Vec<Arc<BackendStats>>,
    /// Slots of backends that left the configuration and that nothing names
    /// any more: the next new backend id takes one.
    free: Vec<u32>,
}

/// Stable numbers for backend ids and tier names: a backend keeps its slot
/// while it is configured or named by a binding; then the slot may go to
/// another backend (see [`Slots::retire_unused`]), so a process that sees
/// many backends come and go over reloads never runs out of them.
#[derive(Default)]
pub struct Slots {
    backends: RwLock<BackendSlots>,
    tiers: RwLock<HashMap<String, u16>>,
}

impl Slots {
    pub fn backend(&self, id: &str) -> (u32, Arc<BackendStats>) {
        {
            let r = self.backends.read();
            if let Some(&slot) = r.by_id.get(id) {
                return (slot, Arc::clone(&r.stats[slot as usize]));
            }
        }
        let mut w = self.backends.write();
        if let Some(&slot) = w.by_id.get(id) {
            return (slot, Arc::clone(&w.stats[slot as usize]));
        }
        let stats = Arc::new(BackendStats::new(id));
        let slot = match w.free.pop() {
            Some(slot) => {
                w.stats[slot as usize] = Arc::clone(&stats);
                slot
            }
            None => {
                w.stats.push(Arc::clone(&stats));
                (w.stats.len() - 1) as u32
            }
        };
        w.by_id.insert(id.to_string(), slot);
        (slot, stats)
    }

    /// Free the slots of backends that are not `live` (in no tier of the
    /// configurations that may still be routing) and that no binding names
    /// (`in_use`); returns them. What is keyed by slot elsewhere (the prefix
    /// index) must forget them.
    pub fn retire_unused(&self, live: &HashSet<u32>, in_use: impl Fn(u32) -> bool) -> Vec<u32> {
        let mut w = self.backends.write();
        let gone: Vec<(String, u32)> = w
            .by_id
            .iter()
            .filter(|(_, slot)| !live.contains(slot) && !in_use(**slot))
            .map(|(id, &slot)| (id.clone(), slot))
            .collect();
        for (id, slot) in &gone {
            w.by_id.remove(id);
            w.free.push(*slot);
        }
        gone.into_iter().map(|(_, slot)| slot).collect()
    }

    pub fn backend_id(&self, slot: u32) -> Option<String> {
        self.backends
            .read()
            .stats
            .get(slot as usize)
            .map(|s| s.id.clone())
    }

    /// `None` once [`MAX_TIERS`] distinct tier names have been seen.
    pub fn tier(&self, name: &str) -> Option<u16> {
        let mut w = self.tiers.write();
        if let Some(&i) = w.get(name) {
            return Some(i);
        }
        if w.len() >= MAX_TIERS {
            return None;
        }
        let i = w.len() as u16;
        w.insert(name.to_string(), i);
        Some(i)
    }
}

/// One LLM server replica.
pub struct Backend {
    pub id: Arc<str>,
    pub addr: SocketAddr,
    pub weight: u32,
    pub slot: u32,
    /// Keyed HRW seed of `id`.
    pub seed: u64,
    /// Pingora's identity for this backend (health is tracked per identity).
    pub lb: LbBackend,
    /// Its per-request counters in this tier.
    pub counters: crate::metrics::BackendCounters,
    /// `id` as a response header value (made once, shared by every response).
    pub id_header: http::HeaderValue,
    pub stats: Arc<BackendStats>,
    /// `Some(sni)`: connect over TLS and verify the certificate for this name.
    pub tls: Option<String>,
    /// The tier view's health-check verdict, kept between flips.
    checks: health::ReadyCache,
    /// Where its engine publishes its KV-cache events.
    pub kv_events: Option<crate::config::KvEventsConfig>,
}

impl Backend {
    /// This backend as a placement candidate: its load signals at `now_ms`
    /// (`clock::now_ms`, read once for the whole list).
    fn candidate(&self, now_ms: u64) -> Candidate {
        let queue = self.stats.cost.queue_at(now_ms);
        Candidate {
            slot: self.slot,
            seed: self.seed,
            weight: self.weight,
            in_flight: self.in_flight(),
            engine_requests: self.stats.engine.requests_if_fresh_at(now_ms),
            draining: self.draining(),
            move_on_drain: self.stats.move_on_drain.load(Ordering::Relaxed),
            prefill_us_per_token: self.stats.cost.learned_us_per_token().unwrap_or(0.0),
            queued_tokens: queue.tokens,
            head_ms: queue.head_ms,
            head_tokens: queue.head_tokens,
            // The request's prompt fills these in (`affinity::prefix`).
            prefix_tokens: 0,
            prefix_exact: false,
            probation: 0,
            failing: self.stats.outlier.failing(),
            // Admission marks it (`Admission::mark`).
            full: false,
            ahead: 0,
        }
    }

    pub fn in_flight(&self) -> u64 {
        self.stats.in_flight.load(Ordering::Relaxed)
    }

    pub fn draining(&self) -> bool {
        self.stats.draining.load(Ordering::Relaxed)
    }
}

/// A named pool of backends that serve the same models.
/// A backend [`Tier::eject_stalled`] ejected as hung.
pub struct Stalled {
    pub backend: Arc<Backend>,
    /// How long it had given no first byte, ms.
    pub silent_ms: u64,
    /// How long it is ejected (`None`: it was out already, failing its
    /// health checks).
    pub out_for: Option<std::time::Duration>,
    /// The requests it held, their connections cut.
    pub cut: usize,
}

pub struct Tier {
    pub name: Arc<str>,
    pub index: u16,
    pub default: bool,
    pub models: Vec<String>,
    pub backends: Vec<Arc<Backend>>,
    /// Pingora's membership view of this tier, sharing the gateway's health registry.
    view: Backends,
    pub metrics: TierMetrics,
    /// `name` as a response header value.
    pub name_header: http::HeaderValue,
    /// Its backends' ejections, decided one at a time.
    pub ejections: outlier::EjectionGate,
    /// What goes upstream as `Authorization`: the tier's own, else `auth`'s.
    pub upstream_authorization: crate::config::UpstreamAuthorization,
}

impl Tier {
    /// Passing health checks (and, for a backend added by a reload, admitted
    /// by its first successful check), and not ejected for failing requests.
    pub fn healthy(&self, b: &Backend) -> bool {
        self.checks_pass(b) && !b.stats.outlier.ejected_now()
    }

    /// [`Self::healthy`] with the clock already read (`clock::now_ms`).
    fn healthy_at(&self, b: &Backend, now_ms: u64) -> bool {
        self.checks_pass(b) && !b.stats.outlier.ejected_at(now_ms)
    }

    /// The backends a request may go to, with their load signals: healthy
    /// and not in `excluded` (slots that refused this request a connection).
    /// Asked on every request, for every backend of the tier.
    pub fn candidates(&self, excluded: &[u32]) -> Vec<Candidate> {
        // Sized up front (a filtered collect grows and copies), one clock read.
        let now = crate::clock::now_ms();
        let mut out = Vec::with_capacity(self.backends.len());
        out.extend(
            self.backends
                .iter()
                .filter(|b| self.healthy_at(b, now) && !excluded.contains(&b.slot))
                .map(|b| b.candidate(now)),
        );
        out
    }

    /// Fill in what the engines whose KV events are current hold of the
    /// session `key`: each such candidate's `prefix_tokens` (and
    /// `prefix_exact`). Returns the candidates so read, with the tokens held:
    /// empty when no engine reports on the session.
    pub fn kv_holdings(&self, candidates: &mut [Candidate], key: u128) -> Vec<(u32, u64)> {
        use crate::kv::view::SessionHeld;
        let mut read = Vec::new();
        let mut session = None;
        for c in candidates.iter_mut() {
            let Some(b) = self.backend_by_slot(c.slot) else {
                continue;
            };
            if !b.stats.kv.exact() {
                continue;
            }
            let s = *session.get_or_insert_with(|| crate::kv::session::session_of_key(key));
            if let SessionHeld::Tokens(t) = b.stats.kv.held(s) {
                c.prefix_tokens = t;
                c.prefix_exact = true;
                read.push((c.slot, t));
            }
        }
        read
    }

    /// What the active health checks alone say.
    pub fn checks_pass(&self, b: &Backend) -> bool {
        b.stats.admitted.load(Ordering::Relaxed) && b.checks.get(|| self.view.ready(&b.lb))
    }

    /// Whether ejecting one more backend keeps this tier within the
    /// outlier panic threshold (never empties it).
    pub fn may_eject(&self, max_percent: u32) -> bool {
        let out = self.backends.iter().filter(|b| !self.healthy(b)).count();
        outlier::may_eject(self.backends.len(), out, max_percent)
    }

    /// Eject each backend that has stalled (`stall`): requests wait there
    /// and it has given no first byte for its bound. The requests it holds
    /// are cut, there and at one that failed its health checks meanwhile.
    /// Returns those ejected or cut.
    pub fn eject_stalled(&self, cfg: &crate::config::OutlierConfig, now_ms: u64) -> Vec<Stalled> {
        let mut out = Vec::new();
        for b in &self.backends {
            let s = &b.stats;
            let queued_ms = s
                .cost
                .learned_us_per_token()
                .map_or(0, |us| (s.cost.queued_tokens() as f64 * us / 1000.0) as u64);
            let bound = s.progress.bound(cfg.first_byte_timeout, queued_ms);
            let Some(silent) = s
                .progress
                .stalled(now_ms, bound, s.outlier.ejection_end_ms())
            else {
                continue;
            };
            let ejected = s.outlier.eject_stalled(&self.ejections, cfg, now_ms, || {
                self.may_eject(cfg.max_ejected_percent)
            });
            // One its health checks already took out (a process frozen
            // whole fails them too) is not ejected again (the cap counts it
            // out already), but what it holds is cut all the same.
            if ejected.is_none() && self.checks_pass(b) {
                continue;
            }
            let cut = s.progress.cut_all(b.addr);
            if ejected.is_some() || cut > 0 {
                out.push(Stalled {
                    backend: Arc::clone(b),
                    silent_ms: silent,
                    out_for: ejected,
                    cut,
                });
            }
        }
        out
    }

    pub fn backend_by_slot(&self, slot: u32) -> Option<&Arc<Backend>> {
        self.backends.iter().find(|b| b.slot == slot)
    }

    pub fn backend_by_id(&self, id: &str) -> Option<&Arc<Backend>> {
        self.backends.iter().find(|b| &*b.id == id)
    }
}

impl crate::affinity::shared::TierBackends for Tier {
    fn name(&self) -> &str {
        &self.name
    }
    fn index(&self) -> u16 {
        self.index
    }
    fn backend_id(&self, slot: u32) -> Option<&str> {
        self.backend_by_slot(slot).map(|b| &*b.id)
    }
    fn backend_slot(&self, id: &str) -> Option<u32> {
        self.backend_by_id(id).map(|b| b.slot)
    }
}

/// One immutable routing snapshot.
pub struct Routing {
    pub config: Arc<Config>,
    pub hasher: HrwHasher,
    pub tiers: Vec<Arc<Tier>>,
    by_name: HashMap<String, usize>,
    by_model: HashMap<String, usize>,
    default: usize,
}

#[derive(Debug)]
pub struct TooManyTiers;

impl Routing {
    pub fn build(
        config: Arc<Config>,
        slots: &Slots,
        registry: &Arc<HealthRegistry>,
        metrics: &Metrics,
    ) -> Result<Routing, TooManyTiers> {
        let hasher = HrwHasher::with_retired(
            &config.affinity.hash_key,
            &config.affinity.retired_hash_keys,
        );
        let mut tiers = Vec::new();
        let mut by_name = HashMap::new();
        let mut by_model = HashMap::new();
        let mut default = 0;
        for (i, t) in config.tiers.iter().enumerate() {
            let index = slots.tier(&t.name).ok_or(TooManyTiers)?;
            let backends: Vec<Arc<Backend>> = t
                .backends
                .iter()
                .map(|b| Arc::new(make_backend(b, slots, &hasher)))
                .collect();
            let set: BTreeSet<LbBackend> = backends.iter().map(|b| b.lb.clone()).collect();
            let view = Backends::new_with_health_registry(Static::new(set), Arc::clone(registry));
            // Static discovery never blocks: publish the membership now so the
            // health service sees the targets before the first request.
            if let Some(Err(e)) = view.update(|_| {}).now_or_never() {
                log::error!("tier {}: backend discovery failed: {e}", t.name);
            }
            by_name.insert(t.name.clone(), i);
            for m in &t.models {
                by_model.insert(m.clone(), i);
            }
            if t.default {
                default = i;
            }
            tiers.push(Arc::new(Tier {
                name: t.name.as_str().into(),
                index,
                default: t.default,
                models: t.models.clone(),
                backends,
                view,
                metrics: metrics.tier(&t.name),
                // Tier names are letters, digits, `-`, `_`, `.` (checked by config).
                name_header: http::HeaderValue::from_str(&t.name).expect("validated tier name"),
                ejections: Default::default(),
                upstream_authorization: t
                    .upstream_authorization
                    .clone()
                    .unwrap_or_else(|| config.auth.upstream_authorization.clone()),
            }));
        }
        Ok(Routing {
            config,
            hasher,
            tiers,
            by_name,
            by_model,
            default,
        })
    }

    pub fn tier_by_name(&self, name: &str) -> Option<&Arc<Tier>> {
        self.by_name.get(name).map(|&i| &self.tiers[i])
    }

    pub fn tier_by_model(&self, model: &str) -> Option<&Arc<Tier>> {
        self.by_model.get(model).map(|&i| &self.tiers[i])
    }

    pub fn default_tier(&self) -> &Arc<Tier> {
        &self.tiers[self.default]
    }

    /// Whether the body's `model` can change which tier a request goes to.
    pub fn routes_by_model(&self) -> bool {
        self.tiers.len() > 1
    }

    /// Every backend, once, across tiers.
    pub fn all_backends(&self) -> impl Iterator<Item = (&Arc<Tier>, &Arc<Backend>)> {
        self.tiers
            .iter()
            .flat_map(|t| t.backends.iter().map(move |b| (t, b)))
    }
}

fn make_backend(b: &BackendConfig, slots: &Slots, hasher: &HrwHasher) -> Backend {
    let (slot, stats) = slots.backend(&b.id);
    if b.draining {
        // Configured drains add to admin drains; undraining is the admin's call.
        stats.draining.store(true, Ordering::Relaxed);
    }
    let mut lb = LbBackend::new_with_weight(&b.addr.to_string(), b.weight as usize)
        .expect("a validated SocketAddr parses");
    lb.ext.insert(slot);
    Backend {
        id: b.id.as_str().into(),
        addr: b.addr,
        weight: b.weight,
        slot,
        seed: hasher.backend_seed(&b.id),
        lb,
        counters: Default::default(),
        // Ids are printable ASCII without spaces (checked by config).
        id_header: http::HeaderValue::from_str(&b.id).expect("validated backend id"),
        stats,
        tls: b.tls.clone(),
        checks: Default::default(),
        kv_events: b.kv_events.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::affinity::MAX_BACKENDS;

    #[test]
    fn backends_that_come_and_go_over_reloads_never_run_out_of_slots() {
        let slots = Slots::default();
        let named = HashSet::from([1u32]); // slot 1 is still named by a binding
        let (mut highest, mut live) = (0, HashSet::new());
        for i in 0..MAX_BACKENDS as u32 + 4_000 {
            // Each reload replaces the tier's backend with a new id.
            let (slot, stats) = slots.backend(&format!("replica-{i}"));
            assert_eq!(&*stats.id, format!("replica-{i}").as_str(), "fresh state");
            highest = highest.max(slot);
            let before = std::mem::replace(&mut live, HashSet::from([slot]));
            let all: HashSet<u32> = before.union(&live).copied().collect();
            slots.retire_unused(&all, |s| named.contains(&s));
        }
        assert!(highest < 4, "slots reused: the highest was {highest}");
        // A backend still configured, or named by a binding, keeps its slot.
        assert_eq!(slots.backend_id(1).as_deref(), Some("replica-1"));
        let (slot, _) = slots.backend("replica-again");
        let (same, _) = slots.backend("replica-again");
        assert_eq!(slot, same);
    }
}
