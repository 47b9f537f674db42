//! [`Tables`]: what routing reads and writes besides the request itself,
//! lent for one call by the process-wide state that owns them; the routing
//! tests make their own, with no network.

use crate::admission::Admission;
use crate::affinity::prefix::Prefix;
use crate::affinity::responses::ResponseRoutes;
use crate::affinity::Affinity;
use crate::fleet::store::SharedStore;
use crate::metrics::Metrics;
use std::sync::Arc;

/// The tables a route is decided with.
#[derive(Clone, Copy)]
pub struct Tables<'a> {
    /// The binding table and the session router.
    pub affinity: &'a Arc<Affinity>,
    /// Prompts, their conversations and where their prefixes are cached.
    pub prefix: &'a Prefix,
    /// Which backend stored which response (`previous_response_id`).
    pub responses: &'a ResponseRoutes,
    /// The fleet's shared store (`affinity.store: redis`).
    pub store: Option<&'a Arc<SharedStore>>,
    /// Slots per backend and the queue for them: which are full, and the
    /// fleet's queue as a new session's placement reads it.
    pub admission: &'a Admission,
    /// Where moves are counted (`agentserve_affinity_moves_total`).
    pub metrics: &'a Metrics,
}
