//! The wait for a slot: until one is handed over, the request's deadline
//! passes, its client goes (an HTTP/2 stream says so itself when it is
//! reset or its connection goes; an HTTP/1 client's socket is looked at now
//! and then), or its backend can no longer take it (unhealthy, ejected,
//! gone from the configuration: its waiters are placed again elsewhere).

use super::backlog::PrefillRoom;
use super::fleet::{FleetAsk, Handed};
use super::queue::{Admission, Admit, FleetWait, Hold, Permit, Ticket};
use super::reserve::Unreachable;
use super::who::Admittance;
use crate::errors::{GatewayError, Refusal};
use crate::metrics::{Metrics, TierMetrics};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a waiting request looks whether its client or backend went.
pub const LOOK_EVERY: Duration = Duration::from_millis(100);

/// How a wait for a slot ended.
pub enum Waited {
    Admitted(Permit),
    /// Its deadline passed first.
    Deadline,
    ClientGone,
    /// Its backend can no longer take it: place it again.
    BackendGone,
    /// It waited in the fleet's queue, whose store stopped answering: it
    /// waits again in this gateway's own.
    StoreGone,
}

/// What a request's wait for a slot at its backend came to, short of a
/// refusal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Slot {
    /// It holds one (or admission does not count this backend).
    Held,
    /// Its backend went while it waited: it is placed again without it.
    BackendGone,
    /// Another gateway's new conversation took its backend's prefill
    /// between this one's placement read and its ask ([`Admit::Raced`]): it
    /// is placed again without it.
    Raced,
}

impl Waited {
    /// The label of an end that is not a slot (the admission metrics').
    pub fn reason(&self) -> &'static str {
        match self {
            Waited::Admitted(_) => "admitted",
            Waited::Deadline => "deadline",
            Waited::ClientGone => "client_gone",
            Waited::BackendGone => "backend_gone",
            Waited::StoreGone => "store_gone",
        }
    }
}

impl Ticket {
    /// Wait for a slot at most `max_wait`. `closed` ends when the client
    /// has gone (an HTTP/2 stream's close; `None` when there is no such
    /// signal); `client_gone` and `backend_gone` are looked at every
    /// [`LOOK_EVERY`]. Leaving the wait leaves the queue at once (the
    /// ticket's drop passes on a slot handed over meanwhile).
    pub async fn wait_until<F: Future + Unpin>(
        self,
        max_wait: Duration,
        mut closed: Option<F>,
        mut client_gone: impl FnMut() -> bool,
        mut backend_gone: impl FnMut() -> bool,
    ) -> Waited {
        let wait = self.settle();
        tokio::pin!(wait);
        let deadline = tokio::time::sleep(max_wait);
        tokio::pin!(deadline);
        let mut look = tokio::time::interval(LOOK_EVERY);
        loop {
            let closing = futures_util::future::OptionFuture::from(closed.as_mut());
            tokio::select! {
                p = &mut wait => return match p {
                    Some(p) => Waited::Admitted(p),
                    None => Waited::StoreGone,
                },
                _ = &mut deadline => return Waited::Deadline,
                Some(_) = closing => return Waited::ClientGone,
                _ = look.tick() => {
                    if client_gone() {
                        return Waited::ClientGone;
                    }
                    if backend_gone() {
                        return Waited::BackendGone;
                    }
                }
            }
        }
    }
}

impl Admission {
    /// A slot for `ask` from the fleet's queue, when this gateway is one of
    /// a fleet whose store answers; `None`: it is not, or the store did not
    /// answer (the request waits here, in this gateway's queue).
    pub async fn admit_fleet(self: &Arc<Self>, ask: FleetAsk<'_>) -> Option<Admit> {
        let slots = self.fleet_slots()?;
        let (seat, woken) = self.fleet_seat(&ask)?;
        let caps = self.fleet_caps(ask.backend);
        let _op = self.fleet_op();
        match slots.acquire(&seat, caps).await {
            Ok((handed @ (Handed::Slot { .. } | Handed::Probe { .. }), seen)) => {
                self.fleet_forget(seat.id);
                self.fleet_seen(ask.backend, seen);
                let hold = Hold {
                    slots,
                    backend: seat.backend,
                    tenant: seat.tenant,
                };
                let s = (seat.counted, handed);
                Some(Admit::Now(self.fleet_permit(
                    ask.backend,
                    ask.tokens,
                    s,
                    hold,
                )))
            }
            Ok((Handed::Raced { ahead }, seen)) => {
                self.fleet_forget(seat.id);
                self.fleet_seen(ask.backend, seen);
                log::debug!(
                    "backend {}: another gateway's prefill ({} tokens) started there since this new conversation's placement read; placing it again",
                    ask.backend_id,
                    ahead.tokens
                );
                Some(Admit::Raced)
            }
            // (Only a seat asking for a slot it waited for is ever lost.)
            Ok((Handed::None | Handed::Lost, seen)) => {
                self.fleet_seen(ask.backend, seen);
                let mut wait = FleetWait {
                    slots,
                    seat,
                    woken,
                    over: false,
                    taking: false,
                };
                if !self.room_to_queue() {
                    wait.leave(self, ask.backend);
                    return Some(Admit::Full);
                }
                Some(Admit::Wait(self.fleet_ticket(
                    ask.backend,
                    ask.tokens,
                    wait,
                )))
            }
            Err(Unreachable) => {
                // It may have been seated all the same.
                self.fleet_forget(seat.id);
                self.fleet_dirty();
                None
            }
        }
    }
}

/// What a request asks of admission: a slot at one backend of its tier.
pub struct Ask<'a> {
    pub tier: &'a str,
    pub tier_metrics: &'a TierMetrics,
    pub backend: u32,
    pub backend_id: &'a str,
    /// Its prefill there, in tokens (estimated).
    pub tokens: u64,
    pub room: PrefillRoom,
    /// Backends a new conversation's placement read found idle, where it
    /// found no other gateway's prefill at this one ([`FleetAsk::idle_elsewhere`]).
    pub idle_elsewhere: Vec<Arc<str>>,
}

/// How the wait for a slot watches the request's client and backend.
pub struct Watch<F, C, B> {
    /// Ends when the client has gone (an HTTP/2 stream's close).
    pub closed: Option<F>,
    /// Whether the client has gone (an HTTP/1 socket, looked at).
    pub client_gone: C,
    /// Whether the backend can no longer take the request.
    pub backend_gone: B,
}

impl Admittance {
    /// A slot at `ask.backend` for this request: at once, or after waiting
    /// in the gateway's queue, in order of class and fair share; else the
    /// 429 that says when to come back (its deadline passed, or the queue
    /// is full), before any byte of it has gone upstream; or that it is to
    /// be placed again ([`Slot`]). `queued` runs when it starts to wait.
    pub async fn wait_for_slot<F, C, B>(
        &mut self,
        adm: &Arc<Admission>,
        m: &Metrics,
        ask: Ask<'_>,
        queued: impl FnOnce(),
        mut watch: Watch<F, C, B>,
    ) -> Result<Slot, Refusal>
    where
        F: Future + Unpin,
        C: FnMut() -> bool,
        B: FnMut() -> bool,
    {
        let class = self.class.as_str();
        let weight = self.asker().weight;
        let since = Instant::now();
        let (mut fleet, mut queued) = (true, Some(queued));
        let mut seat = self.claim.take();
        let got = loop {
            let ticket = match self.admit(adm, &ask, weight, fleet, seat.take()).await {
                Admit::Now(p) => {
                    ask.tier_metrics.admitted_now[self.class.index()].inc();
                    self.permit = Some(p);
                    return Ok(Slot::Held);
                }
                Admit::Raced => return Ok(Slot::Raced),
                Admit::Full => {
                    m.admission_rejected
                        .with_label_values(&[ask.tier, class, "queue_full"])
                        .inc();
                    return Err(GatewayError::overloaded(
                        "queue_full",
                        format!("tier `{}` is saturated and its queue is full", ask.tier),
                        adm.retry_after_s(ask.backend),
                    )
                    .into());
                }
                Admit::Wait(t) => t,
            };
            if let Some(queued) = queued.take() {
                queued();
            }
            let waiting = m.admission_queued.with_label_values(&[ask.tier, class]);
            waiting.inc();
            let got = ticket
                .wait_until(
                    self.max_wait.saturating_sub(since.elapsed()),
                    watch.closed.as_mut(),
                    &mut watch.client_gone,
                    &mut watch.backend_gone,
                )
                .await;
            waiting.dec();
            match got {
                // Waits again, here: its place in the fleet's queue is lost
                // with the store.
                Waited::StoreGone => fleet = false,
                got => break got,
            }
        };
        self.queue_wait = since.elapsed();
        m.admission_wait
            .with_label_values(&[ask.tier, class])
            .observe(self.queue_wait.as_secs_f64());
        let refused = |why: &str| {
            m.admission_rejected
                .with_label_values(&[ask.tier, class, why])
                .inc();
        };
        match got {
            // Handed a slot freed by a request that failed there: the
            // backend may have been found sick meanwhile.
            Waited::Admitted(_) if (watch.backend_gone)() => Ok(Slot::BackendGone),
            Waited::Admitted(p) => {
                m.admission_admitted
                    .with_label_values(&[ask.tier, class, "queued"])
                    .inc();
                self.waited = true;
                self.permit = Some(p);
                Ok(Slot::Held)
            }
            // Placed again, as a turn arriving now would be.
            Waited::BackendGone | Waited::StoreGone => Ok(Slot::BackendGone),
            Waited::ClientGone => {
                refused(got.reason());
                Err(Refusal::ClientGone("client left while waiting for a slot"))
            }
            Waited::Deadline => {
                refused(got.reason());
                Err(GatewayError::overloaded(
                    "queue_timeout",
                    format!(
                        "no slot at backend {} within {} ms",
                        ask.backend_id,
                        self.max_wait.as_millis()
                    ),
                    adm.retry_after_s(ask.backend),
                )
                .into())
            }
        }
    }

    /// A slot for `ask` now, or a place to wait for one: in the fleet's
    /// queue (`fleet`, when this gateway is one of a fleet whose store
    /// answers; with `seat`, the seat its placement claimed the backend
    /// with), else in this gateway's.
    async fn admit(
        &self,
        adm: &Arc<Admission>,
        ask: &Ask<'_>,
        weight: u32,
        fleet: bool,
        seat: Option<u64>,
    ) -> Admit {
        let asked = FleetAsk {
            seat,
            backend: ask.backend,
            backend_id: ask.backend_id,
            class: self.class,
            tenant: self.tenant,
            weight,
            tokens: ask.tokens,
            json: ask.room.json,
            idle_elsewhere: &ask.idle_elsewhere,
        };
        let from_fleet = match fleet {
            true => adm.admit_fleet(asked).await,
            false => None,
        };
        match from_fleet {
            Some(a) => a,
            None => adm.admit_within(
                ask.backend,
                self.class,
                self.tenant,
                weight,
                ask.tokens,
                ask.room,
            ),
        }
    }

    /// An answer that does not stream shows no end of its prefill: it
    /// counts as prefilling for twice what that should take (`tokens` at
    /// `us_per_token`); a body not read yet is looked at on its way
    /// ([`Admittance::body_seen`]). Only a cap on prefills (configured or
    /// learned) or `prefill_queue_ms` counts it at all. `asks_stream`:
    /// whether its body asked for a stream, when it was read.
    pub fn clock_prefill(
        &mut self,
        asks_stream: Option<bool>,
        tokens: u64,
        us_per_token: impl FnOnce() -> f64,
    ) {
        let Some(permit) = self.permit.as_mut().filter(|p| p.needs_clock) else {
            return;
        };
        if asks_stream == Some(true) {
            return;
        }
        let ms = (tokens as f64 * us_per_token() * 2.0 / 1000.0) as u64;
        let within = Duration::from_millis(ms.clamp(50, 10_000));
        match asks_stream {
            Some(_) => permit.prefill_within(within),
            None => self.prefill_clock = Some((within, false)),
        }
    }

    /// A piece of a body not read before admission went by (`chunk`);
    /// `end`: the body ended.
    pub fn body_seen(&mut self, chunk: Option<&[u8]>, end: bool) {
        if let (Some((_, streams)), Some(chunk)) = (self.prefill_clock.as_mut(), chunk) {
            *streams |= asks_stream(chunk);
        }
        if end {
            if let (Some((within, false)), Some(p)) =
                (self.prefill_clock.take(), self.permit.as_mut())
            {
                p.prefill_within(within);
            }
        }
    }
}

/// Whether a piece of a request body holds `"stream": true` (a member split
/// between two pieces is missed: the request is then timed as one that does
/// not stream, which only ends its count as prefilling early).
fn asks_stream(chunk: &[u8]) -> bool {
    // Built once: a searcher built per call cost more than the search.
    static STREAM: std::sync::LazyLock<memchr::memmem::Finder<'static>> =
        std::sync::LazyLock::new(|| memchr::memmem::Finder::new(b"\"stream\""));
    STREAM.find_iter(chunk).any(|at| {
        let rest = chunk[at + 8..].trim_ascii_start();
        rest.strip_prefix(b":")
            .is_some_and(|v| v.trim_ascii_start().starts_with(b"true"))
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_body_asks_for_a_stream_by_its_member_only() {
        use super::asks_stream;
        assert!(asks_stream(br#"{"messages":[],"stream" : true}"#));
        assert!(asks_stream(br#"{"stream":true,"messages":[]}"#));
        assert!(!asks_stream(br#"{"stream":false}"#));
        assert!(!asks_stream(
            br#"{"stream_options":{"include_usage":true}}"#
        ));
        assert!(!asks_stream(br#"{"content":"stream"}"#));
        assert!(!asks_stream(br#"{"stream""#));
    }

    use super::super::class::Class;
    use super::super::learn::{Limit, Prefill};
    use super::super::queue::{Admission, Admit};
    use super::*;

    fn queued(a: &std::sync::Arc<Admission>) -> (Permit, Ticket) {
        a.set_limit(0, Limit::Fixed(1), Prefill::None);
        let Admit::Now(p) = a.admit_within(0, Class::Normal, 1, 1, 10, Default::default()) else {
            panic!("the first runs at once")
        };
        (p, another(a))
    }

    /// One more request for the backend `queued` filled: it waits.
    fn another(a: &std::sync::Arc<Admission>) -> Ticket {
        let Admit::Wait(t) = a.admit_within(0, Class::Normal, 1, 1, 10, Default::default()) else {
            panic!("it waits")
        };
        t
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_at_its_deadline_and_leaves_the_queue() {
        let a = Admission::new(10);
        let (_p, t) = queued(&a);
        let none: Option<std::future::Pending<()>> = None;
        let w = t
            .wait_until(Duration::from_secs(5), none, || false, || false)
            .await;
        assert_eq!(w.reason(), "deadline");
        assert_eq!(a.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_wait_ends_when_its_client_or_backend_goes() {
        let a = Admission::new(10);
        let (_p, t) = queued(&a);
        let closed = Some(std::future::ready(()));
        let w = t
            .wait_until(Duration::from_secs(5), closed, || false, || false)
            .await;
        assert_eq!(w.reason(), "client_gone");
        let t = another(&a);
        let none: Option<std::future::Pending<()>> = None;
        let w = t
            .wait_until(Duration::from_secs(5), none, || false, || true)
            .await;
        assert_eq!(w.reason(), "backend_gone");
        assert_eq!(a.queued(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_freed_slot_ends_the_wait() {
        let a = Admission::new(10);
        let (p, t) = queued(&a);
        drop(p);
        let none: Option<std::future::Pending<()>> = None;
        let w = t
            .wait_until(Duration::from_secs(5), none, || false, || false)
            .await;
        assert!(matches!(w, Waited::Admitted(_)));
    }
}
