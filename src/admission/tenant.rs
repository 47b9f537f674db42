//! A client key's tenant and its limits (`auth.keys_file`): requests in
//! flight (each gateway's own), requests and tokens a minute (token
//! buckets: this gateway's own, or one per tenant in the fleet's store, on
//! its clock). The keys file says who is who ([`crate::auth`]); this is
//! what each tenant may do.

use super::class::Class;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A tenant's limits (0: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub max_in_flight: u32,
    pub requests_per_minute: u32,
    pub tokens_per_minute: u64,
}

/// A token bucket that refills `per_minute` a minute up to `per_minute`;
/// full when first used.
struct Bucket {
    /// `None`: never used (full).
    level: Option<f64>,
    at: Instant,
}

impl Bucket {
    fn new() -> Bucket {
        Bucket {
            level: None,
            at: Instant::now(),
        }
    }

    /// Its level now.
    fn refill(&mut self, per_minute: f64, now: Instant) -> &mut f64 {
        let s = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        let level = self.level.get_or_insert(per_minute);
        *level = (*level + s * per_minute / 60.0).min(per_minute);
        level
    }
}

/// Seconds until a bucket at `level` holds `need` (0: it does now).
fn wait_for(level: f64, need: f64, per_minute: f64) -> f64 {
    ((need - level) * 60.0 / per_minute).max(0.0)
}

/// One tenant's live counters, shared by every key of the tenant.
pub struct Tenant {
    pub name: Arc<str>,
    /// Its fair-share id (`admission`).
    pub id: u64,
    /// What it adds to its bindings' scope.
    pub scope: String,
    /// Its metrics, resolved on first use.
    pub counters: std::sync::OnceLock<crate::metrics::TenantCounters>,
    in_flight: AtomicU32,
    requests: Mutex<Bucket>,
    tokens: Mutex<Bucket>,
}

impl Tenant {
    pub(crate) fn new(name: &str) -> Tenant {
        Tenant {
            name: name.into(),
            // Odd: never the id of a keyless tenant (even, see the proxy).
            id: xxhash_rust::xxh3::xxh3_64(name.as_bytes()) | 1,
            scope: format!("\u{0}k{name}"),
            counters: Default::default(),
            in_flight: AtomicU32::new(0),
            requests: Mutex::new(Bucket::new()),
            tokens: Mutex::new(Bucket::new()),
        }
    }
}

/// What a key grants.
pub struct Client {
    pub tenant: Arc<Tenant>,
    /// Its requests' class unless they name one.
    pub class: Option<Class>,
    pub weight: u32,
    pub limits: Limits,
}

/// A request refused by its tenant's limits: which one, and when to retry.
#[derive(Debug, PartialEq)]
pub struct OverLimit {
    pub limit: &'static str,
    pub retry_after_s: u64,
}

/// A request counted against its tenant's `max_in_flight` until dropped.
pub struct TenantSlot(Option<Arc<Tenant>>);

impl Drop for TenantSlot {
    fn drop(&mut self) {
        if let Some(t) = &self.0 {
            t.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Client {
    /// Count one request against the tenant's limits, or say which it is over.
    pub fn take(&self) -> Result<TenantSlot, OverLimit> {
        let slot = self.take_slot()?;
        self.take_rates()?;
        Ok(slot)
    }

    /// Count one request against the tenant's `max_in_flight` (each
    /// gateway's own: what it runs at once).
    pub fn take_slot(&self) -> Result<TenantSlot, OverLimit> {
        let t = &self.tenant;
        let max = self.limits.max_in_flight;
        if max > 0 {
            let admitted = t
                .in_flight
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max).then_some(n + 1)
                })
                .is_ok();
            if !admitted {
                return Err(OverLimit {
                    limit: "max_in_flight",
                    retry_after_s: 1,
                });
            }
        }
        Ok(TenantSlot((max > 0).then(|| Arc::clone(t))))
    }

    /// Count one request against the tenant's per-minute limits in this
    /// gateway's own buckets (a fleet's store keeps shared ones: see
    /// [`super::reserve::FleetRates`]).
    pub fn take_rates(&self) -> Result<(), OverLimit> {
        let t = &self.tenant;
        let l = self.limits;
        let now = Instant::now();
        if l.tokens_per_minute > 0 {
            let mut b = t.tokens.lock();
            let rate = l.tokens_per_minute as f64;
            let level = *b.refill(rate, now);
            if level < 0.0 {
                return Err(OverLimit {
                    limit: "tokens_per_minute",
                    retry_after_s: retry_s(wait_for(level, 0.0, rate)),
                });
            }
        }
        if l.requests_per_minute > 0 {
            let mut b = t.requests.lock();
            let rate = l.requests_per_minute as f64;
            let level = b.refill(rate, now);
            if *level < 1.0 {
                return Err(OverLimit {
                    limit: "requests_per_minute",
                    retry_after_s: retry_s(wait_for(*level, 1.0, rate)),
                });
            }
            *level -= 1.0;
        }
        Ok(())
    }

    /// Whether its tenant has per-minute limits.
    pub fn has_rates(&self) -> bool {
        self.limits.requests_per_minute > 0 || self.limits.tokens_per_minute > 0
    }

    /// Whether its tenant's tokens are counted (`tokens_per_minute`).
    pub fn counts_tokens(&self) -> bool {
        self.limits.tokens_per_minute > 0
    }

    /// This gateway's level of the tenant's `tokens_per_minute` now
    /// (infinite when its tokens are not counted).
    pub fn tokens_level(&self) -> f64 {
        match self.counts_tokens() {
            true => *self
                .tenant
                .tokens
                .lock()
                .refill(self.limits.tokens_per_minute as f64, Instant::now()),
            false => f64::INFINITY,
        }
    }

    /// Debit `tokens` from the tenant's `tokens_per_minute` (a negative
    /// amount gives them back): an estimate when a request is admitted, so
    /// that requests sent together cannot all pass while the bucket is
    /// positive, and what it used against that estimate when it ends.
    pub fn charge_tokens(&self, tokens: i64) {
        if self.counts_tokens() && tokens != 0 {
            let mut b = self.tenant.tokens.lock();
            *b.refill(self.limits.tokens_per_minute as f64, Instant::now()) -= tokens as f64;
        }
    }
}

fn retry_s(s: f64) -> u64 {
    (s.ceil() as u64).clamp(1, 3600)
}

impl OverLimit {
    /// Refused by `limit`, whose bucket holds `level` of the `need` a
    /// request takes, refilled at `per_minute`: retry when it will hold it.
    pub fn waiting(limit: &'static str, level: f64, need: f64, per_minute: f64) -> OverLimit {
        OverLimit {
            limit,
            retry_after_s: retry_s(wait_for(level, need, per_minute)),
        }
    }
}
