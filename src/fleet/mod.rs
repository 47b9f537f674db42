//! The fleet's state in one place: what several gateways share through
//! Redis (`affinity.store: redis`).
//!
//! - [`store`]: the Redis client, its scripts, its health and its
//!   subscription to other gateways' messages;
//! - [`bindings`]: the fleet's bindings, kept in step with each gateway's
//!   table (the router's `BindingStore`);
//! - [`conversations`]: where keyless conversations' turns ended, so that
//!   any gateway continues a conversation another routed;
//! - [`limits`]: tenants' per-minute limits as one bucket per tenant for the
//!   whole fleet (admission's `FleetRates`);
//! - [`slots`]: each backend's slots and the one queue for them, for the
//!   whole fleet (admission's `FleetSlots`).

pub mod bindings;
pub mod conversations;
pub mod limits;
pub mod slots;
pub mod store;

pub use bindings::Fleet;
pub use store::{SharedStore, StoreConfig, StoreError, StoreKind, StoreTls};

#[cfg(test)]
mod tests;
