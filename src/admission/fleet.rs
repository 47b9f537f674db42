//! One queue for a fleet's gateways ([`FleetSlots`]): where gateways share
//! their engines through the fleet's store, each backend's slots and its cap
//! on prefills are counted there, over every gateway's requests, and its
//! waiters wait there, in one order, so that two gateways keep an engine's
//! batch as one does and a freed slot goes to the fleet's best waiter,
//! whichever gateway holds it (with a queue on each gateway, a quiet tenant's
//! turn waited for its own gateway's half of the slots and behind the other
//! gateway's prefills).
//!
//! Order in the fleet's queue: by [`Class`], then the request whose tenant
//! has the fewest requests running or waiting at that backend, per weight
//! (counted over the fleet when it joins), then arrival. A slot is handed
//! over by the store (a message to the waiter's gateway, which takes it;
//! a lost message is made up for by asking every second). While the store
//! cannot be reached, requests wait in this gateway's own queue, its limit
//! its share of the engine's batch as before.
//!
//! Here: what admission and the store say to each other; the waits and
//! holds themselves are the queue's (`super::queue`), the way in is the
//! wait's (`super::wait`), the scripts are `crate::fleet::slots`.

use super::class::Class;
use super::reserve::Unreachable;
use std::sync::Arc;

/// A request's place in the fleet's queue for one backend.
#[derive(Clone, Debug)]
pub struct Seat {
    /// The backend's id (the same on every gateway of the fleet).
    pub backend: Arc<str>,
    /// Its id, unique on this gateway.
    pub id: u64,
    pub tenant: u64,
    pub weight: u32,
    pub class: Class,
    /// It counts as prefilling until its first byte.
    pub counted: bool,
    /// Its estimated prefill, tokens.
    pub tokens: u64,
    /// Backends its placement read found idle, besides this one where it
    /// found no other gateway's prefill ([`FleetAsk::idle_elsewhere`]).
    pub idle_elsewhere: Vec<Arc<str>>,
}

/// The backend's limits as this gateway knows them (learned or
/// configured), which the store applies to the fleet's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// Requests at once (0: none).
    pub limit: u32,
    /// Requests prefilling at once (0: none).
    pub prefilling: u32,
    pub cap_source: CapSource,
}

/// How a backend's cap on prefills is known.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum CapSource {
    /// Configured (or there is none to learn).
    #[default]
    Configured = 0,
    /// Learned from this gateway's answers' votes: the fleet's cap.
    Voted = 1,
    /// Learned, and no answer here voted yet: the fleet's last voted cap
    /// if any gateway's did.
    Unvoted = 2,
}

/// What the fleet's queue handed a seat: with a slot, the prefill other
/// gateways had under way at its backend then (its answer's wait is
/// weighed against it too).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Handed {
    None,
    Slot {
        ahead: Ahead,
    },
    /// Let by as a second prefill under a learned cap of one: its answer
    /// votes on the cap.
    Probe {
        ahead: Ahead,
    },
    /// Neither slot nor place: another gateway's prefill (`ahead`) started
    /// there since its placement read found none, and a backend that read
    /// found idle still is ([`FleetAsk::idle_elsewhere`]).
    Raced {
        ahead: Ahead,
    },
    /// (Asked for its slot.) The store knows no such seat: it lost its
    /// data since the seat was taken; the seat asks again.
    Lost,
}

/// Prefill other gateways had under way at a backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ahead {
    /// Their estimated tokens.
    pub tokens: u64,
    /// How long the oldest of them had been prefilling, ms.
    pub ms: u64,
}

/// Whose request is about to be placed: where it would wait in the
/// fleet's queue.
#[derive(Clone, Copy, Debug)]
pub struct Asker {
    pub tenant: u64,
    pub weight: u32,
    pub class: Class,
}

/// A backend as a request about to be placed finds it in the fleet's
/// queue, read in one store call: the gateway's own last sight of the
/// fleet's counts there ([`Seen`]) is as old as its last request there,
/// and counts every waiter, where a request waits only behind those the
/// queue's order puts before it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placing {
    /// The prefill other gateways have under way there.
    pub prefill: Ahead,
    /// The fleet's counts there now.
    pub seen: Seen,
    /// Its waiters and claims that would be served before the request: of
    /// a higher class, or of its own class whose tenant had no more there,
    /// per weight, than the asker's has now.
    pub ahead: u32,
    /// Requests placed there that have not asked for their slot yet
    /// ([`Placed::claimed`]).
    pub claims: u32,
    /// No room for another request: waiters, or as many running and
    /// claimed as this gateway's limit there.
    pub full: bool,
}

/// The backends a request about to be placed found in the fleet's queue,
/// in the order it asked, and the one it claimed. A claim stands for the
/// request until it asks for its slot (its seat takes it back) or for two
/// seconds: every request placed meanwhile counts it as a waiter there, so
/// a burst of new conversations, each reading the queue before any has
/// joined it, does not all go to the one that looked least queued. It is
/// made where the choice is already the read's: one backend with room, or
/// none with room and the fewest waiters ahead (ties: the first asked).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Placed {
    pub backends: Vec<Placing>,
    /// The index in `backends` of the one claimed.
    pub claimed: Option<usize>,
}

/// What this gateway holds from the fleet's queue at a backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub running: u32,
    pub prefilling: u32,
    /// The estimated tokens of those prefilling.
    pub prefill_tokens: u64,
}

impl Held {
    /// One of those prefilling, of `tokens`, no longer is.
    pub(super) fn prefill_over(&mut self, tokens: u64) {
        self.prefilling = self.prefilling.saturating_sub(1);
        self.prefill_tokens = self.prefill_tokens.saturating_sub(tokens);
    }
}

/// The fleet's counts at one backend, as a store call left them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Seen {
    pub running: u32,
    pub waiting: u32,
}

/// How a request ended, for its slot's release.
#[derive(Clone, Copy, Debug)]
pub struct Ended {
    /// It ran (its slot is given back), not only prefilled.
    pub ran: bool,
    /// It still counted as prefilling.
    pub prefilling: bool,
    /// Its estimated prefill, tokens.
    pub tokens: u64,
    /// It went as a probe (`ran` too: its request ended, and another
    /// probe may go).
    pub probe: bool,
}

/// Backends' slots kept for a whole fleet (`crate::fleet::slots`).
#[async_trait::async_trait]
pub trait FleetSlots: Send + Sync {
    /// Whether it answers now.
    fn healthy(&self) -> bool;
    /// A slot for `seat` now, or its place in the queue (`Handed::None`).
    async fn acquire(&self, seat: &Seat, caps: Caps) -> Result<(Handed, Seen), Unreachable>;
    /// Take the slot handed to `seat`, if one was.
    async fn take(&self, seat: &Seat, caps: Caps) -> Result<(Handed, Seen), Unreachable>;
    /// `seat` leaves the queue (a slot handed to it meanwhile is passed on).
    async fn leave(&self, seat: &Seat, caps: Caps) -> Result<Seen, Unreachable>;
    /// Each of `backends` (id, this gateway's limit there or 0), in their
    /// order, as a session placed now by `asker` would find it in the
    /// fleet's queue; with `claim` (a seat id), a claim on the one it will
    /// go to when the read decides it ([`Placed`]).
    async fn placing(
        &self,
        backends: &[(&str, u32)],
        asker: &Asker,
        claim: Option<u64>,
    ) -> Result<Placed, Unreachable>;
    /// An answer at `backend` voted that prefills there queued behind each
    /// other (`queued`) or ran side by side: the fleet's tally after it,
    /// counted as one gateway counts its own votes (within ± the same bound;
    /// it starts one vote further from "side by side", so no single vote
    /// takes the cap off). Caps learned on prefills there follow the tally
    /// in every slot script.
    async fn vote(&self, backend: &str, queued: bool) -> Result<i8, Unreachable>;
    /// A request of `tenant` at `backend` ended (or its prefill did): its
    /// room goes to the best waiters.
    async fn release(
        &self,
        backend: &str,
        tenant: u64,
        ended: Ended,
        caps: Caps,
    ) -> Result<Seen, Unreachable>;
}

/// What a request asks of the fleet's queue.
pub struct FleetAsk<'a> {
    /// The seat its placement claimed a backend with ([`Placed`]), if it did.
    pub seat: Option<u64>,
    pub backend: u32,
    pub backend_id: &'a str,
    pub class: Class,
    pub tenant: u64,
    pub weight: u32,
    pub tokens: u64,
    pub json: bool,
    /// Where the new conversation's placement read found no other
    /// gateway's prefill at this backend, and room: the other backends it
    /// found idle (nothing running or waiting). If another gateway's
    /// prefill has started here since and one of those is still idle (two
    /// gateways placed new conversations at once, each on the backend its
    /// read found idle), it takes no slot ([`Handed::Raced`]) and is placed
    /// again, without this backend: one gateway never sends two new
    /// conversations to one idle engine while another is idle. (Not when
    /// none is idle any more: in a burst that fills every backend, where
    /// it was placed is as good as any.)
    pub idle_elsewhere: &'a [Arc<str>],
}
