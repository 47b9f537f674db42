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
//! then too: each one's upstream socket is kept (a duplicate descriptor,
//! [`Progress::hold`]) while it waits for its first byte, and the ejection
//! shuts them down ([`Progress::cut_all`]); each such request is sent once
//! to another backend or answered 504 (`outlier.on_hung`), not left to the
//! read timeout (10 minutes by default).
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
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
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
    /// [`Held`] token: duplicates, so that the descriptor stays this
    /// socket's until its request lets go of it, whatever Pingora has done
    /// with its own.
    held: Mutex<Vec<(u64, OwnedFd)>>,
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

    /// Keep a duplicate of `fd`, the upstream socket a request waits on for
    /// its first byte, until [`Self::release`]; `None` when the process is
    /// out of descriptors (that request is then left to the read timeout).
    pub fn hold(&self, fd: RawFd) -> Option<Held> {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        // SAFETY: the caller's socket is open for the length of this call
        // (Pingora passes it to `connected_to_upstream` while it owns it).
        let dup = unsafe { BorrowedFd::borrow_raw(fd) }
            .try_clone_to_owned()
            .ok()?;
        let token = NEXT.fetch_add(1, Ordering::Relaxed);
        self.held.lock().push((token, dup));
        Some(Held(token))
    }

    /// Let go of a held socket (its first byte came, or its request ended).
    /// `false`: an ejection cut it first.
    pub fn release(&self, held: Held) -> bool {
        let mut list = self.held.lock();
        match list.iter().position(|(t, _)| *t == held.0) {
            Some(i) => {
                list.swap_remove(i);
                true
            }
            None => false,
        }
    }

    /// Shut down every held socket (the backend was ejected as hung): each
    /// request waiting there sees its connection closed at once. Returns
    /// how many.
    pub fn cut_all(&self) -> usize {
        let cut = std::mem::take(&mut *self.held.lock());
        for (_, fd) in &cut {
            // SAFETY: `fd` is an open descriptor this list owns.
            unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
        cut.len()
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
        let p = Progress::default();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut waiting = std::net::TcpStream::connect(addr).unwrap();
        let answered = std::net::TcpStream::connect(addr).unwrap();
        let (_peer_a, _) = listener.accept().unwrap();
        let (_peer_b, _) = listener.accept().unwrap();
        let a = p.hold(waiting.as_raw_fd()).unwrap();
        let b = p.hold(answered.as_raw_fd()).unwrap();
        // One got its first byte: let go of, never cut.
        assert!(p.release(b));
        assert_eq!(p.cut_all(), 1);
        // The other's read ends at once (EOF), though its peer is still
        // there and silent.
        let mut buf = [0u8; 1];
        assert_eq!(waiting.read(&mut buf).unwrap(), 0);
        // Its request learns that it was cut, not let go of.
        assert!(!p.release(a));
        assert_eq!(p.cut_all(), 0);
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
