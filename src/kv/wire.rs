//! vLLM's KV-cache events on the wire (`--kv-events-config`, ZeroMQ).
//!
//! The publisher sends three frames: the topic, the batch's sequence number
//! (8 bytes, big-endian, signed) and the batch, msgpack-encoded. A batch is
//! `[ts, [event, ...], dp_rank]` (or, as a map, `{ts, events, ...}`). An event
//! comes in one of two forms:
//!
//! - a map with a `type` (vLLM 0.32): `{"type": "BlockStored", "block_hashes":
//!   [...], "parent_block_hash": h, "token_ids": [...], "block_size": 16,
//!   "lora_name": .., "medium": .., "session_id": ..}`;
//! - a positional array tagged first (msgspec's `array_like`, earlier
//!   releases): `["BlockStored", block_hashes, parent_block_hash, token_ids,
//!   block_size, lora_id, medium]`, `["BlockRemoved", block_hashes, medium]`,
//!   `["AllBlocksCleared"]`; trailing fields at their defaults may be left out.
//!
//! Keys this decoder does not know are ignored, and so are events of types it
//! does not know. A block hash is an integer or bytes (a digest); either
//! becomes a `u64` (bytes by hashing them), the same for the same hash.
//!
//! The replay socket (a ROUTER) answers a DEALER's `["", start_seq]` with
//! `["", topic, seq, batch]` for each batch it still holds from `start_seq`
//! on, then `["", "", -1, ""]` (releases before 0.32 leave the topic out):
//! the sequence and the batch are always the last two frames.

use rmpv::Value;

/// Sequence number the replay socket ends its answer with.
pub const END_OF_REPLAY: i64 = -1;

/// The decoder's depth bound (it counts about three steps a level, and a
/// batch is four levels deep; a hostile one is refused, not recursed into).
const MAX_DEPTH: usize = 32;

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Blocks now held, each the child of the one before; the first is the
    /// child of `parent` (`None`: the start of a sequence).
    Stored(Stored),
    /// Blocks no longer held.
    Removed(Vec<u64>),
    /// Nothing held any more.
    Cleared,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub hashes: Vec<u64>,
    pub parent: Option<u64>,
    /// Tokens a block holds.
    pub block_size: u32,
    /// The `X-Session-ID` (or body `session_id`) of the request that stored them.
    pub session: Option<String>,
    /// Where they are held (`"GPU"`, `"CPU"`, ...); `None`: the engine's own memory.
    pub medium: Option<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// The engine's clock (seconds) when it sent the batch.
    pub ts: f64,
    pub events: Vec<Event>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError(pub &'static str);

impl std::fmt::Display for WireError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

/// The sequence number frame of a published or replayed batch.
pub fn sequence(frame: &[u8]) -> Result<i64, WireError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| WireError("a sequence number is 8 bytes"))?;
    Ok(i64::from_be_bytes(bytes))
}

/// Decode one batch (either form of event; see the module doc).
pub fn decode_batch(payload: &[u8]) -> Result<Batch, WireError> {
    let value = rmpv::decode::read_value_with_max_depth(&mut &payload[..], MAX_DEPTH)
        .map_err(|_| WireError("a batch is not msgpack"))?;
    let (ts, events) = match &value {
        Value::Array(a) => (a.first(), a.get(1)),
        Value::Map(m) => (field(m, "ts"), field(m, "events")),
        _ => return Err(WireError("a batch is an array or a map")),
    };
    let ts = ts.and_then(Value::as_f64).unwrap_or(0.0);
    let events = events
        .and_then(Value::as_array)
        .ok_or(WireError("a batch has a list of events"))?;
    Ok(Batch {
        ts,
        events: events.iter().filter_map(decode_event).collect(),
    })
}

fn field<'a>(map: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    map.iter()
        .find(|(k, _)| k.as_str() == Some(key))
        .map(|(_, v)| v)
}

/// `None` for an event of a type this decoder does not know (or malformed).
fn decode_event(v: &Value) -> Option<Event> {
    match v {
        Value::Map(m) => {
            let get = |k| field(m, k);
            match get("type")?.as_str()? {
                "BlockStored" => Some(Event::Stored(Stored {
                    hashes: hashes(get("block_hashes")?)?,
                    parent: get("parent_block_hash").and_then(hash),
                    block_size: get("block_size")?.as_u64()?.try_into().ok()?,
                    session: get("session_id")
                        .and_then(Value::as_str)
                        .map(str::to_string),
                    medium: get("medium").and_then(Value::as_str).map(str::to_string),
                })),
                "BlockRemoved" => Some(Event::Removed(hashes(get("block_hashes")?)?)),
                "AllBlocksCleared" => Some(Event::Cleared),
                _ => None,
            }
        }
        Value::Array(a) => match a.first()?.as_str()? {
            "BlockStored" => Some(Event::Stored(Stored {
                hashes: hashes(a.get(1)?)?,
                parent: a.get(2).and_then(hash),
                block_size: a.get(4)?.as_u64()?.try_into().ok()?,
                session: None,
                medium: a.get(6).and_then(Value::as_str).map(str::to_string),
            })),
            "BlockRemoved" => Some(Event::Removed(hashes(a.get(1)?)?)),
            "AllBlocksCleared" => Some(Event::Cleared),
            _ => None,
        },
        _ => None,
    }
}

fn hashes(v: &Value) -> Option<Vec<u64>> {
    v.as_array()?.iter().map(hash).collect()
}

/// An integer hash as itself (two's complement for a negative one), a digest
/// by hashing its bytes; `None` for nil or anything else.
fn hash(v: &Value) -> Option<u64> {
    match v {
        Value::Integer(i) => i.as_u64().or_else(|| i.as_i64().map(|n| n as u64)),
        Value::Binary(b) => Some(xxhash_rust::xxh3::xxh3_64(b)),
        Value::String(s) => Some(xxhash_rust::xxh3::xxh3_64(s.as_bytes())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(v: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).unwrap();
        out
    }

    fn s(x: &str) -> Value {
        Value::from(x)
    }

    #[test]
    fn positional_events_of_earlier_releases_decode() {
        let batch = Value::Array(vec![
            Value::F64(1.5),
            Value::Array(vec![
                Value::Array(vec![
                    s("BlockStored"),
                    Value::Array(vec![Value::from(11u64), Value::from(-12i64)]),
                    Value::Nil,
                    Value::Array((0..32).map(Value::from).collect()),
                    Value::from(16),
                    Value::Nil,
                    s("GPU"),
                ]),
                Value::Array(vec![s("BlockRemoved"), Value::Array(vec![Value::from(11)])]),
                Value::Array(vec![s("SomethingNew"), Value::from(1)]),
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
            Value::Nil,
        ]);
        let b = decode_batch(&encode(&batch)).unwrap();
        assert_eq!(b.ts, 1.5);
        assert_eq!(
            b.events,
            vec![
                Event::Stored(Stored {
                    hashes: vec![11, (-12i64) as u64],
                    parent: None,
                    block_size: 16,
                    session: None,
                    medium: Some("GPU".into()),
                }),
                Event::Removed(vec![11]),
                Event::Cleared,
            ]
        );
    }

    #[test]
    fn mapped_events_decode_with_digests_and_unknown_keys() {
        let digest = Value::Binary(vec![7u8; 32]);
        let ev = Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), Value::Array(vec![digest.clone()])),
            (s("parent_block_hash"), Value::from(5)),
            (s("token_ids"), Value::Array(vec![])),
            (s("block_size"), Value::from(32)),
            (s("session_id"), s("s-1")),
            (s("a_key_from_the_future"), Value::Boolean(true)),
        ]);
        let batch = Value::Map(vec![
            (s("ts"), Value::F64(2.0)),
            (s("events"), Value::Array(vec![ev])),
        ]);
        let b = decode_batch(&encode(&batch)).unwrap();
        let Event::Stored(st) = &b.events[0] else {
            panic!("{b:?}")
        };
        assert_eq!(st.hashes, vec![xxhash_rust::xxh3::xxh3_64(&[7u8; 32])]);
        assert_eq!(st.parent, Some(5));
        assert_eq!(st.session.as_deref(), Some("s-1"));
    }

    /// Batches real vLLM 0.32 published (two requests, `X-Session-ID`
    /// `sess-a` then `sess-b`, a tiny model with 32-token blocks).
    #[test]
    fn recorded_vllm_0_32_batches_decode() {
        let a = decode_batch(include_bytes!("testdata/vllm-0.32-stored-a.msgpack")).unwrap();
        let [Event::Stored(st)] = a.events.as_slice() else {
            panic!("{a:?}")
        };
        assert_eq!(st.hashes.len(), 19);
        assert_eq!(st.hashes[0], 14869289069422940013);
        assert_eq!(st.hashes[18], 15831408695030203663);
        assert_eq!(st.parent, None);
        assert_eq!(st.block_size, 32);
        assert_eq!(st.session.as_deref(), Some("sess-a"));
        assert_eq!(st.medium.as_deref(), Some("GPU"));
        let b = decode_batch(include_bytes!("testdata/vllm-0.32-stored-b.msgpack")).unwrap();
        let [Event::Stored(st)] = b.events.as_slice() else {
            panic!("{b:?}")
        };
        assert_eq!(st.hashes, vec![3200084562084469452]);
        assert_eq!(st.parent, Some(4738069600170159684));
        assert_eq!(st.session.as_deref(), Some("sess-b"));
    }

    /// A batch in the positional form of releases before 0.32, encoded by
    /// msgspec (as vLLM does) from vLLM 0.10's event classes.
    #[test]
    fn recorded_positional_batch_decodes() {
        let b = decode_batch(include_bytes!("testdata/vllm-0.10-positional.msgpack")).unwrap();
        let stored = |hashes: Vec<u64>, parent| {
            Event::Stored(Stored {
                hashes,
                parent,
                block_size: 16,
                session: None,
                medium: Some("GPU".into()),
            })
        };
        assert_eq!(
            b.events,
            vec![
                stored(vec![101, 102], None),
                stored(vec![103], Some(102)),
                Event::Removed(vec![102]),
                Event::Cleared,
            ]
        );
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode_batch(b"").is_err());
        assert!(decode_batch(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(decode_batch(&encode(&Value::from(3))).is_err());
        // Nested past the depth bound.
        let mut deep = Value::Nil;
        for _ in 0..64 {
            deep = Value::Array(vec![deep]);
        }
        assert!(decode_batch(&encode(&deep)).is_err());
        assert_eq!(sequence(&7i64.to_be_bytes()), Ok(7));
        assert!(sequence(b"short").is_err());
    }
}
