//! One request, one decision (SPEC §3). The route of a request, read from
//! the top down:
//!
//! 1. [`Intake`] reads what the request says of its route, once: its tier,
//!    session and parent keys, its tenant's scope from the headers; then,
//!    when routing needs it, the body's model, session field, stored
//!    response and prompt. It makes the [`RouteRequest`].
//! 2. [`Route::place`] decides where it goes ([`Route::decide`]: the
//!    backend, reason, lease): the tier's candidates, narrowed to the
//!    holder of a stored response, marked by admission and by what each
//!    holds of the prompt; then an explicit target, the session's binding
//!    ([`Affinity::route`]), or the least busy backend for a request
//!    without a session. With admission on it first reads the fleet's
//!    queue for a new session, then waits for a slot there ([`Seats`], the
//!    proxy's side) and decides again without a backend that went while it
//!    waited or that another gateway took first. A request whose backend
//!    lost its answer is sent again as [`Route::resend`] says: elsewhere,
//!    to the same backend, or not at all.
//! 3. [`Route::learn_response`] keeps the id of a response the backend
//!    stored; [`Route::end`] settles the binding and the prefix index by
//!    what the answer said.
//!
//! The proxy's phases read the request and write the answer; the session
//! key, made once by [`Intake`], is followed here alone. What routing reads
//! and writes besides the request (the binding table, the prefix index,
//! the stored responses, the fleet's store, admission) it is lent as
//! [`Tables`]: it never sees the gateway, and its tests make their own.
//!
//! [`Affinity::route`]: crate::affinity::Affinity::route

mod edits;
mod intake;
pub mod path;
mod place;
mod request;
mod route;
mod salt;
mod stored;
mod tables;

pub use intake::{BodyFacts, BodyNeed, Intake};
pub use place::{Resend, Seats};
pub use request::{RouteRequest, StoredRef};
pub use route::{Decision, Route};
pub use tables::Tables;

#[cfg(test)]
mod tests;
