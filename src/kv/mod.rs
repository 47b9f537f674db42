//! The engines' own KV-cache events (a backend's `kv_events`) as the
//! gateway's view of what each engine holds.
//!
//! - [`wire`]: vLLM's frames and batches, in both forms its releases send;
//! - [`holdings`]: one engine's blocks and how far each session's latest
//!   prompt is still held;
//! - [`view`]: one backend's engine as its events tell it ([`view::KvView`],
//!   kept in the backend's stats), and a turn's prediction;
//! - [`session`]: how a session is named to an engine;
//! - [`subscribe`]: the background service that keeps one subscription per
//!   backend, fills gaps from the replay socket, and clears a backend's
//!   holdings when its engine goes (a restart empties its cache).
//!
//! This module knows nothing of the gateway: the backends to follow come
//! through [`subscribe::EventSources`], and routing reads the views through
//! the tier ([`crate::upstream::Tier::kv_holdings`]).
//!
//! Every request with a session goes to a backend with `kv_events` with
//! `X-Session-ID` set to the session's binding key
//! ([`session::upstream_session_id`]: keyed by
//! `affinity.hash_key`, scoped by tier and tenant, the same on every gateway
//! of a fleet), so an engine's `BlockStored` events name the session that
//! stored them. While a backend's events are current ([`view::KvView::exact`]),
//! what it holds of a session is read from them instead of inferred: routing
//! reads it as the candidate's `prefix_tokens`, and a session whose blocks
//! its backend evicted is free to move (soft mode, drains).

pub mod holdings;
pub mod session;
pub mod subscribe;
pub mod view;
pub mod wire;
