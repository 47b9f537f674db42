//! Who a request is and how it is admitted: its client key's grant and
//! tenant, its class (its own header, its parent session's, its key's,
//! the default; a key's class is a ceiling), its deadline, its fair-share
//! tenant, its slot, and the tokens its tenant is charged for it.

use super::class::Class;
use super::queue::Permit;
use super::reserve::Reservation;
use super::tenant::Client;
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
    /// Its claim on its tenant's limits, when it presented a known key
    /// (boxed: without keys the context stays small).
    pub reservation: Option<Box<Reservation>>,
    /// The seat its placement claimed a backend of the fleet's queue with
    /// (`fleet::Placed`), until it asks for its slot.
    pub claim: Option<u64>,
    /// Its slot at its backend until it ends.
    pub permit: Option<Permit>,
    /// It waited in the queue for that slot, this long.
    pub waited: bool,
    pub queue_wait: Duration,
    /// A body not read before it was admitted: how long its prefill should
    /// take, and whether it was seen to ask for a stream on its way.
    pub prefill_clock: Option<(Duration, bool)>,
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
    /// Who it is in the fleet's queue: its tenant, weight and class.
    pub fn asker(&self) -> super::fleet::Asker {
        super::fleet::Asker {
            tenant: self.tenant,
            weight: self.client.as_ref().map_or(1, |c| c.weight),
            class: self.class,
        }
    }

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
                    tenant: Arc::new(super::super::tenant::Tenant::new("t")),
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
}
