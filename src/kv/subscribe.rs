//! One subscription per backend with `kv_events`, kept as the configuration
//! changes (a look each second).
//!
//! Each (re)connection starts from nothing: the engine may have restarted,
//! and a restarted engine holds nothing. The view is emptied, the replay
//! socket asked for every batch it still keeps, and the view is exact when
//! those start at the engine's first batch (sequence 0) with no hole. After
//! that every batch's sequence number is checked: a hole is filled from the
//! replay socket, and one it cannot fill leaves the view inexact (routing
//! falls back to the inferred index) until the engine clears its cache or
//! the subscription starts again. A sequence that goes back on a live
//! connection is an engine restarted behind it (a proxy kept the connection):
//! the view is emptied and recovered as at a new connection. A lost
//! connection empties the view and what the inferred index says of the
//! backend, at once: its next turn finds nothing promised there.
//!
//! Nothing an engine sends can take more than `max_message_bytes` at once:
//! the sockets refuse a larger message at its frame header, before anything
//! is allocated, and drop the connection; a replay is applied batch by batch
//! as it comes, never held whole.

use super::view::KvView;
use super::wire::{self, END_OF_REPLAY};
use crate::config::KvEventsConfig;
use bytes::Bytes;
use futures_util::StreamExt;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use zeromq::{Socket, SocketEvent, SocketRecv, SocketSend};

/// How long a connection, or a replay's ask or any one of its batches, may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before connecting again.
const RETRY: Duration = Duration::from_millis(500);
/// Batches one replay may bring (vLLM keeps 10,000); past it, the rest are
/// taken as missing.
const MAX_REPLAYED: usize = 20_000;

/// A backend whose engine's events are to be followed.
pub struct Followed {
    pub slot: u32,
    /// Its id, for the log.
    pub name: Arc<str>,
    pub view: Arc<KvView>,
    pub cfg: KvEventsConfig,
}

/// What the service needs of the gateway.
pub trait EventSources: Send + Sync {
    /// Every configured backend with `kv_events`, now.
    fn followed(&self) -> Vec<Followed>;
    /// Backend `slot`'s engine went: what is inferred of its cache goes too.
    fn engine_lost(&self, slot: u32);
}

/// The background service (see the module doc).
pub struct KvSubscriptions(pub Arc<dyn EventSources>);

#[async_trait::async_trait]
impl pingora_core::services::background::BackgroundService for KvSubscriptions {
    async fn start(&self, mut shutdown: pingora_core::server::ShutdownWatch) {
        type Running = (tokio::task::JoinHandle<()>, Arc<KvView>);
        let mut running: HashMap<(u32, KvEventsConfig), Running> = HashMap::new();
        loop {
            let wanted: HashMap<(u32, KvEventsConfig), Followed> = self
                .0
                .followed()
                .into_iter()
                .map(|f| ((f.slot, f.cfg.clone()), f))
                .collect();
            running.retain(|key, (task, view)| {
                let keep = wanted.contains_key(key) && !task.is_finished();
                if !keep {
                    task.abort();
                    view.clear();
                }
                keep
            });
            for (key, f) in wanted {
                running.entry(key).or_insert_with(|| {
                    let view = Arc::clone(&f.view);
                    (tokio::spawn(follow(Arc::clone(&self.0), f)), view)
                });
            }
            tokio::select! {
                _ = shutdown.changed() => break,
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
        for (task, _) in running.into_values() {
            task.abort();
        }
    }
}

/// A socket whose peer may send messages of at most `max` bytes: a frame
/// header declaring more drops the connection before any of it is
/// allocated (the ZeroMQ crate reserved a declared length in full: one
/// 2^62-byte header aborted the process).
fn capped<S: Socket>(max: usize) -> S {
    let mut options = zeromq::SocketOptions::default();
    options.max_message_size(max);
    S::with_options(options)
}

/// Follow one backend's events for as long as it is configured.
async fn follow(sources: Arc<dyn EventSources>, b: Followed) {
    let (view, cfg) = (&*b.view, &b.cfg);
    loop {
        let mut sub: zeromq::SubSocket = capped(cfg.max_message_bytes);
        let mut monitor = sub.monitor();
        let connected = tokio::time::timeout(TIMEOUT, sub.connect(&cfg.endpoint)).await;
        if !matches!(connected, Ok(Ok(()))) {
            log::debug!(
                "kv events of {}: cannot connect to {}",
                b.name,
                cfg.endpoint
            );
            tokio::time::sleep(RETRY).await;
            continue;
        }
        if sub.subscribe(&cfg.topic).await.is_err() {
            tokio::time::sleep(RETRY).await;
            continue;
        }
        log::info!("kv events of {}: following {}", b.name, cfg.endpoint);
        let mut follower = Follower {
            view,
            name: &b.name,
            replay: cfg.replay.as_deref(),
            max_message_bytes: cfg.max_message_bytes,
            next: 0,
            last_live: None,
            restarted: &|| sources.engine_lost(b.slot),
        };
        view.clear();
        let whole = follower.recover(None).await;
        view.set_exact(whole);
        let why = loop {
            tokio::select! {
                msg = sub.recv() => match msg {
                    Ok(msg) => follower.live(msg.into_vec()).await,
                    // An oversized or malformed frame among them.
                    Err(e) => break e.to_string(),
                },
                ev = monitor.next() => match ev {
                    Some(SocketEvent::Disconnected(_)) | None => break "disconnected".into(),
                    Some(_) => {}
                },
            }
        };
        // The engine went (or its socket did, or it sent what it must
        // not): what it held is gone.
        log::warn!("kv events of {}: connection lost ({why})", b.name);
        view.clear();
        view.note_lost();
        sources.engine_lost(b.slot);
        drop(sub);
        tokio::time::sleep(RETRY).await;
    }
}

struct Follower<'a> {
    view: &'a KvView,
    name: &'a str,
    replay: Option<&'a str>,
    max_message_bytes: usize,
    /// The sequence number of the next batch to apply.
    next: i64,
    /// The last sequence number the live stream brought.
    last_live: Option<i64>,
    /// The engine restarted behind the connection: what is inferred of its
    /// cache goes too.
    restarted: &'a (dyn Fn() + Sync),
}

impl Follower<'_> {
    /// A published message: `[topic, sequence, batch]`.
    async fn live(&mut self, frames: Vec<Bytes>) {
        let [_, seq, payload] = frames.as_slice() else {
            log::debug!("kv events: a message of {} frames", frames.len());
            return;
        };
        let Ok(seq) = wire::sequence(seq) else {
            return;
        };
        if self.last_live.is_some_and(|last| seq <= last) {
            // A publisher's own stream never goes back: this is an engine
            // that started again behind a connection that stayed up (a
            // proxy's). It holds nothing of what it held; start over.
            log::warn!(
                "kv events of {}: sequence went back to {seq}; the engine restarted",
                self.name
            );
            self.view.clear();
            (self.restarted)();
            self.next = 0;
        }
        self.last_live = Some(seq);
        if seq < self.next {
            // Seen already (the replay that started the subscription).
            return;
        }
        if seq == 0 && self.next == 0 {
            // The engine's first batch: nothing came before it.
            self.view.set_exact(true);
        }
        if seq > self.next {
            let whole = self.recover(Some(seq)).await;
            if !whole {
                self.view.set_exact(false);
            }
        }
        self.apply(seq, payload);
    }

    fn apply(&mut self, seq: i64, payload: &[u8]) {
        match wire::decode_batch(payload) {
            Ok(batch) => {
                if self.view.apply(&batch) {
                    // Nothing before it matters: current again.
                    self.view.set_exact(true);
                }
            }
            Err(e) => {
                log::warn!("kv events: batch {seq} not understood ({e})");
                self.view.set_exact(false);
            }
        }
        self.next = seq + 1;
    }

    /// Apply the batches the replay socket keeps from `self.next` on (up to
    /// `until`, exclusive), each as it comes: a replay holds no more memory
    /// than one batch. Returns whether none was missing.
    async fn recover(&mut self, until: Option<i64>) -> bool {
        let Some(endpoint) = self.replay else {
            // Nothing to ask (see `live` for an engine's first batch).
            return false;
        };
        let mut got = Replayed {
            whole: true,
            batches: 0,
        };
        let streamed = self.replay(endpoint, until, &mut got).await;
        if until.is_some() {
            self.view.note_replayed(got.batches);
        }
        if streamed.is_err() {
            log::warn!("kv events: replay from {endpoint} failed");
            return false;
        }
        got.whole && until.is_none_or(|u| self.next == u)
    }

    /// Ask the replay socket for every batch from `self.next` on, and apply
    /// those before `until`.
    async fn replay(
        &mut self,
        endpoint: &str,
        until: Option<i64>,
        got: &mut Replayed,
    ) -> Result<(), ReplayFailed> {
        let mut dealer: zeromq::DealerSocket = capped(self.max_message_bytes);
        let ask = vec![
            Bytes::new(),
            Bytes::copy_from_slice(&self.next.to_be_bytes()),
        ];
        let ask = zeromq::ZmqMessage::try_from(ask).expect("two frames");
        let asked = async {
            dealer.connect(endpoint).await?;
            dealer.send(ask).await
        };
        tokio::time::timeout(TIMEOUT, asked).await??;
        let mut seen = 0;
        loop {
            // However long a replay is, each batch comes within the timeout.
            let frames = tokio::time::timeout(TIMEOUT, dealer.recv())
                .await??
                .into_vec();
            // `["", topic, sequence, batch]` (vLLM 0.32; earlier without the
            // topic); the end is sequence -1.
            let [.., seq, payload] = frames.as_slice() else {
                continue;
            };
            let Ok(seq) = wire::sequence(seq) else {
                continue;
            };
            if seq == END_OF_REPLAY {
                return Ok(());
            }
            seen += 1;
            if seen > MAX_REPLAYED {
                // The rest is taken as missing.
                got.whole = false;
                return Ok(());
            }
            if until.is_some_and(|u| seq >= u) || seq < self.next {
                continue;
            }
            if seq != self.next {
                got.whole = false;
            }
            self.apply(seq, payload);
            got.batches += 1;
        }
    }
}

/// A replay that could not be asked, broke off, or went silent.
#[derive(Debug)]
struct ReplayFailed;

impl From<zeromq::ZmqError> for ReplayFailed {
    fn from(_: zeromq::ZmqError) -> Self {
        ReplayFailed
    }
}

impl From<tokio::time::error::Elapsed> for ReplayFailed {
    fn from(_: tokio::time::error::Elapsed) -> Self {
        ReplayFailed
    }
}

/// What one replay brought.
struct Replayed {
    /// No batch was missing between those it brought.
    whole: bool,
    batches: u64,
}
