//! A request's claim on its tenant's limits ([`Reservation`]), where
//! whether they are the fleet's or this gateway's own is decided once: at
//! [`Reservation::open`], by whether the fleet's store answers. Its slot
//! counts against `max_in_flight` until it drops; its request and its
//! estimated tokens are reserved up front ([`Reservation::reserve`]); what
//! it used settles the estimate when it ends ([`Reservation::settle`]),
//! which gives all of it back when nothing was answered.

use super::tenant::{Client, OverLimit, TenantSlot};
use crate::errors::GatewayError;
use crate::metrics::Metrics;
use std::sync::Arc;

/// The fleet's store could not answer.
#[derive(Debug)]
pub struct Unreachable;

/// Tenants' per-minute limits kept for a whole fleet (one bucket per
/// tenant: `crate::fleet::limits`).
#[async_trait::async_trait]
pub trait FleetRates: Send + Sync {
    /// Whether it answers now.
    fn healthy(&self) -> bool;
    /// Take one request and `charge` tokens from `client`'s tenant's
    /// buckets, if every one of its limits allows it (else none): which
    /// refused, when one did.
    async fn take(
        &self,
        client: &Client,
        charge: u64,
    ) -> Result<Result<(), OverLimit>, Unreachable>;
    /// Debit `tokens` from the tenant's tokens (a negative amount gives
    /// them back): the bucket's level after (`None`: its tokens are not
    /// counted).
    async fn charge(&self, client: &Client, tokens: i64) -> Result<Option<f64>, Unreachable>;
}

/// Where a tenant's per-minute limits are kept for one request.
enum Book {
    /// No per-minute limits.
    None,
    /// This gateway's own buckets.
    Local,
    /// The fleet's, in its store: every gateway draws from one bucket.
    Fleet(Arc<dyn FleetRates>),
}

/// One request's claim on its tenant's limits.
pub struct Reservation {
    client: Arc<Client>,
    book: Book,
    _slot: TenantSlot,
    /// Its tokens, when its tenant counts them.
    tally: Option<TokenTally>,
    /// A WebSocket's turns so far (`response.create` messages).
    socket_turns: u64,
    /// The fleet's bucket level for the tenant's tokens as the last charge
    /// found it (`f64` bits; NaN: not known yet), for [`Reservation::spent`].
    fleet_level: Arc<std::sync::atomic::AtomicU64>,
    /// What it had used when the fleet's level was last asked for.
    asked_at: u64,
    /// A stream that spends its tenant's tokens past zero is cut
    /// (`auth.stream_over_limit: cut`): see [`Reservation::spent`].
    pub cuts_streams: bool,
}

/// How often (tokens used) a stream that may be cut asks the fleet's store
/// for its tenant's level when no charge did.
const LEVEL_STEP: u64 = 64;

impl OverLimit {
    /// The 429 that says which limit, counted by tenant.
    pub fn answer(&self, client: &Client, metrics: &Metrics) -> GatewayError {
        metrics
            .client_rejected
            .with_label_values(&[&client.tenant.name, self.limit])
            .inc();
        GatewayError::over_limit(self.limit, &client.tenant.name, self.retry_after_s)
    }
}

impl Reservation {
    /// Count a request of `client` against its tenant's `max_in_flight`,
    /// and against its per-minute limits: in the fleet's `store` while it
    /// answers (once the request's tokens are known: see
    /// [`Reservation::reserve`]), else in this gateway's own buckets now.
    pub fn open(
        client: Arc<Client>,
        store: Option<&Arc<dyn FleetRates>>,
        metrics: &Metrics,
    ) -> Result<Reservation, GatewayError> {
        let refuse = |e: OverLimit| e.answer(&client, metrics);
        let slot = client.take_slot().map_err(refuse)?;
        let book = match store {
            _ if !client.has_rates() => Book::None,
            Some(store) if store.healthy() => Book::Fleet(Arc::clone(store)),
            store => {
                if store.is_some() {
                    metrics.tenant_limits_local.inc();
                }
                client.take_rates().map_err(refuse)?;
                Book::Local
            }
        };
        Ok(Reservation {
            client,
            book,
            _slot: slot,
            tally: None,
            socket_turns: 0,
            fleet_level: Arc::new(std::sync::atomic::AtomicU64::new(f64::NAN.to_bits())),
            asked_at: 0,
            cuts_streams: false,
        })
    }

    /// Reserve the request's tokens as estimated now: its `prompt` and the
    /// output it may ask for (`max_output`). In the fleet's store, the
    /// request itself too; when the store went away meanwhile, this
    /// gateway's own buckets take both from here on.
    pub async fn reserve(
        &mut self,
        prompt: u64,
        max_output: Option<u64>,
        metrics: &Metrics,
    ) -> Result<(), GatewayError> {
        let c = Arc::clone(&self.client);
        let charged = match c.counts_tokens() {
            true => prompt.saturating_add(max_output.unwrap_or(0)),
            false => 0,
        };
        let refuse = |e: OverLimit| e.answer(&c, metrics);
        match &self.book {
            Book::None => return Ok(()),
            Book::Fleet(store) => match store.take(&c, charged).await {
                Ok(taken) => taken.map_err(refuse)?,
                Err(_) => {
                    metrics.tenant_limits_local.inc();
                    self.book = Book::Local;
                    c.take_rates().map_err(refuse)?;
                    c.charge_tokens(charged.min(i64::MAX as u64) as i64);
                }
            },
            Book::Local => c.charge_tokens(charged.min(i64::MAX as u64) as i64),
        }
        if c.counts_tokens() {
            self.tally = Some(TokenTally {
                max_output,
                ..TokenTally::new(charged, prompt)
            });
        }
        Ok(())
    }

    /// A chunk of the answer came back (its tokens, for an answer without
    /// usage). Once what came back and what is still to come outgrow the
    /// charge by [`CHARGE_STEP`], the tenant is charged the difference now:
    /// a long answer spends its tenant's budget while it streams, and the
    /// tenant's next requests are refused once it is spent, not after the
    /// stream ends.
    pub fn saw(&mut self, chunk: &[u8], streamed: bool) {
        let Some(tally) = self.tally.as_mut() else {
            return;
        };
        tally.saw(chunk, streamed);
        let projected = tally.projected();
        self.charge_up_to(projected, CHARGE_STEP);
    }

    /// Whether its tenant has per-minute limits its requests count against.
    pub fn counts_requests(&self) -> bool {
        !matches!(self.book, Book::None)
    }

    /// Turns begun on a WebSocket after its first (the upgrade was counted
    /// as the first): each one request of its tenant. `Err` (the 429 that
    /// ends the socket) once a per-minute limit refuses one.
    pub async fn socket_turns(
        &mut self,
        turns: u64,
        metrics: &Metrics,
    ) -> Result<(), GatewayError> {
        let c = Arc::clone(&self.client);
        let refuse = |e: OverLimit| e.answer(&c, metrics);
        let new = match self.socket_turns {
            0 => turns - 1,
            _ => turns,
        };
        self.socket_turns += turns;
        for _ in 0..new {
            match &self.book {
                Book::None => {}
                Book::Fleet(store) => match store.take(&c, 0).await {
                    Ok(taken) => taken.map_err(refuse)?,
                    Err(_) => c.take_rates().map_err(refuse)?,
                },
                Book::Local => c.take_rates().map_err(refuse)?,
            }
        }
        Ok(())
    }

    /// Raise its charge to `used` tokens in all, once that outgrows what it
    /// was charged by at least `step` (a socket's turns: what their usage
    /// reported so far, step 1), debiting the difference now where the
    /// request's limits are kept.
    pub fn charge_up_to(&mut self, used: u64, step: u64) {
        let Some(tally) = self.tally.as_mut() else {
            return;
        };
        let more = used.saturating_sub(tally.charged);
        if more < step.max(1) {
            return;
        }
        tally.charged += more;
        let tokens = more.min(i64::MAX as u64) as i64;
        match &self.book {
            Book::None => {}
            Book::Local => self.client.charge_tokens(tokens),
            Book::Fleet(_) => self.charge_fleet(tokens),
        }
    }

    /// Debit `tokens` in the fleet's store, off the request's path, noting
    /// the level it leaves (this gateway's own bucket takes them when the
    /// store cannot).
    fn charge_fleet(&self, tokens: i64) {
        let Book::Fleet(store) = &self.book else {
            return;
        };
        let (store, client) = (Arc::clone(store), Arc::clone(&self.client));
        let level = Arc::clone(&self.fleet_level);
        tokio::spawn(async move {
            match store.charge(&client, tokens).await {
                Ok(Some(l)) => level.store(l.to_bits(), std::sync::atomic::Ordering::Relaxed),
                Ok(None) => {}
                Err(_) => client.charge_tokens(tokens),
            }
        });
    }

    /// With [`Reservation::cuts_streams`], whether its tenant's
    /// `tokens_per_minute` is spent past zero with this request counted at
    /// what it has used so far (not at what it was reserved, nor at its
    /// projection): the limit a stream that is cut for it crossed. In the
    /// fleet's store, as of the last level a charge found there (asked for
    /// anew every [`LEVEL_STEP`] tokens).
    pub fn spent(&mut self) -> Option<OverLimit> {
        let tally = self.tally.as_ref().filter(|_| self.cuts_streams)?;
        let used = tally.used(None, true);
        let ahead = tally.charged as f64 - used as f64;
        let level = match &self.book {
            Book::None => return None,
            Book::Local => self.client.tokens_level(),
            Book::Fleet(_) => {
                if used >= self.asked_at + LEVEL_STEP {
                    self.asked_at = used;
                    self.charge_fleet(0);
                }
                f64::from_bits(self.fleet_level.load(std::sync::atomic::Ordering::Relaxed))
            }
        };
        let per_minute = self.client.limits.tokens_per_minute as f64;
        (level + ahead < 0.0)
            .then(|| OverLimit::waiting("tokens_per_minute", level + ahead, 0.0, per_minute))
    }

    /// The client whose key it holds.
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// Settle the reserved tokens by what the request used: its `usage`
    /// (prompt and completion tokens), else what came back; nothing when
    /// nothing was `answered`. Where it was reserved (the fleet's store
    /// while it answers, else here).
    pub async fn settle(&self, usage: Option<u64>, answered: bool) {
        let Some(tally) = &self.tally else {
            return;
        };
        let settle = tally.settle(usage, answered);
        let settled = match &self.book {
            Book::Fleet(_) if settle == 0 => true,
            Book::Fleet(store) => store.charge(&self.client, settle).await.is_ok(),
            _ => false,
        };
        if !settled {
            self.client.charge_tokens(settle);
        }
    }
}

/// Tokens an answer's projected use must outgrow its charge by before the
/// difference is charged while it streams (a lock, or a store round trip,
/// per step, not per chunk).
pub const CHARGE_STEP: u64 = 32;

/// A request's tokens against its tenant's `tokens_per_minute`: charged an
/// estimate when admitted, more as its answer outgrows it, settled by its `usage` when it ends, or, for an
/// answer without one (a stream without `stream_options.include_usage`,
/// the SDKs' default), by what came back: an SSE event a token, else 4
/// bytes a token.
#[derive(Default)]
pub struct TokenTally {
    /// What the tenant has been charged: up front the prompt and
    /// `max_tokens`, then more as the answer outgrows it.
    pub charged: u64,
    /// The prompt's estimate.
    pub prompt: u64,
    /// The output the request asked for at most, if it said.
    pub max_output: Option<u64>,
    /// What came back.
    events: u64,
    bytes: u64,
}

impl TokenTally {
    /// `charged` up front for a prompt estimated at `prompt` tokens.
    pub fn new(charged: u64, prompt: u64) -> TokenTally {
        TokenTally {
            charged,
            prompt,
            ..Default::default()
        }
    }

    /// A chunk of the answer came back.
    pub fn saw(&mut self, chunk: &[u8], streamed: bool) {
        self.bytes += chunk.len() as u64;
        if streamed {
            // Built once: a searcher built per chunk cost more than the search.
            static DATA: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
                std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"data:"));
            self.events += DATA.find_iter(chunk).count() as u64;
        }
    }

    /// What it will have used, as far as can be told while it streams:
    /// the prompt, what came back, and as much again as came back (or the
    /// rest of its `max_tokens`, when it set one): a stream that has run
    /// for a while is expected to run as long again.
    pub fn projected(&self) -> u64 {
        let out = match self.events {
            0 => self.bytes / crate::affinity::prefix::prompt::BYTES_PER_TOKEN,
            events => events,
        };
        let left = match self.max_output {
            Some(max) => max.saturating_sub(out),
            None => out,
        };
        self.prompt + out + left
    }

    /// What it used: its usage (`prompt + completion` tokens), else an
    /// estimate from what came back (nothing, when nothing did: the engine
    /// computed nothing to bill).
    pub fn used(&self, usage: Option<u64>, answered: bool) -> u64 {
        match usage {
            Some(tokens) => tokens,
            None if !answered => 0,
            None if self.events > 0 => self.prompt + self.events,
            // Not an event stream, and no usage: its bytes.
            None => self.prompt + self.bytes / crate::affinity::prefix::prompt::BYTES_PER_TOKEN,
        }
    }

    /// What settles the charge: what it used less what was charged.
    pub fn settle(&self, usage: Option<u64>, answered: bool) -> i64 {
        self.used(usage, answered) as i64 - self.charged as i64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_is_projected_to_run_as_long_again_or_to_its_max_tokens() {
        let mut t = TokenTally::new(300, 300);
        let events = |n: usize| "data: {}\n\n".repeat(n).into_bytes();
        t.saw(&events(100), true);
        assert_eq!(t.projected(), 300 + 100 + 100);
        t.max_output = Some(150);
        assert_eq!(t.projected(), 300 + 100 + 50);
        t.saw(&events(100), true);
        assert_eq!(t.projected(), 300 + 200, "past its max_tokens: what came");
        // JSON, no events: 4 bytes a token.
        let mut j = TokenTally::new(0, 10);
        j.saw(&[b'x'; 400], false);
        assert_eq!(j.projected(), 10 + 100 + 100);
    }

    #[test]
    fn a_stream_without_usage_is_settled_by_its_events() {
        let mut t = TokenTally::new(1_000, 300);
        t.saw(b"data: {}\n\ndata: {}\n\n", true);
        assert_eq!(t.used(None, true), 302);
        assert_eq!(t.settle(None, true), 302 - 1_000);
        assert_eq!(t.settle(Some(1_200), true), 200);
        assert_eq!(
            t.settle(None, false),
            -1_000,
            "nothing came back: nothing billed"
        );
    }

    /// A stream that may be cut is spent once its tenant's tokens would be
    /// below zero with it counted at what it used so far: not at once for
    /// the `max_tokens` reserved up front.
    #[tokio::test]
    async fn a_stream_is_spent_by_what_it_used_not_by_what_it_reserved() {
        let client = Arc::new(Client {
            tenant: Arc::new(super::super::tenant::Tenant::new("t")),
            class: None,
            weight: 1,
            limits: super::super::tenant::Limits {
                tokens_per_minute: 1_000,
                ..Default::default()
            },
        });
        let metrics = Metrics::new();
        let mut r = Reservation::open(Arc::clone(&client), None, &metrics).unwrap();
        r.cuts_streams = true;
        // 100 prompt tokens and max_tokens 3,000: the bucket goes far below
        // zero at once, and the stream is not spent for it.
        r.reserve(100, Some(3_000), &metrics).await.unwrap();
        assert!(client.tokens_level() < -2_000.0);
        let events = |n: usize| "data: {}\n\n".repeat(n).into_bytes();
        r.saw(&events(850), true);
        assert!(r.spent().is_none(), "950 of 1,000 used");
        r.saw(&events(60), true);
        let over = r.spent().expect("1,010 of 1,000 used");
        assert_eq!(over.limit, "tokens_per_minute");
        // Where streams are not cut, never.
        r.cuts_streams = false;
        assert!(r.spent().is_none());
    }
}
