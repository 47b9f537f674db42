//! One backend's engine as its KV events tell it: what it holds, whether
//! that is current, and a turn's predicted cached tokens.

use super::holdings::Holdings;
use super::session::session_of;
use super::wire;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Blocks whose links one backend's view keeps (held or recently removed);
/// about 40 bytes each.
pub const MAX_LINKS: usize = 1 << 17;
/// Sessions whose latest prompt one backend's view keeps.
pub const MAX_SESSIONS: usize = 1 << 16;

/// One backend's engine, as its events tell it.
pub struct KvView {
    holdings: Mutex<Holdings>,
    /// Its events are current: every batch since its holdings were last
    /// empty has been applied.
    exact: AtomicBool,
    /// Events applied, and batches recovered from the replay socket.
    applied: AtomicU64,
    replayed: AtomicU64,
    /// Connections to its publisher lost (closed, or dropped for a message
    /// over `max_message_bytes` or one not understood).
    lost: AtomicU64,
}

impl std::fmt::Debug for KvView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (exact, blocks, events, replayed) = self.snapshot();
        f.debug_struct("KvView")
            .field("exact", &exact)
            .field("blocks", &blocks)
            .field("events", &events)
            .field("replayed", &replayed)
            .finish()
    }
}

impl Default for KvView {
    fn default() -> Self {
        KvView {
            holdings: Mutex::new(Holdings::new(MAX_LINKS, MAX_SESSIONS)),
            exact: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            replayed: AtomicU64::new(0),
            lost: AtomicU64::new(0),
        }
    }
}

/// What a backend's view says of one session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionHeld {
    /// Nothing known: no current events, or the engine never reported it.
    Unknown,
    /// Tokens of its latest prompt the engine holds from the start.
    Tokens(u64),
}

impl KvView {
    /// Whether its holdings come from its own current events.
    pub fn exact(&self) -> bool {
        self.exact.load(Ordering::Relaxed)
    }

    pub fn set_exact(&self, exact: bool) {
        self.exact.store(exact, Ordering::Relaxed);
    }

    /// What the engine holds of `session` (see [`session_of`]).
    pub fn held(&self, session: u64) -> SessionHeld {
        if !self.exact() {
            return SessionHeld::Unknown;
        }
        match self.holdings.lock().held_tokens(session) {
            Some(t) => SessionHeld::Tokens(t),
            None => SessionHeld::Unknown,
        }
    }

    /// Apply one batch; returns whether it cleared everything (after which
    /// the view is current whatever was missed before).
    pub fn apply(&self, batch: &wire::Batch) -> bool {
        let mut cleared = false;
        let mut h = self.holdings.lock();
        for e in &batch.events {
            match e {
                wire::Event::Stored(s) => {
                    let session = s.session.as_deref().map(|id| session_of(id.as_bytes()));
                    h.stored(&s.hashes, s.parent, s.block_size, session)
                }
                wire::Event::Removed(hashes) => h.removed(hashes),
                wire::Event::Cleared => {
                    h.clear();
                    cleared = true;
                }
            }
        }
        drop(h);
        self.applied
            .fetch_add(batch.events.len() as u64, Ordering::Relaxed);
        cleared
    }

    /// Batches recovered from the replay socket.
    pub fn note_replayed(&self, batches: u64) {
        self.replayed.fetch_add(batches, Ordering::Relaxed);
    }

    /// The connection to its publisher was lost.
    pub fn note_lost(&self) {
        self.lost.fetch_add(1, Ordering::Relaxed);
    }

    /// Connections to its publisher lost so far.
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }

    /// Forget every block held (the engine went or restarted): its sessions
    /// hold nothing there; until its events are current again, nothing is
    /// known.
    pub fn clear(&self) {
        self.holdings.lock().clear();
        self.set_exact(false);
    }

    /// For the admin view and metrics: (exact, blocks held, events applied,
    /// batches replayed).
    pub fn snapshot(&self) -> (bool, usize, u64, u64) {
        (
            self.exact(),
            self.holdings.lock().held_blocks(),
            self.applied.load(Ordering::Relaxed),
            self.replayed.load(Ordering::Relaxed),
        )
    }
}

/// A turn's cached tokens as the gateway predicted them when it routed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prediction {
    /// From the engine's events (else from the inferred prefix index).
    pub exact: bool,
    /// Tokens predicted cached, of `of` (the index's estimate of the
    /// prompt; for events, the engine's own count is read from its answer).
    pub tokens: u64,
    pub of: u64,
}

impl Prediction {
    /// Whether the predicted share of the prompt was within 0.1 of what the
    /// engine reports cached of its `prompt` tokens.
    pub fn right(&self, prompt: u64, cached: u64) -> bool {
        if prompt == 0 {
            return true;
        }
        let reported = cached.min(prompt) as f64 / prompt as f64;
        let of = if self.exact { prompt } else { self.of.max(1) };
        let predicted = self.tokens.min(of) as f64 / of as f64;
        (predicted - reported).abs() <= 0.1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prediction_is_right_within_a_tenth_of_the_prompt() {
        let events = |tokens| Prediction {
            exact: true,
            tokens,
            of: 999,
        };
        // Events count the engine's tokens: compared with its own prompt.
        assert!(events(900).right(1000, 960));
        assert!(!events(900).right(1000, 400));
        assert!(events(5000).right(1000, 1000), "capped at the prompt");
        // The index's tokens are of its own estimate of the prompt.
        let index = Prediction {
            exact: false,
            tokens: 300,
            of: 400,
        };
        assert!(index.right(1000, 750));
        assert!(!index.right(1000, 500));
        assert!(events(0).right(0, 0));
    }

    #[test]
    fn a_view_knows_nothing_until_its_events_are_current() {
        let v = KvView::default();
        let s = session_of(b"s");
        let batch = wire::Batch {
            ts: 0.0,
            events: vec![wire::Event::Stored(wire::Stored {
                hashes: vec![1, 2],
                parent: None,
                block_size: 16,
                session: Some("s".into()),
                medium: None,
            })],
        };
        v.apply(&batch);
        assert_eq!(v.held(s), SessionHeld::Unknown);
        v.set_exact(true);
        assert_eq!(v.held(s), SessionHeld::Tokens(32));
        v.clear();
        assert_eq!(v.held(s), SessionHeld::Unknown, "not current");
        v.set_exact(true);
        assert_eq!(v.held(s), SessionHeld::Tokens(0), "evicted");
    }
}
