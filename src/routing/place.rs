//! The placement loop: a decision, then a slot there (admission); decided
//! again without a backend that went while the request waited, or that
//! another gateway's new conversation took first. And where a request
//! whose backend lost its answer is sent again (SPEC §3.6).

use super::route::Route;
use super::tables::Tables;
use crate::admission::fleet::Asker;
use crate::admission::{Class, Slot};
use crate::errors::Refusal;
use std::sync::Arc;

/// Admission's side of a placement, as the proxy runs it: it knows the
/// client, and waits for a slot while watching it.
pub trait Seats {
    /// The request's class and fair-share tenant as of now (a subagent
    /// takes its parent session's class when it is seated).
    fn who(&self) -> (Class, u64);
    /// Who asks the fleet's queue for a new session's placement.
    fn asker(&self) -> Asker;
    /// The seat that placement read claimed, to ask for its slot with.
    fn claimed(&mut self, seat: Option<u64>);
    /// Whether the client left (looked at while the request waits for
    /// another of its session to be placed).
    fn client_gone(&self) -> bool;
    /// A slot at the backend `route` decided, or that it is to be placed
    /// again without it. `idle_elsewhere`: what its placement read found
    /// idle besides it ([`crate::admission::Ask::idle_elsewhere`]).
    #[allow(async_fn_in_trait)] // one implementation, called generically
    async fn seat(
        &mut self,
        route: &mut Route,
        idle_elsewhere: Vec<Arc<str>>,
    ) -> Result<Slot, Refusal>;
}

/// What becomes of a request whose backend's connection failed before any
/// byte of its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resend {
    /// Its backend is gone: to another candidate, its session rebound there.
    Elsewhere,
    /// Nothing of it reached the backend: placed afresh, anywhere.
    Anywhere,
    /// On a connection the backend closed as it was reused: to the same
    /// backend, on a fresh one.
    Same,
    /// A live backend closed a fresh connection under it: it may be
    /// running the request, which is not sent again.
    Not,
}

impl Route {
    /// Where the request goes, with its slot there when admission is on:
    /// its prefill there in tokens, when routing knows it.
    pub async fn place(
        &mut self,
        t: Tables<'_>,
        seats: &mut impl Seats,
    ) -> Result<Option<u64>, Refusal> {
        if !self.req.routing.config.admission.enabled {
            let d = self.decide(t, None, || seats.client_gone()).await?;
            return Ok(d.prefill);
        }
        let claim = self.see_fleet(t, seats.asker()).await;
        seats.claimed(claim);
        // A new conversation raced to its backend by another gateway is
        // placed again once (see `Slot::Raced`).
        let mut raced = false;
        loop {
            let who = seats.who();
            let decided = self.decide(t, Some(who), || seats.client_gone()).await?;
            let (slot, id) = (decided.backend.slot, Arc::clone(&decided.backend.id));
            let idle_elsewhere = match raced {
                true => Vec::new(),
                false => self.idle_elsewhere(slot),
            };
            match seats.seat(self, idle_elsewhere).await? {
                Slot::Held => return Ok(self.decision().and_then(|d| d.prefill)),
                // Its backend went while it waited: it is placed again
                // without it, its session rebound like any turn's whose
                // backend is down.
                Slot::BackendGone => {
                    log::info!("backend {id} went while requests waited for it; placing them again")
                }
                // Another gateway's new conversation took it first: the
                // others were as idle when this one's read found them.
                Slot::Raced => raced = true,
            }
            self.exclude(slot);
        }
    }

    /// Its backend `slot` lost the request's answer before any byte of it:
    /// where it is sent again. `gone`: that backend is gone (or was ejected
    /// as hung holding it); `unsent`: nothing of it reached the backend;
    /// `reused`: the connection was a reused one (an engine's keep-alive
    /// close racing the request).
    pub fn resend(&mut self, slot: u32, gone: bool, unsent: bool, reused: bool) -> Resend {
        if gone {
            self.exclude(slot);
            return Resend::Elsewhere;
        }
        if unsent {
            return Resend::Anywhere;
        }
        if !reused {
            return Resend::Not;
        }
        let tier = Arc::clone(&self.req.tier);
        for b in tier.backends.iter().filter(|b| b.slot != slot) {
            self.exclude(b.slot);
        }
        Resend::Same
    }
}
