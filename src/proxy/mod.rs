//! The request's path through Pingora's hooks (SPEC §3–§4). The
//! `impl ProxyHttp` below is the table of contents; each phase is a module
//! of functions over the request's context ([`ctx::RequestCtx`], a part per
//! concern), and where the request goes is routing's
//! ([`crate::routing`]):
//!
//! - `request.rs` (`request_filter`, `request_body_filter`): validate
//!   headers and size, identify the client, read the body when routing
//!   needs it, make the route's request;
//! - `peer.rs` (`upstream_peer`, `fail_to_connect`, `error_while_proxy`):
//!   the route's decision and a slot there; the next candidate on a
//!   connect failure; replay on a dead pooled connection; passive health;
//! - `modify.rs` (`upstream_request_filter`, `response_filter`,
//!   `response_body_filter`): headers, response metadata, usage;
//! - `finish.rs` (`fail_to_proxy`, `logging`): error answers, what the end
//!   teaches, metrics, traces. The lease, slot and in-flight count end
//!   when the context drops.

mod answer;
pub mod conn_guard;
mod ctx;
mod finish;
mod modify;
mod peer;
mod record;
mod request;
pub mod request_body;
pub mod response;
pub mod upstream_conn;
mod websocket;

use crate::gateway::Gateway;
use async_trait::async_trait;
use bytes::Bytes;
pub use ctx::RequestCtx;
use pingora_core::upstreams::peer::HttpPeer;
use pingora_core::{Error, Result};
use pingora_http::{RequestHeader, ResponseHeader};
use pingora_proxy::{FailToProxy, ProxyHttp, Session};
use std::sync::Arc;

pub struct GatewayProxy {
    gw: Arc<Gateway>,
    ids: record::RequestIds,
}

impl GatewayProxy {
    pub fn new(gw: Arc<Gateway>) -> Self {
        GatewayProxy {
            gw,
            ids: record::RequestIds::new(),
        }
    }
}

#[async_trait]
impl ProxyHttp for GatewayProxy {
    type CTX = RequestCtx;

    /// What Pingora's own error lines say about a request ("Fail to
    /// proxy: …"): its summary and its `x-request-id`.
    fn request_summary(&self, session: &Session, ctx: &RequestCtx) -> String {
        let summary = session.as_ref().request_summary();
        match ctx.record.request_id.as_ref().and_then(|v| v.to_str().ok()) {
            Some(id) => format!("{summary}, request id {id}"),
            None => summary,
        }
    }

    fn new_ctx(&self) -> RequestCtx {
        RequestCtx::default()
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut RequestCtx) -> Result<bool> {
        request::filter(&self.gw, &self.ids, session, ctx).await
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        request::body_filter(&self.gw, body, end_of_stream, ctx)
            .await
            .map_err(|e| peer::fail(ctx, e))
    }

    async fn upstream_peer(
        &self,
        session: &mut Session,
        ctx: &mut RequestCtx,
    ) -> Result<Box<HttpPeer>> {
        peer::choose(&self.gw, session, ctx).await
    }

    async fn connected_to_upstream(
        &self,
        _session: &mut Session,
        reused: bool,
        peer: &HttpPeer,
        #[cfg(unix)] fd: std::os::unix::io::RawFd,
        #[cfg(windows)] _sock: std::os::windows::io::RawSocket,
        digest: Option<&pingora_core::protocols::Digest>,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        #[cfg(unix)]
        if reused {
            if let Some(b) = ctx
                .backend()
                // A request that waited for its slot may find the backend
                // gone meanwhile (a crash frees the slot it then takes):
                // its pooled connection is looked at first too.
                .filter(|b| ctx.who.waited || upstream_conn::peek_before_reuse(&b.stats))
            {
                if upstream_conn::peer_closed(fd, peer.is_tls()) {
                    upstream_conn::closes_pooled(&b.stats);
                    ctx.answer.unsent = true;
                    return Err(upstream_conn::closed_in_pool());
                }
            }
        }
        // Noted while it waits for its first byte, so that an ejection of
        // its backend as hung ends it (`upstream::stall`); the local address
        // is kept with the connection (read once for it, not per request).
        #[cfg(unix)]
        if let (Some(f), Some(local)) = (
            ctx.answer.in_flight.as_mut(),
            digest
                .and_then(|d| d.socket_digest.as_ref())
                .and_then(|s| s.local_addr())
                .and_then(|a| a.as_inet()),
        ) {
            f.hold_socket(fd, *local);
        }
        // The first request of a new session reached its backend: requests of
        // the same session waiting on it may follow now.
        if let Some(route) = ctx.route.as_mut() {
            route.confirm();
        }
        Ok(())
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut RequestCtx,
        e: Box<Error>,
    ) -> Box<Error> {
        peer::connect_failed(&self.gw, ctx, e)
    }

    fn error_while_proxy(
        &self,
        peer: &HttpPeer,
        session: &mut Session,
        e: Box<Error>,
        ctx: &mut RequestCtx,
        client_reused: bool,
    ) -> Box<Error> {
        peer::proxy_error(peer, session, e, ctx, client_reused)
    }

    async fn upstream_request_filter(
        &self,
        session: &mut Session,
        upstream_request: &mut RequestHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        modify::upstream_request(session, upstream_request, ctx)
    }

    async fn response_filter(
        &self,
        session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut RequestCtx,
    ) -> Result<()> {
        modify::response(&self.gw, session, resp, ctx)
    }

    fn response_body_filter(
        &self,
        session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut RequestCtx,
    ) -> Result<Option<std::time::Duration>> {
        let written = session.downstream_session.body_bytes_sent();
        modify::response_body(&self.gw, body, end_of_stream, written, ctx)?;
        Ok(None)
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut RequestCtx,
    ) -> FailToProxy
    where
        RequestCtx: Send + Sync,
    {
        finish::answer_failure(&self.gw, session, e, ctx).await
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut RequestCtx) {
        finish::finish(&self.gw, session, e, ctx).await
    }
}
