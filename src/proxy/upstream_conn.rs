//! Reusing upstream connections without turning an engine's close into a 502.
//!
//! Inference engines close keep-alive connections on their own schedule.
//! llama.cpp's server (cpp-httplib) shuts a connection down right after every
//! streamed response while its headers still say `Keep-Alive: timeout=5,
//! max=100`; uvicorn (vLLM, SGLang) closes one idle for 5 s. Pingora pools the
//! connection when the response ends; the engine's FIN arrives a moment later.
//! A request that takes the connection from the pool in between is written
//! into a closed socket and reads EOF before any response byte: "Upstream
//! ConnectionClosed while reading response headers, bytes already read: 0".
//! Under load that was 16% of requests (issue 12), none of which had reached
//! the engine.
//!
//! Four defences, cheapest first:
//! - idle connections are dropped after `server.upstream_idle_timeout_ms`
//!   (default 4 s), before the engines' 5 s;
//! - a reused connection whose FIN (or RST) has already arrived is caught
//!   before the request is written ([`peer_closed`], one non-blocking peek),
//!   for a backend that has closed one before, or is still on probation
//!   ([`peek_before_reuse`]: its first reuses): a backend that keeps its
//!   connections open is not charged a system call per request;
//! - a request that still fails on a reused connection before any response
//!   byte is re-sent once on a fresh connection to the same backend (or to
//!   another, where that backend is gone), its body replayed from what the
//!   gateway kept ([`should_replay`]); counted in
//!   `agentserve_upstream_retries_total`;
//! - a backend that did that is sent `Connection: close` for a while
//!   ([`FRESH_CONNECTIONS_FOR`]), so its connections are not pooled at all:
//!   a connect on a local network costs far less than a replayed request.

use crate::upstream::BackendStats;
use pingora_core::{Error, ErrorSource, ErrorType, RetryType};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long a backend that closed a reused connection under a request gets
/// unpooled connections before reuse is tried again.
pub const FRESH_CONNECTIONS_FOR: Duration = Duration::from_secs(60);

/// The backend closed a reused connection under a request: stop pooling its
/// connections for [`FRESH_CONNECTIONS_FOR`].
pub fn stop_reusing(stats: &BackendStats) {
    closes_pooled(stats);
    let until = crate::clock::now_ms() + FRESH_CONNECTIONS_FOR.as_millis() as u64;
    if stats
        .fresh_connections_until_ms
        .swap(until, Ordering::Relaxed)
        < crate::clock::now_ms()
    {
        log::info!(
            "backend {} closes connections it advertised as keep-alive; not pooling its connections for {}s",
            stats.id,
            FRESH_CONNECTIONS_FOR.as_secs()
        );
    }
}

/// Whether requests to this backend should ask for a fresh, unpooled connection.
pub fn avoid_reuse(stats: &BackendStats) -> bool {
    let until = stats.fresh_connections_until_ms.load(Ordering::Relaxed);
    until != 0 && crate::clock::now_ms() < until
}

pub use crate::upstream::REUSES_ON_PROBATION;

/// Whether a reused connection to this backend should be peeked at before
/// the request is written: always once it has closed one, else during its
/// first [`REUSES_ON_PROBATION`] reuses. A backend that starts closing later
/// is caught by the replay below, which puts it back to peeking.
pub fn peek_before_reuse(stats: &BackendStats) -> bool {
    stats.closes_pooled.load(Ordering::Relaxed)
        || stats
            .reuse_probation
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
            .is_ok()
}

/// A backend closed a pooled connection: peek before every reuse from now on.
pub fn closes_pooled(stats: &BackendStats) {
    stats.closes_pooled.store(true, Ordering::Relaxed);
}

/// Whether the peer of an idle pooled connection has already closed it (or
/// sent bytes nobody asked for, which would be misread as the response).
/// `tls`: encrypted bytes may be a legitimate record, so only EOF and errors count.
#[cfg(unix)]
pub fn peer_closed(fd: std::os::unix::io::RawFd, tls: bool) -> bool {
    let mut byte = 0u8;
    // SAFETY: `fd` is the live socket Pingora just handed to the hook; a
    // one-byte MSG_PEEK into a local buffer neither consumes data nor blocks.
    let n = unsafe {
        libc::recv(
            fd,
            (&mut byte as *mut u8).cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match n {
        0 => true,
        n if n > 0 => !tls,
        _ => {
            let err = std::io::Error::last_os_error();
            !matches!(
                err.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            )
        }
    }
}

/// The error `connected_to_upstream` returns for a dead pooled connection: the
/// same kind Pingora reports when it reads EOF there, and retried the same way.
pub fn closed_in_pool() -> Box<Error> {
    let mut e = Error::explain(
        ErrorType::ConnectionClosed,
        "pooled upstream connection already closed by the backend",
    );
    e.retry = RetryType::ReusedOnly;
    e.into_up()
}

/// Whether a failed attempt may be re-sent: the failure is the backend's and
/// came before any response byte (Pingora marks exactly those `ReusedOnly`,
/// on a reused connection or a fresh one; a failed request write is the same
/// case), the request was not already re-sent once, and its whole body can
/// be replayed. Where it goes, if anywhere, is decided as the retry is
/// placed (`proxy::peer::after_a_lost_answer`: its backend gone, the
/// connection reused, nothing of it sent).
pub fn should_replay(e: &Error, already_replayed: bool, body_replayable: bool) -> bool {
    let before_response =
        matches!(e.retry, RetryType::ReusedOnly) || matches!(e.etype(), ErrorType::WriteError);
    !already_replayed && body_replayable && before_response && *e.esource() == ErrorSource::Upstream
}

/// The backend's kernel reset the connection before any answer (or the
/// request's write found it reset): the request sat unread in its socket
/// and nothing of it ran. A process that read a request and then died
/// closes with a FIN (EOF here); one killed with the request still unread,
/// or a socket already closed when the request arrived, answers with a
/// reset. Such a request may be placed afresh, on another backend too.
pub fn reset_unread(e: &Error) -> bool {
    matches!(
        e.etype(),
        ErrorType::ReadError | ErrorType::WriteError | ErrorType::ConnectionClosed
    ) && e
        .root_cause()
        .downcast_ref::<std::io::Error>()
        .is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            )
        })
}

/// A pool key no pooled connection has: the replay connects afresh.
pub fn fresh_group_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::io::AsRawFd;

    fn upstream(kind: ErrorType, retry: RetryType) -> Box<Error> {
        let mut e = Error::new(kind);
        e.retry = retry;
        e.into_up()
    }

    #[test]
    fn replays_only_what_failed_before_the_response_once() {
        let closed = upstream(ErrorType::ConnectionClosed, RetryType::ReusedOnly);
        assert!(should_replay(&closed, false, true));
        assert!(!should_replay(&closed, true, true), "only once");
        assert!(!should_replay(&closed, false, false), "body not kept");
        let write = upstream(ErrorType::WriteError, false.into());
        assert!(should_replay(&write, false, true));
        // A response that broke off mid-body is never re-sent.
        let mid_body = upstream(ErrorType::ReadError, false.into());
        assert!(!should_replay(&mid_body, false, true));
        let timeout = upstream(ErrorType::ReadTimedout, false.into());
        assert!(!should_replay(&timeout, false, true));
        let mut downstream = Error::new(ErrorType::ConnectionClosed);
        downstream.retry = RetryType::ReusedOnly;
        let downstream = downstream.into_down();
        assert!(!should_replay(&downstream, false, true), "client's error");
    }

    #[test]
    fn only_a_reset_before_the_answer_says_the_request_was_never_read() {
        let with = |etype, kind| {
            let mut e = Error::because(etype, "reading", std::io::Error::from(kind));
            e.esource = ErrorSource::Upstream;
            e
        };
        use std::io::ErrorKind::*;
        assert!(reset_unread(&with(ErrorType::ReadError, ConnectionReset)));
        assert!(reset_unread(&with(ErrorType::WriteError, BrokenPipe)));
        // EOF: the backend may have read it, then closed (or died).
        assert!(!reset_unread(&with(
            ErrorType::ConnectionClosed,
            UnexpectedEof
        )));
        assert!(!reset_unread(&upstream(
            ErrorType::ConnectionClosed,
            RetryType::ReusedOnly
        )));
        assert!(!reset_unread(&with(ErrorType::ReadTimedout, TimedOut)));
    }

    #[test]
    fn a_backend_is_peeked_at_on_probation_and_for_good_once_it_closed_one() {
        let stats = crate::upstream::BackendStats::new("b");
        let peeks = (0..REUSES_ON_PROBATION + 500)
            .filter(|_| peek_before_reuse(&stats))
            .count();
        assert_eq!(peeks, REUSES_ON_PROBATION as usize, "then no more");
        closes_pooled(&stats);
        assert!((0..10).all(|_| peek_before_reuse(&stats)));
        // A replay (a close the peek did not see) does the same.
        let replayed = crate::upstream::BackendStats::new("c");
        replayed.reuse_probation.store(0, Ordering::Relaxed);
        assert!(!peek_before_reuse(&replayed));
        stop_reusing(&replayed);
        assert!(peek_before_reuse(&replayed));
    }

    #[test]
    fn peek_sees_a_closed_peer_and_leaves_a_live_one_alone() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        assert!(!peer_closed(client.as_raw_fd(), false), "idle and open");
        server.write_all(b"x").unwrap();
        let mut b = [0u8; 1];
        assert_eq!(client.peek(&mut b).unwrap(), 1);
        // Unsolicited bytes: dead for plain HTTP, possibly a record for TLS.
        assert!(peer_closed(client.as_raw_fd(), false));
        assert!(!peer_closed(client.as_raw_fd(), true));
        (&client).read_exact(&mut b).unwrap();
        drop(server);
        // The FIN arrives asynchronously on loopback; it is there once a read sees it.
        assert_eq!(client.peek(&mut b).unwrap(), 0);
        assert!(peer_closed(client.as_raw_fd(), false));
        assert!(peer_closed(client.as_raw_fd(), true));
    }
}
