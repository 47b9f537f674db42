//! Admission when backends are saturated (`admission`): each backend runs
//! at most its limit of requests at once, and the rest wait here, in the
//! gateway, instead of in the engine's own queue, where they could only be
//! served in arrival order.
//!
//! Order among the waiters of one backend: strictly by [`Class`] (a person
//! waits on an interactive turn; a batch is told to back off by its
//! deadline), and within a class by weighted fair queueing on estimated
//! tokens: each tenant's requests get virtual finish tags `start + tokens /
//! weight`, with `start` no earlier than the tenant's last finish nor than the
//! virtual time (the start tag of the request admitted last), and wait in
//! finish-tag order; so one tenant's long prompts cannot starve another's
//! short ones, and a tenant that was idle does not bank credit. Each backend
//! keeps its own tags and virtual time: a session waits for its own backend,
//! and the share that counts is of the backend it waits for (with one clock
//! for all, a backend whose queue ran ahead pushed a quiet tenant's next
//! request behind every waiter of another backend). A released slot goes
//! straight to the best waiter of that backend (no herd racing for it).
//!
//! A backend may also cap the requests prefilling at once (sent, no first
//! byte back yet): on an engine whose prefill is compute-bound and one at a
//! time, a request let in behind three others' prefills waits for all three
//! inside the engine, where no class or tenant counts; held here instead, it
//! goes next in fair order. With no cap configured, admission learns
//! whether it needs one: answers sent behind others' prefills that waited
//! for them vote for one prefill at a time, answers that ran beside them
//! against it (see [`Admission::vote_prefill`]).
//!
//! The module's parts: [`queue`] (slots, limits, the order of waiters),
//! [`fleet`] (one queue for a fleet's gateways, in its store),
//! [`learn`] (limits learned from the engines' gauges and answers), [`check`]
//! (a learned limit checked against what the engine completes),
//! [`class`] (priority classes), [`tenant`] (a client key's tenant and its
//! limits: in flight, requests and tokens a minute, locally or across the
//! fleet), [`who`] (who a request is and how it waits: tenant, class and its
//! ceiling, deadline), [`reserve`] (its claim on its tenant's limits:
//! reserved up front, settled from usage, in the fleet's store or this
//! gateway's own) and [`wait`] (the wait for a slot: deadline, a client or
//! backend that goes, the 429s that end it).

mod backlog;
pub mod check;
pub mod class;
mod fair;
pub mod fleet;
pub mod learn;
pub mod queue;
pub mod reserve;
pub mod tenant;
pub mod wait;
pub mod who;

pub use backlog::PrefillRoom;
pub use class::Class;
pub use learn::{Limit, LimitSource, Prefill, LEARN_SCRAPE_MS};
pub use queue::{Admission, Admit, Permit, Slots, Ticket};
pub use reserve::{Reservation, TokenTally};
pub use tenant::{Client, Limits, OverLimit, Tenant, TenantSlot};
pub use wait::{Ask, Slot, Waited, Watch};
pub use who::Admittance;
