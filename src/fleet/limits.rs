//! Tenants' per-minute limits held by the fleet's store: one token bucket
//! per tenant and limit (`<prefix>limit:<tenant>:rpm|tpm`), refilled and
//! taken by a script on Redis's clock, so that N gateways give a tenant its
//! limit, not N times it. Admission reserves through it
//! ([`FleetRates`]) while the store answers.

use super::store::{Bucket, SharedStore};
use crate::admission::reserve::{FleetRates, Unreachable};
use crate::admission::{Client, OverLimit};

#[async_trait::async_trait]
impl FleetRates for SharedStore {
    fn healthy(&self) -> bool {
        SharedStore::healthy(self)
    }

    /// Both limits in one call: neither is taken unless both allow it.
    async fn take(
        &self,
        client: &Client,
        charge: u64,
    ) -> Result<Result<(), OverLimit>, Unreachable> {
        let l = client.limits;
        let name = &client.tenant.name;
        let (tpm, rpm) = (format!("{name}:tpm"), format!("{name}:rpm"));
        let mut buckets = Vec::with_capacity(2);
        let mut which = Vec::with_capacity(2);
        if l.tokens_per_minute > 0 {
            buckets.push(Bucket {
                name: &tpm,
                per_minute: l.tokens_per_minute,
                need: Some(0.0),
                cost: charge as f64,
            });
            which.push(("tokens_per_minute", 0.0, l.tokens_per_minute as f64));
        }
        if l.requests_per_minute > 0 {
            buckets.push(Bucket {
                name: &rpm,
                per_minute: l.requests_per_minute as u64,
                need: Some(1.0),
                cost: 1.0,
            });
            which.push(("requests_per_minute", 1.0, l.requests_per_minute as f64));
        }
        if buckets.is_empty() {
            return Ok(Ok(()));
        }
        let taken = self.limits(&buckets).await.map_err(|_| Unreachable)?;
        Ok(taken.map(|_| ()).map_err(|(i, level)| {
            let (limit, need, rate) = which[i];
            OverLimit::waiting(limit, level, need, rate)
        }))
    }

    /// Debit `tokens` from the tenant's bucket (a negative amount gives
    /// them back; none reads its level): its level after.
    async fn charge(&self, client: &Client, tokens: i64) -> Result<Option<f64>, Unreachable> {
        if !client.counts_tokens() {
            return Ok(None);
        }
        let name = format!("{}:tpm", client.tenant.name);
        let bucket = Bucket {
            name: &name,
            per_minute: client.limits.tokens_per_minute,
            need: None,
            cost: tokens as f64,
        };
        match self.limits(&[bucket]).await.map_err(|_| Unreachable)? {
            Ok(level) => Ok(Some(level)),
            Err((_, level)) => Ok(Some(level)),
        }
    }
}
