//! Who a request is and how it is admitted: its client key's grant and
//! tenant, its class (its own header, its parent session's, its key's,
//! the default; a key's class is a ceiling), its deadline, its fair-share
//! tenant, its slot, and the tokens its tenant is charged for it.

use super::{Class, Client, Permit, TenantSlot};
use std::sync::Arc;
use std::time::Duration;

/// Who sent a request (`auth`) and how it waits for a slot (`admission`).
#[derive(Default)]
pub struct Admittance {
    /// What its client key grants, when it presented a known one.
    pub client: Option<Arc<Client>>,
    /// Its tenant for fair share: the key's tenant, else its key or
    /// `Authorization` value (hashed), else 0 (everyone without one).
    pub tenant: u64,
    pub class: Class,
    /// Its class came from its own header (else its parent's, its key's or
    /// the default).
    pub class_named: bool,
    /// The highest class it may have: its key's (else the default) when it
    /// presented one.
    pub ceiling: Option<Class>,
    /// The longest it waits for a slot.
    pub max_wait: Duration,
    /// Counted against its tenant's `max_in_flight` until it ends.
    pub tenant_slot: Option<TenantSlot>,
    /// Its slot at its backend until it ends.
    pub permit: Option<Permit>,
    /// It waited in the queue for that slot, this long.
    pub waited: bool,
    pub queue_wait: Duration,
    /// Its tokens, when its key's tenant counts them.
    pub tokens: Option<TokenTally>,
    /// Its tenant's per-minute limits are the fleet's (kept in the store).
    pub fleet_rates: bool,
}

/// What the config says of classes and deadlines (`admission.*`).
pub struct Rules<'a> {
    pub priority_header: &'a http::HeaderName,
    pub max_wait_header: &'a http::HeaderName,
    /// The class of a request that names none (and has no key that does).
    pub default_priority: Class,
    /// The longest any request waits.
    pub max_wait: Duration,
}

/// A priority header that names no class.
#[derive(Debug, PartialEq, Eq)]
pub struct InvalidPriority;

impl Admittance {
    /// Its class, deadline and fair-share tenant, from its `headers` (as
    /// `rules` name them) and the client key it presented (`key`; its grant
    /// already in `self.client` when the key is known). A key's class
    /// (else the default) is its ceiling: a header may lower it, never
    /// raise it, or a batch key could starve everyone by calling itself
    /// interactive. Without keys nobody is known and the header is taken
    /// as sent.
    pub fn classify(
        &mut self,
        rules: &Rules,
        headers: &http::HeaderMap,
        key: Option<&[u8]>,
    ) -> Result<(), InvalidPriority> {
        let asked = match headers.get(rules.priority_header) {
            Some(v) => Some(
                v.to_str()
                    .ok()
                    .and_then(Class::parse)
                    .ok_or(InvalidPriority)?,
            ),
            None => None,
        };
        self.class_named = asked.is_some();
        self.ceiling = self
            .client
            .as_ref()
            .map(|c| c.class.unwrap_or(rules.default_priority));
        self.class = match (asked, self.ceiling) {
            (Some(asked), Some(ceiling)) => asked.max(ceiling),
            (Some(asked), None) => asked,
            (None, ceiling) => ceiling.unwrap_or(rules.default_priority),
        };
        self.max_wait = headers
            .get(rules.max_wait_header)
            .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
            .map_or(rules.max_wait, |ms| {
                rules.max_wait.min(Duration::from_millis(ms))
            });
        // Odd ids are keys' tenants (`Tenant::new`); a presented key or
        // `Authorization` value that is none is its own tenant, hashed.
        self.tenant = match (&self.client, key) {
            (Some(c), _) => c.tenant.id,
            (None, Some(k)) => xxhash_rust::xxh3::xxh3_64(k) & !1,
            (None, None) => headers
                .get(http::header::AUTHORIZATION)
                .map_or(0, |v| xxhash_rust::xxh3::xxh3_64(v.as_bytes()) & !1),
        };
        Ok(())
    }

    /// A subagent that named no class takes its parent session's, held to
    /// its own ceiling.
    pub fn inherit_class(&mut self, parent: Class) {
        self.class = self.ceiling.map_or(parent, |ceiling| parent.max(ceiling));
    }
}

/// A request's tokens against its tenant's `tokens_per_minute`: charged an
/// estimate when admitted, settled by its `usage` when it ends, or, for an
/// answer without one (a stream without `stream_options.include_usage`,
/// the SDKs' default), by what came back: an SSE event a token, else 4
/// bytes a token.
#[derive(Default)]
pub struct TokenTally {
    /// What the tenant was charged up front: the prompt and `max_tokens`.
    pub charged: u64,
    /// The prompt's estimate.
    pub prompt: u64,
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

    fn classify(client: Option<Class>, headers: &[(&str, &str)]) -> Admittance {
        let (p, w) = (
            http::HeaderName::from_static("x-agent-serve-priority"),
            http::HeaderName::from_static("x-agent-serve-max-wait-ms"),
        );
        let rules = Rules {
            priority_header: &p,
            max_wait_header: &w,
            default_priority: Class::Normal,
            max_wait: Duration::from_secs(30),
        };
        let mut h = http::HeaderMap::new();
        for (k, v) in headers {
            h.insert(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        let mut who = Admittance {
            client: client.map(|class| {
                Arc::new(Client {
                    tenant: Arc::new(super::super::Tenant::new("t")),
                    class: Some(class),
                    weight: 1,
                    limits: Default::default(),
                })
            }),
            ..Default::default()
        };
        who.classify(&rules, &h, None).expect("a class");
        who
    }

    #[test]
    fn a_keys_class_is_a_ceiling_and_a_deadline_header_only_shortens() {
        let asked = [("x-agent-serve-priority", "interactive")];
        assert_eq!(classify(None, &asked).class, Class::Interactive);
        assert_eq!(classify(Some(Class::Batch), &asked).class, Class::Batch);
        let lower = [("x-agent-serve-priority", "batch")];
        assert_eq!(
            classify(Some(Class::Interactive), &lower).class,
            Class::Batch
        );
        assert_eq!(
            classify(Some(Class::Interactive), &[]).class,
            Class::Interactive
        );
        let mut sub = classify(Some(Class::Normal), &[]);
        sub.inherit_class(Class::Interactive);
        assert_eq!(
            sub.class,
            Class::Normal,
            "a parent's class is held to the ceiling too"
        );
        let wait = |ms: &str| classify(None, &[("x-agent-serve-max-wait-ms", ms)]).max_wait;
        assert_eq!(wait("500"), Duration::from_millis(500));
        assert_eq!(wait("90000"), Duration::from_secs(30));
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
}
