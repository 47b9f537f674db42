//! What the gateway follows of a backend's answer ([`Answer`]): the
//! request's place in the backend's load while it is out, its first byte,
//! its usage, the metadata merged into a JSON body, a stored response's id,
//! an upgraded socket's frames.

use super::response::{IdRewriter, JsonAppender, ResponseIdScanner, Usage, UsageScanner};
use super::websocket::WebSocket;
use crate::upstream::InFlight;
use std::time::Instant;

#[derive(Default)]
pub struct Answer {
    /// Counted against its backend while it is out.
    pub(super) in_flight: Option<InFlight>,
    /// Its passive-health outcome is recorded (once).
    pub(super) outcome_settled: bool,
    pub(super) appender: Option<JsonAppender>,
    /// The backend's declared body length and what has arrived of it, so the
    /// metadata is merged into the last chunk rather than sent on its own.
    pub(super) upstream_body_len: Option<usize>,
    pub(super) upstream_body_seen: usize,
    pub(super) usage: Option<UsageScanner>,
    pub(super) first_byte: Option<Instant>,
    /// The answer is a server-sent-event stream: its first byte came when
    /// its prefill was done. A JSON answer's first byte comes after its
    /// whole decode.
    pub(super) streamed: bool,
    /// The answer's start, read for its response id.
    pub(super) response_id: Option<ResponseIdScanner>,
    /// The stored responses' ids it names, rewritten to the ones the gateway
    /// issues (`affinity.response_ids: gateway`).
    pub(super) ids: Option<IdRewriter>,
    /// The backend switched protocols: the socket's frames, followed.
    pub(super) websocket: Option<Box<WebSocket>>,
    /// The attempt failed on a pooled connection found closed before the
    /// request was written: nothing of it reached the backend.
    pub(super) unsent: bool,
    /// The attempt's connection failed before any byte of the answer.
    /// Whether it is re-sent, and where, is decided when the retry asks for
    /// a peer ([`super::peer::after_a_lost_answer`]).
    pub(super) lost_answer: Option<LostAnswer>,
    /// A stream that spent its tenant's tokens past zero, to be cut
    /// (`auth.stream_over_limit: cut`).
    pub(super) cut: Cut,
    /// Body bytes handed on to the client so far (through the last
    /// chunk's filter; some may not be written yet).
    pub(super) emitted: usize,
}

/// An attempt whose connection failed before any byte of its answer.
#[derive(Clone, Copy, Debug)]
pub(super) struct LostAnswer {
    /// Its backend.
    pub(super) slot: u32,
    /// The connection was reused from the pool (or the request waited for
    /// its slot: the backend may have died meanwhile).
    pub(super) reused: bool,
    /// Nothing of the request reached the backend (the connection was
    /// found closed before it was written, or reset with it unread).
    pub(super) unsent: bool,
    /// The gateway cut it: its backend was ejected as hung.
    pub(super) hung: bool,
}

/// Where a stream to be cut stands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Cut {
    #[default]
    No,
    /// Its tenant's tokens are spent: the error event goes out at the next
    /// event boundary.
    Due,
    /// The error event went out with the first this many body bytes: the
    /// response ends once they are written (Pingora filters a batch of
    /// chunks before it writes any: an error in the same batch would lose
    /// the event), what comes meanwhile dropped.
    Sent(usize),
}

impl Answer {
    /// What the answer reported using: a socket's turns added up, else the
    /// answer's own `usage`.
    pub(super) fn usage(&self) -> Option<Usage> {
        match &self.websocket {
            Some(ws) => ws.usage,
            None => self.usage.as_ref().and_then(UsageScanner::usage),
        }
    }
}
