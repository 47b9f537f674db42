//! The simulated replica's KV-cache events, published as vLLM 0.32 does
//! (`--kv-events-config`): a ZeroMQ PUB socket sends `[topic, sequence (8
//! bytes, big-endian), batch]`, the batch msgpack `[ts, [event...], 0]` with
//! each event a map (`type` `BlockStored` with `block_hashes`,
//! `parent_block_hash`, `token_ids`, `block_size`, `medium`, `session_id`;
//! `BlockRemoved`; `AllBlocksCleared`); a ROUTER replay socket answers
//! `["", start]` with `["", topic, seq, batch]` for each batch it keeps from
//! `start` on, then `["", "", -1, ""]`.

use bytes::Bytes;
use parking_lot::Mutex;
use rmpv::Value;
use std::collections::VecDeque;
use std::sync::Arc;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend};

/// Batches the replay socket keeps (vLLM's default `buffer_steps`).
const KEEP: usize = 10_000;
pub const TOPIC: &str = "kv";

/// One change to the cache, as the cache reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheEvent {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
    },
    Removed(Vec<u64>),
    Cleared,
}

/// What publishing needs: a queue to the publisher task, and the batches
/// kept for replay.
pub struct Publisher {
    tx: mpsc::UnboundedSender<(Vec<CacheEvent>, Option<String>, bool)>,
    pub events_endpoint: String,
    pub replay_endpoint: String,
}

impl Publisher {
    /// Bind the PUB socket at `events` and the replay socket at `replay`
    /// (`host:port`, port 0: any free one).
    pub async fn bind(events: &str, replay: &str, block_size: usize) -> std::io::Result<Publisher> {
        let io = |e: zeromq::ZmqError| std::io::Error::other(e.to_string());
        let mut publisher = zeromq::PubSocket::new();
        let events_endpoint = publisher
            .bind(&format!("tcp://{events}"))
            .await
            .map_err(io)?;
        let mut router = zeromq::RouterSocket::new();
        let replay_endpoint = router.bind(&format!("tcp://{replay}")).await.map_err(io)?;
        let kept: Arc<Mutex<VecDeque<(i64, Bytes)>>> = Arc::default();
        let (tx, mut rx) = mpsc::unbounded_channel::<(Vec<CacheEvent>, Option<String>, bool)>();
        let keep = Arc::clone(&kept);
        tokio::spawn(async move {
            let mut seq = 0i64;
            while let Some((events, session, drop_live)) = rx.recv().await {
                let payload = Bytes::from(encode(&events, session.as_deref(), block_size));
                {
                    let mut k = keep.lock();
                    k.push_back((seq, payload.clone()));
                    if k.len() > KEEP {
                        k.pop_front();
                    }
                }
                if !drop_live {
                    let frames = vec![
                        Bytes::from_static(TOPIC.as_bytes()),
                        Bytes::copy_from_slice(&seq.to_be_bytes()),
                        payload,
                    ];
                    let msg = zeromq::ZmqMessage::try_from(frames).expect("three frames");
                    let _ = publisher.send(msg).await;
                }
                seq += 1;
            }
        });
        tokio::spawn(async move {
            while let Ok(msg) = router.recv().await {
                let frames = msg.into_vec();
                let [id, _, start] = frames.as_slice() else {
                    continue;
                };
                let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(i64::from_be_bytes) else {
                    continue;
                };
                let batches: Vec<(i64, Bytes)> = kept
                    .lock()
                    .iter()
                    .filter(|(s, _)| *s >= start)
                    .cloned()
                    .collect();
                for (s, payload) in batches {
                    let frames = vec![
                        id.clone(),
                        Bytes::new(),
                        Bytes::from_static(TOPIC.as_bytes()),
                        Bytes::copy_from_slice(&s.to_be_bytes()),
                        payload,
                    ];
                    let _ = router
                        .send(zeromq::ZmqMessage::try_from(frames).expect("frames"))
                        .await;
                }
                let end = vec![
                    id.clone(),
                    Bytes::new(),
                    Bytes::new(),
                    Bytes::copy_from_slice(&(-1i64).to_be_bytes()),
                    Bytes::new(),
                ];
                let _ = router
                    .send(zeromq::ZmqMessage::try_from(end).expect("frames"))
                    .await;
            }
        });
        Ok(Publisher {
            tx,
            events_endpoint: events_endpoint.to_string(),
            replay_endpoint: replay_endpoint.to_string(),
        })
    }

    /// Publish one batch (`drop_live`: keep it for replay only, as a PUB
    /// socket past its high-water mark drops it).
    pub fn publish(&self, events: Vec<CacheEvent>, session: Option<String>, drop_live: bool) {
        if !events.is_empty() {
            let _ = self.tx.send((events, session, drop_live));
        }
    }
}

fn encode(events: &[CacheEvent], session: Option<&str>, block_size: usize) -> Vec<u8> {
    let s = |x: &str| Value::from(x);
    let hashes = |h: &[u64]| Value::Array(h.iter().map(|&x| Value::from(x)).collect());
    let events = events
        .iter()
        .map(|e| match e {
            CacheEvent::Stored { hashes: h, parent } => Value::Map(vec![
                (s("type"), s("BlockStored")),
                (s("block_hashes"), hashes(h)),
                (
                    s("parent_block_hash"),
                    parent.map_or(Value::Nil, Value::from),
                ),
                (s("token_ids"), Value::Array(vec![])),
                (s("block_size"), Value::from(block_size as u64)),
                (s("lora_id"), Value::Nil),
                (s("medium"), s("GPU")),
                (s("lora_name"), Value::Nil),
                (s("session_id"), session.map_or(Value::Nil, s)),
            ]),
            CacheEvent::Removed(h) => Value::Map(vec![
                (s("type"), s("BlockRemoved")),
                (s("block_hashes"), hashes(h)),
                (s("medium"), s("GPU")),
            ]),
            CacheEvent::Cleared => Value::Map(vec![(s("type"), s("AllBlocksCleared"))]),
        })
        .collect();
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let batch = Value::Array(vec![Value::F64(ts), Value::Array(events), Value::from(0)]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("writing to a Vec");
    out
}
