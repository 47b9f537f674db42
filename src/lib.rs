//! agent-gateway: a Pingora-based L7 gateway that keeps every turn of an LLM
//! agent session on the replica that already holds its KV cache.

pub mod admin;
pub mod admission;
pub mod affinity;
pub mod auth;
pub mod clock;
pub mod config;
pub mod discovery;
pub mod errors;
pub mod fleet;
pub mod gateway;
pub mod headers;
pub mod kv;
pub mod logging;
pub mod metrics;
pub mod proxy;
pub mod routing;
pub mod scraper;
pub mod secret;
pub mod server;
pub mod state;
pub mod telemetry;
pub mod tls;
pub mod trace;
pub mod upstream;
