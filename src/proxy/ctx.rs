//! [`RequestCtx`]: what later hooks need to know about one request, a part
//! per concern, each owned by the module that understands it.

use super::answer::Answer;
use super::record::Record;
use super::request_body::ClientBody;
use crate::admission::Admittance;
use crate::routing::Route;
use crate::upstream::{Backend, Tier};
use std::sync::Arc;

pub struct RequestCtx {
    /// What it is and where it goes (`crate::routing`): set once
    /// `request_filter` has read it.
    pub(super) route: Option<Route>,
    /// Who sent it and its slot (`crate::admission`).
    pub(super) who: Admittance,
    /// The client's side: its connection's limits, its body.
    pub(super) body: ClientBody,
    /// The backend's answer, as the gateway follows it.
    pub(super) answer: Answer,
    /// Its id, span, start and the error answered.
    pub(super) record: Record,
}

impl Default for RequestCtx {
    fn default() -> Self {
        RequestCtx {
            route: None,
            who: Default::default(),
            body: Default::default(),
            answer: Default::default(),
            record: Record::new(),
        }
    }
}

impl RequestCtx {
    pub fn tier(&self) -> Option<&Arc<Tier>> {
        self.route.as_ref().map(|r| r.tier())
    }

    pub fn tier_name(&self) -> Option<&str> {
        self.tier().map(|t| &*t.name)
    }

    /// The backend it was sent to (last), once decided.
    pub fn backend(&self) -> Option<&Arc<Backend>> {
        self.route.as_ref()?.backend()
    }
}
