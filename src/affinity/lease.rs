//! A request's hold on its binding ([`Lease`]): released on drop, so a
//! finished, failed or abandoned request (client gone) all end the lease the
//! same way. The first request of a new binding owns its pending state: it
//! confirms the binding once it reaches the backend, and dropping it
//! unconfirmed removes the binding so a waiting request can choose instead.

use super::table::BindingKey;
use std::sync::Arc;

/// What a lease holds on: the router's binding table, as the lease ends it.
pub trait Holder: Send + Sync {
    /// The first request of the binding's incarnation `generation` reached
    /// its backend: it is no longer pending, and its waiters may follow.
    fn confirm(&self, key: BindingKey, generation: u32);
    /// The lease ended: released, or (`pending_owner`) its pending binding
    /// given up.
    fn end(&self, key: BindingKey, generation: u32, pending_owner: bool);
}

pub struct Lease {
    pub(super) holder: Arc<dyn Holder>,
    pub(super) key: BindingKey,
    /// The binding's incarnation this lease is on (see the table).
    pub(super) generation: u32,
    pub(super) pending_owner: bool,
}

impl Lease {
    pub fn key(&self) -> BindingKey {
        self.key
    }

    pub fn owns_pending(&self) -> bool {
        self.pending_owner
    }

    /// The request reached its backend: waiters may follow the binding.
    pub fn confirm(&mut self) {
        if self.pending_owner {
            self.pending_owner = false;
            self.holder.confirm(self.key, self.generation);
        }
    }

    /// End the lease without giving up a pending binding (its owner is
    /// retrying under a new lease).
    pub fn hand_over(mut self) {
        self.pending_owner = false;
    }
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Lease({:032x})", self.key)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.holder
            .end(self.key, self.generation, self.pending_owner);
    }
}
