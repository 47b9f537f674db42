//! Where bindings are kept beyond this gateway's table: the
//! [`BindingStore`] the router (`Affinity::route`) consults before it
//! chooses a backend for a session and tells after. [`Alone`]: nowhere (one
//! gateway). A fleet's gateways share them through Redis
//! (`crate::fleet::bindings`), which implements the traits below.

use super::route::Selection;
use super::table::{Binding, BindingKey};
use std::sync::Arc;

/// A tier as the fleet's store names it: by its name, and its backends by
/// id (slots are this process's own numbers).
pub trait TierBackends: Send + Sync {
    fn name(&self) -> &str;
    fn index(&self) -> u16;
    /// The id of the backend in `slot`, if it is in this tier.
    fn backend_id(&self, slot: u32) -> Option<&str>;
    /// The slot of backend `id`, if it is in this tier.
    fn backend_slot(&self, id: &str) -> Option<u32>;
}

/// The tiers of the configuration in force (it may change with a reload).
pub trait Tiers: Send + Sync {
    fn by_name(&self, name: &str) -> Option<Arc<dyn TierBackends>>;
    fn by_index(&self, index: u16) -> Option<Arc<dyn TierBackends>>;
}

/// This gateway's binding table, as the store keeps it in step with the
/// fleet's (the router implements it).
pub trait LocalBindings: Send + Sync {
    /// The table's clock, ms.
    fn now_ms(&self) -> u64;
    /// The bindings' idle TTL, ms (0: affinity off).
    fn ttl_ms(&self) -> u64;
    /// `key`'s live binding.
    fn binding(&self, key: BindingKey) -> Option<Binding>;
    fn bindings(&self) -> Vec<(BindingKey, Binding)>;
    /// Take another gateway's binding in (see the table's `adopt`).
    fn adopt(&self, key: BindingKey, b: Binding, force: bool, checked_ms: u64) -> bool;
    /// When `key`'s binding last agreed with the store.
    fn synced_ms(&self, key: BindingKey) -> Option<u64>;
    fn mark_synced(&self, key: BindingKey, checked_ms: u64);
    /// Drop `key`'s binding here only (the store said so).
    fn forget_here(&self, key: BindingKey) -> bool;
}

/// Where bindings are kept besides this gateway's table.
#[async_trait::async_trait]
pub trait BindingStore: Send + Sync {
    /// Before a session's request is routed: bring its local binding in
    /// step with the store's when it was last checked too long ago.
    async fn sync_in(&self, affinity: &dyn LocalBindings, key: BindingKey, tier: &dyn TierBackends);
    /// After: tell the store what the request bound. `Some(slot)`: the
    /// store had another answer (a gateway that raced on the same new
    /// session, or a newer rebind) that this gateway can reach; the request
    /// goes there.
    async fn publish(
        &self,
        affinity: &dyn LocalBindings,
        key: BindingKey,
        tier: &dyn TierBackends,
        sel: &Selection,
    ) -> Option<u32>;
    /// The binding was dropped here: drop it everywhere, unless the store
    /// holds a newer one than `own`'s version, or another at that version
    /// (on another backend than `own`'s: the session bound anew meanwhile;
    /// `None`: whatever it holds).
    fn forget(&self, key: BindingKey, own: Option<(u32, String)>);
    /// Drop whatever the store holds for `key`, and return once it has (or
    /// failed): an operator's delete that has answered cannot land after
    /// the session's next turn has bound it again (a delete still under
    /// way would take that new binding out of the store, and the fleet's
    /// gateways would each bind the session on their own).
    async fn forget_now(&self, key: BindingKey);
}

/// One gateway alone: its table is the whole truth.
pub struct Alone;

#[async_trait::async_trait]
impl BindingStore for Alone {
    async fn sync_in(&self, _: &dyn LocalBindings, _: BindingKey, _: &dyn TierBackends) {}
    async fn publish(
        &self,
        _: &dyn LocalBindings,
        _: BindingKey,
        _: &dyn TierBackends,
        _: &Selection,
    ) -> Option<u32> {
        None
    }
    fn forget(&self, _: BindingKey, _: Option<(u32, String)>) {}
    async fn forget_now(&self, _: BindingKey) {}
}
