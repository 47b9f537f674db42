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

use super::class::Class;
use super::queue::{Admission, Admit, Permit};
use super::reserve::Unreachable;
use std::sync::Arc;
use std::time::Duration;

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
}

/// The backend's limits as this gateway knows them (learned or
/// configured), which the store applies to the fleet's counts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Caps {
    /// Requests at once (0: none).
    pub limit: u32,
    /// Requests prefilling at once (0: none).
    pub prefilling: u32,
    pub probing: Probing,
}

/// How a backend's cap on prefills is known.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum Probing {
    /// Configured (or there is none to learn).
    #[default]
    Off = 0,
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
}

/// Prefill other gateways had under way at a backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ahead {
    /// Their estimated tokens.
    pub tokens: u64,
    /// How long the oldest of them had been prefilling, ms.
    pub ms: u64,
}

/// What this gateway holds from the fleet's queue at a backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub running: u32,
    pub prefilling: u32,
    /// The estimated tokens of those prefilling.
    pub prefill_tokens: u64,
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
    /// The slot handed to `seat` was taken as its message said: the
    /// store's record of it goes.
    async fn consume(&self, seat: &Seat) -> Result<(), Unreachable>;
    /// `seat` leaves the queue (a slot handed to it meanwhile is passed on).
    async fn leave(&self, seat: &Seat, caps: Caps) -> Result<Seen, Unreachable>;
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

/// A request's hold on a fleet slot, kept by its permit.
#[derive(Clone)]
pub(super) struct Hold {
    pub(super) slots: Arc<dyn FleetSlots>,
    pub(super) backend: Arc<str>,
    pub(super) tenant: u64,
}

impl Hold {
    /// Give back what the request held (in the background: it is
    /// dropping), the call counted by `op` (begun before this gateway's own
    /// counts changed).
    pub(super) fn release(&self, op: Op, slot: u32, ended: Ended) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return op.0.fleet_dirty();
        };
        let hold = self.clone();
        rt.spawn(async move {
            let admission = &op.0;
            let caps = admission.fleet_caps(slot);
            let released = hold.slots.release(&hold.backend, hold.tenant, ended, caps);
            match released.await {
                Ok(seen) => admission.fleet_seen(slot, seen),
                Err(Unreachable) => admission.fleet_dirty(),
            }
            drop(op);
        });
    }
}

/// A call to the fleet's queue under way, with the change to this
/// gateway's own counts it brings: while one is, the counts are not set
/// again from this gateway's (they would miss it).
pub(super) struct Op(pub(super) Arc<Admission>);

impl Drop for Op {
    fn drop(&mut self) {
        self.0.fleet_op_over();
    }
}

/// How often a waiter asks the store whether a slot was handed to it (its
/// message may have been lost).
const ASK_EVERY: Duration = Duration::from_secs(1);

/// A request waiting in the fleet's queue.
pub(super) struct FleetWait {
    pub(super) slots: Arc<dyn FleetSlots>,
    pub(super) seat: Seat,
    /// Told when the store says a slot was handed to it.
    /// Told when the store says a slot was handed to it (what it was
    /// handed; `None`: to ask whether one was).
    pub(super) woken: tokio::sync::mpsc::UnboundedReceiver<Option<Handed>>,
    /// Its wait is over (a slot taken, or the queue left): nothing to
    /// leave when it drops.
    pub(super) over: bool,
    /// A take is under way: one dropped meanwhile may have taken a slot
    /// it never uses.
    pub(super) taking: bool,
}

impl FleetWait {
    /// Until a slot is handed over to it at `slot` and taken (whether as
    /// a probe); `Unreachable` when the store stopped answering (it is to
    /// be placed again, here; its seat is left to setting the counts
    /// again). Taken, the caller's `Op` covers the permit's making.
    pub(super) async fn taken(
        &mut self,
        admission: &Arc<Admission>,
        slot: u32,
    ) -> Result<Handed, Unreachable> {
        let mut ask = tokio::time::interval(ASK_EVERY);
        ask.tick().await;
        loop {
            let told = tokio::select! {
                told = self.woken.recv() => told.flatten(),
                _ = ask.tick() => None,
            };
            if let Some(handed) = told {
                // Taken at once, as the store's message said; its record
                // goes in the background.
                self.over = true;
                let (slots, seat) = (Arc::clone(&self.slots), self.seat.clone());
                let admission = Arc::clone(admission);
                tokio::spawn(async move {
                    if slots.consume(&seat).await.is_err() {
                        admission.fleet_dirty();
                    }
                });
                return Ok(handed);
            }
            self.taking = true;
            let taken = self
                .slots
                .take(&self.seat, admission.fleet_caps(slot))
                .await;
            self.taking = false;
            let (handed, seen) = taken?;
            admission.fleet_seen(slot, seen);
            if handed != Handed::None {
                self.over = true;
                return Ok(handed);
            }
        }
    }

    /// Leave the queue (in the background when `admission` drops it).
    pub(super) fn leave(&mut self, admission: &Arc<Admission>, slot: u32) {
        if std::mem::replace(&mut self.over, true) {
            return;
        }
        admission.fleet_forget(self.seat.id);
        if self.taking {
            admission.fleet_dirty();
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return admission.fleet_dirty();
        };
        let (slots, seat, op) = (
            Arc::clone(&self.slots),
            self.seat.clone(),
            admission.fleet_op(),
        );
        rt.spawn(async move {
            let admission = &op.0;
            let caps = admission.fleet_caps(slot);
            match slots.leave(&seat, caps).await {
                Ok(seen) => admission.fleet_seen(slot, seen),
                Err(Unreachable) => admission.fleet_dirty(),
            }
            drop(op);
        });
    }
}

/// What a request asks of the fleet's queue.
pub struct FleetAsk<'a> {
    pub backend: u32,
    pub backend_id: &'a str,
    pub class: Class,
    pub tenant: u64,
    pub weight: u32,
    pub tokens: u64,
    pub json: bool,
}

impl Admission {
    /// A slot for `ask` from the fleet's queue, when this gateway is one of
    /// a fleet whose store answers; `None`: it is not, or the store did not
    /// answer (the request waits here, in this gateway's queue).
    pub async fn admit_fleet(self: &Arc<Self>, ask: FleetAsk<'_>) -> Option<Admit> {
        let slots = self.fleet_slots()?;
        let (seat, woken) = self.fleet_seat(&ask)?;
        let caps = self.fleet_caps(ask.backend);
        let _op = self.fleet_op();
        match slots.acquire(&seat, caps).await {
            Ok((handed @ (Handed::Slot { .. } | Handed::Probe { .. }), seen)) => {
                self.fleet_forget(seat.id);
                self.fleet_seen(ask.backend, seen);
                let hold = Hold {
                    slots,
                    backend: seat.backend,
                    tenant: seat.tenant,
                };
                let s = (seat.counted, handed);
                Some(Admit::Now(self.fleet_permit(
                    ask.backend,
                    ask.tokens,
                    s,
                    hold,
                )))
            }
            Ok((Handed::None, seen)) => {
                self.fleet_seen(ask.backend, seen);
                let mut wait = FleetWait {
                    slots,
                    seat,
                    woken,
                    over: false,
                    taking: false,
                };
                if !self.room_to_queue() {
                    wait.leave(self, ask.backend);
                    return Some(Admit::Full);
                }
                Some(Admit::Wait(self.fleet_ticket(
                    ask.backend,
                    ask.tokens,
                    wait,
                )))
            }
            Err(Unreachable) => {
                // It may have been seated all the same.
                self.fleet_forget(seat.id);
                self.fleet_dirty();
                None
            }
        }
    }

    /// The permit for the slot the fleet's queue `handed` to `wait`.
    pub(super) fn fleet_taken(
        self: &Arc<Self>,
        slot: u32,
        tokens: u64,
        wait: &FleetWait,
        handed: Handed,
    ) -> Permit {
        self.fleet_queued(slot, -1);
        self.fleet_forget(wait.seat.id);
        let hold = Hold {
            slots: Arc::clone(&wait.slots),
            backend: Arc::clone(&wait.seat.backend),
            tenant: wait.seat.tenant,
        };
        self.fleet_permit(slot, tokens, (wait.seat.counted, handed), hold)
    }
}
