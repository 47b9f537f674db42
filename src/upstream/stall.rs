//! A backend that stopped answering while its health endpoint says 200.
//!
//! Its requests get no first byte, and nothing but the read timeout (10
//! minutes by default) would notice: its sessions' turns wait, and its
//! waiters in admission time out, while the rest of the tier idles. So each
//! backend counts the requests sent to it that wait for their first byte,
//! and when it last made progress: gave a first byte, or began to be waited
//! on. Once requests have waited there a whole bound with no first byte
//! from it at all, the gateway's sweep ejects it as passive health ejects a
//! backend whose requests fail (`outlier`: the same backoff and panic
//! threshold): its waiters are placed again, its sessions rebind at their
//! next turn (counted broken). The requests it already holds are ended
//! then too: each one's upstream socket is noted while it waits for its
//! first byte ([`Progress::hold`]: its descriptor and its local address,
//! which Pingora keeps with the connection), and the ejection shuts them
//! down ([`Progress::cut_all`]); each such request is sent once to another
//! backend or answered 504 (`outlier.on_hung`), not left to the read
//! timeout (10 minutes by default). Noting costs no system call; a
//! duplicate descriptor per request (two calls) cost 4% of a request's CPU.
//! A descriptor Pingora closed before its request let go of it may name
//! another socket by then: it is shut only while it is still the same
//! connection (its local address and the backend's, checked as it is cut).
//!
//! The bound is `outlier.first_byte_timeout_ms`, or learned: [`FACTOR`]
//! times the slowest first byte it gave lately (a peak that decays with
//! each answer, so a JSON answer that comes whole after a long generation
//! raises it) or times the prefill this gateway has queued there at its
//! learned cost, whichever is longer, and never under [`FLOOR`]; before it
//! has answered anything, [`UNLEARNED`]. The whole backend's silence counts,
//! not one request's wait: a backend that answers others is slow for that
//! request, not hung. A prompt the gateway did not read (a keyed turn in
//! hard mode) is not in the queue, and a JSON answer's first byte comes
//! only after its whole generation: a backend with nothing else in flight
//! that spends longer than the bound on one such request reads as hung
//! (its peak teaches the bound from then on). Where that is the workload,
//! configure the bound.

use parking_lot::Mutex;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The learned bound is this many times what first bytes took lately.
pub const FACTOR: u64 = 4;
/// Never eject for less silence than this.
pub const FLOOR: Duration = Duration::from_secs(5);
/// The bound before a backend has given any first byte.
pub const UNLEARNED: Duration = Duration::from_secs(30);
/// Each answer lowers the remembered peak by 1/DECAY of itself first.
const DECAY: u64 = 16;

/// One backend's progress (lives in its `BackendStats`).
#[derive(Debug, Default)]
pub struct Progress {
    /// Requests sent that have had no first byte yet.
    awaiting: AtomicU64,
    /// Gateway clock (ms) of its last first byte, or of the moment requests
    /// began to wait there (none were waiting before).
    since_ms: AtomicU64,
    /// The slowest time to first byte lately, ms (0: none yet).
    peak_ms: AtomicU64,
    /// The upstream sockets of requests waiting for their first byte, by
    /// [`Held`] token: descriptor and local address.
    held: Mutex<Vec<(u64, RawFd, SocketAddr)>>,
}

/// A request's claim on its socket in [`Progress`]'s `held` list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Held(u64);

impl Progress {
    /// A request was sent: it waits for its first byte.
    pub fn sent(&self, now_ms: u64) {
        if self.awaiting.fetch_add(1, Ordering::Relaxed) == 0 {
            self.since_ms.store(now_ms, Ordering::Relaxed);
        }
    }

    /// A request's first byte came back, `took_ms` after it was sent.
    pub fn answered(&self, now_ms: u64, took_ms: u64) {
        self.leave();
        self.since_ms.fetch_max(now_ms, Ordering::Relaxed);
        let _ = self
            .peak_ms
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |peak| {
                Some(took_ms.max(peak - peak / DECAY))
            });
    }

    /// A request ended with no first byte (an error, a client gone): it no
    /// longer waits, and it showed no progress.
    pub fn abandoned(&self) {
        self.leave();
    }

    fn leave(&self) {
        let _ = self
            .awaiting
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// Note `fd`, the upstream socket (local address `local`) a request
    /// waits on for its first byte, until [`Self::release`].
    pub fn hold(&self, fd: RawFd, local: SocketAddr) -> Held {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let token = NEXT.fetch_add(1, Ordering::Relaxed);
        self.held.lock().push((token, fd, local));
        Held(token)
    }

    /// Let go of a held socket (its first byte came, or its request ended).
    /// `false`: an ejection cut it first.
    pub fn release(&self, held: Held) -> bool {
        let mut list = self.held.lock();
        match list.iter().position(|(t, ..)| *t == held.0) {
            Some(i) => {
                list.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// Shut down every held socket that is still a connection from its
    /// noted local address to `peer` (the backend was ejected as hung):
    /// each request waiting there sees its connection closed at once.
    /// Returns how many.
    pub fn cut_all(&self, peer: SocketAddr) -> usize {
        let held = std::mem::take(&mut *self.held.lock());
        let mut cut = 0;
        for (_, fd, local) in held {
            if socket_addr(fd, false) == Some(local) && socket_addr(fd, true) == Some(peer) {
                // SAFETY: shutdown(2) on a descriptor just seen to be this
                // connection's; it closes nothing.
                unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
                cut += 1;
            }
        }
        cut
    }

    /// Requests waiting for a first byte now.
    pub fn awaiting(&self) -> u64 {
        self.awaiting.load(Ordering::Relaxed)
    }

    /// How long a backend may give no first byte while requests wait:
    /// `configured`, else learned (see the module doc) from its peak and
    /// `queued_ms`, the prefill this gateway has queued there.
    pub fn bound(&self, configured: Option<Duration>, queued_ms: u64) -> Duration {
        if let Some(b) = configured {
            return b;
        }
        match self.peak_ms.load(Ordering::Relaxed) {
            0 => UNLEARNED,
            peak => Duration::from_millis(FACTOR * peak.max(queued_ms)).max(FLOOR),
        }
    }

    /// `Some(ms of silence)` when requests wait and none has had a first
    /// byte for longer than `bound`, counting from `not_before_ms` at the
    /// earliest (when its last ejection ended: back in, it gets a fresh
    /// bound to show progress).
    pub fn stalled(&self, now_ms: u64, bound: Duration, not_before_ms: u64) -> Option<u64> {
        if self.awaiting() == 0 {
            return None;
        }
        let since = self.since_ms.load(Ordering::Relaxed).max(not_before_ms);
        let silent = now_ms.saturating_sub(since);
        (silent > bound.as_millis() as u64).then_some(silent)
    }
}

/// The local (`peer == false`) or remote address of socket `fd`, if it is
/// an open IPv4 or IPv6 socket.
fn socket_addr(fd: RawFd, peer: bool) -> Option<SocketAddr> {
    // SAFETY: a zeroed sockaddr_storage is valid, and the kernel writes at
    // most `len` bytes of it.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let p = &mut ss as *mut libc::sockaddr_storage as *mut libc::sockaddr;
    let rc = match peer {
        true => unsafe { libc::getpeername(fd, p, &mut len) },
        false => unsafe { libc::getsockname(fd, p, &mut len) },
    };
    if rc != 0 {
        return None;
    }
    match ss.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a = unsafe { *(p as *const libc::sockaddr_in) };
            let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a = unsafe { *(p as *const libc::sockaddr_in6) };
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            Some(SocketAddr::from((ip, u16::from_be(a.sin6_port))))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1000;

    #[test]
    fn a_backend_silent_past_its_bound_with_requests_waiting_is_stalled() {
        let p = Progress::default();
        let bound = Duration::from_secs(5);
        // Nothing waits: never stalled, however long it was silent.
        assert_eq!(p.stalled(100 * S, bound, 0), None);
        // A request sent at 100 s, no first byte: stalled only past 105 s.
        p.sent(100 * S);
        assert_eq!(p.stalled(105 * S, bound, 0), None);
        assert_eq!(p.stalled(105 * S + 1, bound, 0), Some(5 * S + 1));
        // Another request answered at 104 s: progress, the clock restarts.
        p.sent(101 * S);
        p.answered(104 * S, 3 * S);
        assert_eq!(p.stalled(108 * S, bound, 0), None);
        assert_eq!(p.stalled(110 * S, bound, 0), Some(6 * S));
        // Back from an ejection that ended at 109 s: a fresh bound.
        assert_eq!(p.stalled(110 * S, bound, 109 * S), None);
        // The last waiter ends without an answer: nothing waits.
        p.abandoned();
        assert_eq!(p.stalled(200 * S, bound, 0), None);
        // Waiting starts again later: counted from then, not from 104 s.
        p.sent(300 * S);
        assert_eq!(p.stalled(304 * S, bound, 0), None);
    }

    #[test]
    fn an_ejection_cuts_the_sockets_of_the_requests_still_waiting() {
        use std::io::Read;
        use std::os::fd::AsRawFd;
        let p = Progress::default();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = listener.local_addr().unwrap();
        let mut waiting = std::net::TcpStream::connect(peer).unwrap();
        let answered = std::net::TcpStream::connect(peer).unwrap();
        let (_peer_a, _) = listener.accept().unwrap();
        let (_peer_b, _) = listener.accept().unwrap();
        let local = |s: &std::net::TcpStream| s.local_addr().unwrap();
        let a = p.hold(waiting.as_raw_fd(), local(&waiting));
        let b = p.hold(answered.as_raw_fd(), local(&answered));
        // One got its first byte: let go of, never cut.
        assert!(p.release(b));
        // A descriptor that is no longer the noted connection (closed, its
        // number taken by another socket) is left alone.
        let other = std::net::TcpStream::connect(peer).unwrap();
        let (_peer_c, _) = listener.accept().unwrap();
        let stale = "127.0.0.1:9".parse().unwrap();
        p.hold(other.as_raw_fd(), stale);
        assert_eq!(p.cut_all(peer), 1);
        // The waiting one's read ends at once (EOF), though its peer is
        // still there and silent.
        let mut buf = [0u8; 1];
        assert_eq!(waiting.read(&mut buf).unwrap(), 0);
        // Its request learns that it was cut, not let go of.
        assert!(!p.release(a));
        assert_eq!(p.cut_all(peer), 0);
        // The other socket still works.
        other.set_nonblocking(true).unwrap();
        let mut other = other;
        assert_eq!(
            other.read(&mut buf).unwrap_err().kind(),
            std::io::ErrorKind::WouldBlock
        );
    }

    #[test]
    fn the_learned_bound_follows_the_slowest_first_bytes_and_the_queue() {
        let p = Progress::default();
        assert_eq!(p.bound(None, 0), UNLEARNED);
        let set = Duration::from_millis(2500);
        assert_eq!(p.bound(Some(set), 0), set);
        // Fast answers: the floor.
        p.sent(0);
        p.answered(0, 200);
        assert_eq!(p.bound(None, 0), FLOOR);
        // A JSON answer that came whole after 3 s: 4 × 3 s.
        p.sent(0);
        p.answered(0, 3 * S);
        assert_eq!(p.bound(None, 0), Duration::from_secs(12));
        // Prefill queued there for 4 s: 4 × 4 s.
        assert_eq!(p.bound(None, 4 * S), Duration::from_secs(16));
        // The peak fades with fast answers, down to the floor.
        for _ in 0..40 {
            p.sent(0);
            p.answered(0, 100);
        }
        assert_eq!(p.bound(None, 0), FLOOR);
        // Counts never go below zero, whatever the order.
        p.abandoned();
        assert_eq!(p.awaiting(), 0);
    }
}
