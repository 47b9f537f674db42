//! Single-flight: the first request of a session places it, and the
//! session's other requests wait until that placement is real — the first
//! request reached its backend ([`crate::affinity::Lease::confirm`]) — or
//! given up (its lease dropped unconfirmed), then follow it or choose
//! afresh. The binding's pending state lives in the table; the waiting and
//! the waking live here.

use super::route::{Choice, Selection};
use super::table::BindingKey;
use std::time::Duration;
use tokio::sync::Notify;

const WAITER_SHARDS: usize = 64;

/// Why a wait for a placement ([`wait_for`]) returned without a selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitEnd {
    /// `candidates` was empty.
    NoCandidate,
    /// The client closed its connection while the request waited.
    ClientGone,
}

/// Where requests wait for a session's pending placement: a few shards of
/// wake-ups, keyed by the session.
pub struct Waiters {
    shards: Box<[Notify]>,
}

impl Default for Waiters {
    fn default() -> Self {
        Waiters {
            shards: (0..WAITER_SHARDS).map(|_| Notify::new()).collect(),
        }
    }
}

impl Waiters {
    /// Notified when a pending binding of `key` (or one sharing its shard)
    /// is confirmed or abandoned.
    pub fn of(&self, key: BindingKey) -> &Notify {
        &self.shards[(key as usize) % WAITER_SHARDS]
    }

    pub fn wake(&self, key: BindingKey) {
        self.of(key).notify_waiters();
    }
}

/// `select(join)`, waiting (at most `wait`) while another request of session
/// `key` is placing it: single-flight. Nearly every request is decided at
/// once; only one that has to wait registers as a waiter and reads the
/// clock. Out of patience, it follows the pending placement (`join`).
/// `client_gone` is polled while waiting; when it says the client left, the
/// wait ends with [`WaitEnd::ClientGone`].
pub async fn wait_for(
    waiters: &Waiters,
    key: BindingKey,
    owner: bool,
    wait: Duration,
    client_gone: impl Fn() -> bool,
    mut select: impl FnMut(bool) -> Option<Choice>,
) -> Result<Selection, WaitEnd> {
    let mut join = owner;
    match select(join) {
        Some(Choice::Go(sel)) => return Ok(sel),
        Some(Choice::Wait) => {}
        None => return Err(WaitEnd::NoCandidate),
    }
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let notified = waiters.of(key).notified();
        tokio::pin!(notified);
        // Register before asking, so a confirmation in between is not missed.
        notified.as_mut().enable();
        match select(join) {
            Some(Choice::Go(sel)) => return Ok(sel),
            Some(Choice::Wait) => {}
            None => return Err(WaitEnd::NoCandidate),
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            join = true;
            continue;
        }
        let poll = Duration::from_millis(25).min(deadline - now);
        tokio::select! {
            _ = notified => {}
            _ = tokio::time::sleep(poll) => {
                if client_gone() {
                    return Err(WaitEnd::ClientGone);
                }
            }
        }
    }
}
