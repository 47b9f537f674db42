//! Limits on client connections that no Pingora hook can enforce, applied by
//! wrapping each accepted connection before Pingora's HTTP code sees it:
//!
//! - `server.max_connections`: a connection over the limit gets a 503 and is
//!   closed at once;
//! - `server.header_timeout_ms`: a request's headers must arrive in full
//!   within this time of its first byte (for a new connection: of accepting
//!   it) — Pingora's own timer restarts on every byte, so a client dripping a
//!   byte every few seconds would hold the connection forever. Answered 408;
//! - `server.body_min_rate_bytes_per_s`: after `body_rate_grace_ms`, a body
//!   arriving slower than this is cut (the proxy answers 408).
//!
//! The proxy tells the wrapper where a request is ([`ConnState`], reached
//! through `Session::stream()`): headers done (body expected or not), body
//! done, request done. Per-read timeouts (body idle, client write) are
//! Pingora's own, set per request by the proxy.

use crate::clock::now_ms;
use async_trait::async_trait;
use parking_lot::Mutex;
use pingora_core::apps::ServerApp;
use pingora_core::protocols::{
    GetProxyDigest, GetSocketDigest, GetTimingDigest, Peek, Shutdown, Ssl, Stream, UniqueID,
    UniqueIDType, ALPN,
};
use pingora_core::server::ShutdownWatch;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::time::{Instant, Sleep};

/// Which limit cut a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    Header,
    BodyRate,
}

impl Cut {
    pub fn as_str(self) -> &'static str {
        match self {
            Cut::Header => "header",
            Cut::BodyRate => "body_rate",
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Phase {
    /// Between requests on a kept-alive connection (Pingora's keep-alive
    /// timeout applies).
    Idle,
    /// Reading a request's headers: must be done by `deadline_ms`.
    Header { deadline_ms: u64 },
    /// Reading its body.
    Body { since_ms: u64, bytes: u64 },
    /// Body done, the response is on its way.
    Response,
}

/// Where the current request on one connection is; shared by the wrapper
/// and the proxy hooks.
#[derive(Debug)]
pub struct ConnState {
    phase: Mutex<Phase>,
    cut: Mutex<Option<Cut>>,
    header_timeout_ms: u64,
    min_rate: u64,
    grace_ms: u64,
}

impl ConnState {
    /// The request's headers are in; `body` says whether a body follows.
    pub fn headers_done(&self, body: bool) {
        *self.phase.lock() = if body {
            Phase::Body {
                since_ms: now_ms(),
                bytes: 0,
            }
        } else {
            Phase::Response
        };
    }

    /// The gateway starts reading a body it held back (the request waited
    /// for a slot, or for its session's first placement): the body's rate
    /// counts from now, not from when its headers came.
    pub fn body_clock_restart(&self) {
        if let Phase::Body { since_ms, bytes } = &mut *self.phase.lock() {
            *since_ms = now_ms();
            *bytes = 0;
        }
    }

    pub fn body_done(&self) {
        *self.phase.lock() = Phase::Response;
    }

    /// The response is complete: the next byte starts a new request.
    pub fn request_done(&self) {
        *self.phase.lock() = Phase::Idle;
    }

    /// Whether (and why) the wrapper cut this connection.
    pub fn cut(&self) -> Option<Cut> {
        *self.cut.lock()
    }

    /// Bytes just read: start a header clock, or check the body's rate.
    fn on_read(&self, n: usize) -> Result<(), Cut> {
        let mut phase = self.phase.lock();
        match &mut *phase {
            Phase::Idle => {
                *phase = Phase::Header {
                    deadline_ms: now_ms() + self.header_timeout_ms,
                }
            }
            Phase::Body { since_ms, bytes } => {
                *bytes += n as u64;
                if self.min_rate > 0 {
                    let elapsed_ms = now_ms().saturating_sub(*since_ms);
                    if elapsed_ms > self.grace_ms
                        && (*bytes as u128) * 1000 < self.min_rate as u128 * elapsed_ms as u128
                    {
                        return Err(Cut::BodyRate);
                    }
                }
            }
            Phase::Header { .. } | Phase::Response => {}
        }
        Ok(())
    }

    fn header_deadline_ms(&self) -> Option<u64> {
        match *self.phase.lock() {
            Phase::Header { deadline_ms } => Some(deadline_ms),
            _ => None,
        }
    }
}

/// An accepted client connection, wrapped.
#[derive(Debug)]
pub struct GuardedStream {
    inner: Stream,
    pub state: Arc<ConnState>,
    /// The header clock, once a request's headers take more than one read,
    /// and the deadline (`clock::now_ms`) it was set for.
    timer: Option<(Pin<Box<Sleep>>, u64)>,
    /// The 408 still to be written when the header clock ran out.
    farewell: &'static [u8],
    timeouts: prometheus::IntCounterVec,
}

/// A complete `connection: close` JSON error response (SPEC §8 shape).
fn canned(status: &str, extra: &str, kind: &str, code: &str, message: &str) -> Vec<u8> {
    let body =
        serde_json::json!({"error": {"message": message, "type": kind, "code": code}}).to_string();
    format!(
        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

static HEADER_TIMEOUT_RESPONSE: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    canned(
        "408 Request Timeout",
        "",
        "invalid_request_error",
        "request_timeout",
        "request headers did not arrive in time",
    )
});

static BUSY_RESPONSE: std::sync::LazyLock<Vec<u8>> = std::sync::LazyLock::new(|| {
    canned(
        "503 Service Unavailable",
        "retry-after: 1\r\n",
        "service_unavailable",
        "too_many_connections",
        "the gateway has too many open connections",
    )
});

impl GuardedStream {
    /// The wrapper of `session`'s connection, when it has one (HTTP/1 on a
    /// proxy listener).
    pub fn of(stream: Option<&Stream>) -> Option<&Arc<ConnState>> {
        stream?
            .as_any()
            .downcast_ref::<GuardedStream>()
            .map(|g| &g.state)
    }

    fn cut_now(&mut self, cut: Cut) -> std::io::Error {
        // Counted once per connection (later reads, e.g. draining the
        // refused body, meet the same cut).
        if self.state.cut.lock().replace(cut).is_none() {
            self.timeouts.with_label_values(&[cut.as_str()]).inc();
        }
        std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            match cut {
                Cut::Header => "request headers did not arrive in time",
                Cut::BodyRate => "request body arrived below the minimum rate",
            },
        )
    }

    /// Write what is left of the 408 without waiting: a client that does
    /// not read does not get to hold the connection for it.
    fn say_farewell(&mut self, cx: &mut Context<'_>) {
        while !self.farewell.is_empty() {
            match Pin::new(&mut self.inner).poll_write(cx, self.farewell) {
                Poll::Ready(Ok(n)) if n > 0 => self.farewell = &self.farewell[n..],
                _ => return,
            }
        }
        let _ = Pin::new(&mut self.inner).poll_flush(cx);
    }
}

impl AsyncRead for GuardedStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Some(deadline_ms) = this.state.header_deadline_ms() {
            let at =
                || Instant::now() + Duration::from_millis(deadline_ms.saturating_sub(now_ms()));
            let (timer, set_for) = this
                .timer
                .get_or_insert_with(|| (Box::pin(tokio::time::sleep_until(at())), deadline_ms));
            if *set_for != deadline_ms {
                timer.as_mut().reset(at());
                *set_for = deadline_ms;
            }
            if timer.as_mut().poll(cx).is_ready() {
                this.farewell = HEADER_TIMEOUT_RESPONSE.as_slice();
                this.say_farewell(cx);
                return Poll::Ready(Err(this.cut_now(Cut::Header)));
            }
        }
        let before = buf.filled().len();
        let res = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &res {
            let n = buf.filled().len() - before;
            if n > 0 {
                if let Err(cut) = this.state.on_read(n) {
                    return Poll::Ready(Err(this.cut_now(cut)));
                }
            }
        }
        res
    }
}

impl AsyncWrite for GuardedStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[async_trait]
impl Shutdown for GuardedStream {
    async fn shutdown(&mut self) {
        Shutdown::shutdown(&mut *self.inner).await
    }
}

impl UniqueID for GuardedStream {
    fn id(&self) -> UniqueIDType {
        self.inner.id()
    }
}

impl Ssl for GuardedStream {
    fn get_ssl(&self) -> Option<&pingora_core::protocols::tls::TlsRef> {
        self.inner.get_ssl()
    }
    fn get_ssl_digest(&self) -> Option<Arc<pingora_core::protocols::tls::SslDigest>> {
        self.inner.get_ssl_digest()
    }
    fn selected_alpn_proto(&self) -> Option<ALPN> {
        self.inner.selected_alpn_proto()
    }
}

impl GetTimingDigest for GuardedStream {
    fn get_timing_digest(&self) -> Vec<Option<pingora_core::protocols::TimingDigest>> {
        self.inner.get_timing_digest()
    }
    fn get_read_pending_time(&self) -> Duration {
        self.inner.get_read_pending_time()
    }
    fn get_write_pending_time(&self) -> Duration {
        self.inner.get_write_pending_time()
    }
}

impl GetProxyDigest for GuardedStream {
    fn get_proxy_digest(&self) -> Option<Arc<pingora_core::protocols::raw_connect::ProxyDigest>> {
        self.inner.get_proxy_digest()
    }
    fn set_proxy_digest(&mut self, d: pingora_core::protocols::raw_connect::ProxyDigest) {
        self.inner.set_proxy_digest(d)
    }
}

impl GetSocketDigest for GuardedStream {
    fn get_socket_digest(&self) -> Option<Arc<pingora_core::protocols::SocketDigest>> {
        self.inner.get_socket_digest()
    }
    fn set_socket_digest(&mut self, d: pingora_core::protocols::SocketDigest) {
        self.inner.set_socket_digest(d)
    }
}

#[async_trait]
impl Peek for GuardedStream {
    async fn try_peek(&mut self, buf: &mut [u8]) -> std::io::Result<bool> {
        self.inner.try_peek(buf).await
    }
}

/// The proxy application with every connection wrapped and counted.
pub struct GuardedApp<A> {
    inner: Arc<A>,
    gw: Arc<crate::gateway::Gateway>,
    open: AtomicUsize,
}

impl<A> GuardedApp<A> {
    pub fn new(inner: A, gw: Arc<crate::gateway::Gateway>) -> Self {
        GuardedApp {
            inner: Arc::new(inner),
            gw,
            open: AtomicUsize::new(0),
        }
    }
}

struct OpenCount<'a>(&'a AtomicUsize);

impl Drop for OpenCount<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[async_trait]
impl<A: ServerApp + Send + Sync + 'static> ServerApp for GuardedApp<A> {
    async fn process_new(
        self: &Arc<Self>,
        mut stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let limits = self.gw.routing().config.server.client;
        let open = self.open.fetch_add(1, Ordering::Relaxed) + 1;
        let _count = OpenCount(&self.open);
        if limits.max_connections > 0 && open > limits.max_connections {
            self.gw
                .metrics
                .connections_refused
                .with_label_values(&["max_connections"])
                .inc();
            let _ = tokio::time::timeout(Duration::from_secs(1), async {
                stream.write_all(BUSY_RESPONSE.as_slice()).await?;
                stream.flush().await
            })
            .await;
            return None;
        }
        // HTTP/2 multiplexes requests on one connection and has its own
        // timers; the header clock is for HTTP/1.
        let h1 = !matches!(stream.selected_alpn_proto(), Some(ALPN::H2));
        let state = Arc::new(ConnState {
            phase: Mutex::new(if h1 {
                Phase::Header {
                    deadline_ms: now_ms() + limits.header_timeout.as_millis() as u64,
                }
            } else {
                Phase::Response
            }),
            cut: Mutex::new(None),
            header_timeout_ms: limits.header_timeout.as_millis() as u64,
            min_rate: if h1 {
                limits.body_min_rate_bytes_per_s
            } else {
                0
            },
            grace_ms: limits.body_rate_grace.as_millis() as u64,
        });
        let guarded = GuardedStream {
            inner: stream,
            state,
            timer: None,
            farewell: &[],
            timeouts: self.gw.metrics.timeouts.clone(),
        };
        self.inner.process_new(Box::new(guarded), shutdown).await
    }

    async fn cleanup(&self) {
        self.inner.cleanup().await
    }
}
/// The 408 for a client that was too slow (its body stalled, or crawled
/// below `body_min_rate_bytes_per_s`: the connection's own cut, counted
/// there), counted by kind; `None` when `e` is not that.
pub fn client_timeout(
    conn: Option<&ConnState>,
    e: &pingora_core::Error,
    metrics: &crate::metrics::Metrics,
) -> Option<crate::errors::GatewayError> {
    use crate::errors::GatewayError;
    let kind = match conn.and_then(|c| c.cut()) {
        Some(cut) => return Some(GatewayError::request_timeout(cut.as_str())),
        None if e.etype() == &pingora_core::ErrorType::ReadTimedout => "body_idle",
        None => return None,
    };
    metrics.timeouts.with_label_values(&[kind]).inc();
    Some(GatewayError::request_timeout(kind))
}
