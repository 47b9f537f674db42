//! The wait for a slot: until one is handed over, the request's deadline
//! passes, its client goes (an HTTP/2 stream says so itself when it is
//! reset or its connection goes; an HTTP/1 client's socket is looked at now
//! and then), or its backend can no longer take it (unhealthy, ejected,
//! gone from the configuration: its waiters are placed again elsewhere).

use super::{Permit, Ticket};
use std::future::Future;
use std::time::Duration;

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
}

impl Waited {
    /// The label of an end that is not a slot (the admission metrics').
    pub fn reason(&self) -> &'static str {
        match self {
            Waited::Admitted(_) => "admitted",
            Waited::Deadline => "deadline",
            Waited::ClientGone => "client_gone",
            Waited::BackendGone => "backend_gone",
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
        let wait = self.wait();
        tokio::pin!(wait);
        let deadline = tokio::time::sleep(max_wait);
        tokio::pin!(deadline);
        let mut look = tokio::time::interval(LOOK_EVERY);
        loop {
            let closing = futures_util::future::OptionFuture::from(closed.as_mut());
            tokio::select! {
                p = &mut wait => return Waited::Admitted(p),
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

#[cfg(test)]
mod tests {
    use super::super::{Admission, Admit, Class, Limit, Prefill};
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
