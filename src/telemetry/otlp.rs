//! OTLP's protobuf messages, written directly (opentelemetry-proto's
//! `trace/v1/trace.proto`, `common/v1/common.proto`,
//! `collector/trace/v1/trace_service.proto`): a span is encoded once, on the
//! request path, into the bytes of its `Span` message; an export wraps the
//! spans of a batch in one `ExportTraceServiceRequest`.
//!
//! Written by hand because the generic path costs what the gateway cannot
//! spend per request: with opentelemetry-otlp 0.33 a span took 42,000
//! instructions (the SDK's `SpanData`, its conversion to prost messages and
//! prost's encoding, which computes every nested message's length again at
//! each level), a third of a whole proxied request. Here a nested message's
//! length is written once, after its contents.

/// A protobuf message being written.
#[derive(Default)]
pub struct Pb {
    pub buf: Vec<u8>,
}

const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const LEN: u8 = 2;
const FIXED32: u8 = 5;

/// The most bytes a length of a message under 4 GiB takes as a varint.
const LEN_ROOM: usize = 5;

fn varint_into(mut v: u64, out: &mut [u8; 10]) -> usize {
    let mut n = 0;
    while v >= 0x80 {
        out[n] = (v as u8) | 0x80;
        v >>= 7;
        n += 1;
    }
    out[n] = v as u8;
    n + 1
}

/// Bytes `v` takes as a varint.
#[inline]
fn varint_len(v: u64) -> usize {
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

impl Pb {
    pub fn with_capacity(n: usize) -> Pb {
        Pb {
            buf: Vec::with_capacity(n),
        }
    }

    #[inline]
    fn varint(&mut self, v: u64) {
        if v < 0x80 {
            self.buf.push(v as u8);
            return;
        }
        let mut b = [0; 10];
        let n = varint_into(v, &mut b);
        self.buf.extend_from_slice(&b[..n]);
    }

    #[inline]
    fn key(&mut self, field: u32, wire: u8) {
        self.varint((u64::from(field) << 3) | u64::from(wire));
    }

    pub fn bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, LEN);
        self.varint(b.len() as u64);
        self.buf.extend_from_slice(b);
    }

    pub fn string(&mut self, field: u32, s: &str) {
        self.bytes(field, s.as_bytes());
    }

    /// A string field written from parts (no joined copy is made).
    pub fn string_of(&mut self, field: u32, parts: &[&str]) {
        self.key(field, LEN);
        self.varint(parts.iter().map(|p| p.len()).sum::<usize>() as u64);
        for p in parts {
            self.buf.extend_from_slice(p.as_bytes());
        }
    }

    pub fn uint(&mut self, field: u32, v: u64) {
        self.key(field, VARINT);
        self.varint(v);
    }

    pub fn fixed64(&mut self, field: u32, v: u64) {
        self.key(field, FIXED64);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn fixed32(&mut self, field: u32, v: u32) {
        self.key(field, FIXED32);
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// A nested message: its contents are written by `f`, then its length
    /// goes in front of them.
    pub fn message(&mut self, field: u32, f: impl FnOnce(&mut Pb)) {
        self.key(field, LEN);
        let at = self.buf.len();
        self.buf.extend_from_slice(&[0; LEN_ROOM]);
        f(self);
        let len = self.buf.len() - at - LEN_ROOM;
        let mut b = [0; 10];
        let n = varint_into(len as u64, &mut b);
        self.buf[at..at + n].copy_from_slice(&b[..n]);
        self.buf.copy_within(at + LEN_ROOM.., at + n);
        self.buf.truncate(self.buf.len() - (LEN_ROOM - n));
    }

    /// A `KeyValue` (common.proto) in repeated field `field`. Its sizes are
    /// known before it is written (the one message a span has many of).
    pub fn attr(&mut self, field: u32, key: &str, value: Value<'_>) {
        // Each field key here is one byte (fields 1-15).
        let any = match value {
            Value::Str(s) => 1 + varint_len(s.len() as u64) + s.len(),
            Value::Bool(_) => 2,
            Value::Int(i) => 1 + varint_len(i as u64),
            Value::Double(_) => 9,
        };
        let kv = 1 + varint_len(key.len() as u64) + key.len() + 1 + varint_len(any as u64) + any;
        self.key(field, LEN);
        self.varint(kv as u64);
        self.string(1, key);
        self.key(2, LEN);
        self.varint(any as u64);
        match value {
            Value::Str(s) => self.string(1, s),
            Value::Bool(b) => self.uint(2, u64::from(b)),
            Value::Int(i) => self.uint(3, i as u64),
            Value::Double(d) => self.fixed64(4, d.to_bits()),
        }
    }
}

/// An `AnyValue`.
#[derive(Debug, Clone, Copy)]
pub enum Value<'a> {
    Str(&'a str),
    Bool(bool),
    Int(i64),
    Double(f64),
}

/// `Span` fields (trace.proto).
pub mod span {
    pub const TRACE_ID: u32 = 1;
    pub const SPAN_ID: u32 = 2;
    pub const TRACE_STATE: u32 = 3;
    pub const PARENT_SPAN_ID: u32 = 4;
    pub const NAME: u32 = 5;
    pub const KIND: u32 = 6;
    pub const START: u32 = 7;
    pub const END: u32 = 8;
    pub const ATTRIBUTES: u32 = 9;
    pub const STATUS: u32 = 15;
    pub const FLAGS: u32 = 16;
    /// `SpanKind.SPAN_KIND_SERVER`.
    pub const KIND_SERVER: u64 = 2;
    /// `Status.code`: `STATUS_CODE_ERROR`; `Status.message` is field 2.
    pub const STATUS_CODE: u32 = 3;
    pub const STATUS_MESSAGE: u32 = 2;
    pub const STATUS_ERROR: u64 = 2;
    /// `SpanFlags`: the W3C flags in the low byte; whether the parent is
    /// remote is known, and that it is.
    pub const FLAGS_HAS_IS_REMOTE: u32 = 0x100;
    pub const FLAGS_IS_REMOTE: u32 = 0x200;
}

/// One `ExportTraceServiceRequest` holding `spans` (each the bytes of a
/// `Span` message) of one resource (`service.name` and the rest) and one
/// instrumentation scope.
pub fn export_request(
    resource: &[(&str, &str)],
    scope: (&str, &str),
    spans: &[Vec<u8>],
) -> Vec<u8> {
    let size = spans.iter().map(|s| s.len() + 3).sum::<usize>() + 256;
    let mut pb = Pb::with_capacity(size);
    // ExportTraceServiceRequest.resource_spans = 1
    pb.message(1, |rs| {
        // ResourceSpans.resource = 1 { Resource.attributes = 1 }
        rs.message(1, |r| {
            for (k, v) in resource {
                r.attr(1, k, Value::Str(v));
            }
        });
        // ResourceSpans.scope_spans = 2
        rs.message(2, |ss| {
            // ScopeSpans.scope = 1 { name = 1, version = 2 }
            ss.message(1, |sc| {
                sc.string(1, scope.0);
                sc.string(2, scope.1);
            });
            // ScopeSpans.spans = 2
            for s in spans {
                ss.bytes(2, s);
            }
        });
    });
    pb.buf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nested_message_gets_its_length_in_front() {
        let mut pb = Pb::default();
        pb.message(1, |m| m.string(2, "hi"));
        // key 1/LEN, length 4, then key 2/LEN, length 2, "hi".
        assert_eq!(pb.buf, [0x0a, 4, 0x12, 2, b'h', b'i']);
        let long = "x".repeat(300);
        let mut pb = Pb::default();
        pb.message(1, |m| m.string(1, &long));
        // A 303-byte body: a two-byte length (0xaf 0x02).
        assert_eq!(&pb.buf[..3], &[0x0a, 0xaf, 0x02]);
        assert_eq!(pb.buf.len(), 3 + 303);
    }

    #[test]
    fn an_attribute_written_with_its_sizes_known_is_the_nested_messages_bytes() {
        let long = "v".repeat(200);
        for v in [
            Value::Str("qwen3-8b"),
            Value::Str(&long),
            Value::Bool(true),
            Value::Int(0),
            Value::Int(300),
            Value::Int(-1),
            Value::Double(1.5),
        ] {
            let mut direct = Pb::default();
            direct.attr(9, "gen_ai.request.model", v);
            let mut nested = Pb::default();
            nested.message(9, |kv| {
                kv.string(1, "gen_ai.request.model");
                kv.message(2, |any| match v {
                    Value::Str(s) => any.string(1, s),
                    Value::Bool(b) => any.uint(2, u64::from(b)),
                    Value::Int(i) => any.uint(3, i as u64),
                    Value::Double(d) => any.fixed64(4, d.to_bits()),
                });
            });
            assert_eq!(direct.buf, nested.buf, "{v:?}");
        }
        for (v, n) in [
            (0, 1),
            (127, 1),
            (128, 2),
            (16_383, 2),
            (16_384, 3),
            (u64::MAX, 10),
        ] {
            assert_eq!(varint_len(v), n, "{v}");
        }
    }

    #[test]
    fn fields_use_protobufs_wire_types() {
        let mut pb = Pb::default();
        pb.uint(6, 2);
        pb.fixed64(7, 1);
        pb.fixed32(16, 0x301);
        pb.attr(9, "k", Value::Int(-1));
        assert_eq!(&pb.buf[..2], &[0x30, 2]);
        assert_eq!(&pb.buf[2..11], &[0x39, 1, 0, 0, 0, 0, 0, 0, 0]);
        // Field 16 needs a two-byte key.
        assert_eq!(&pb.buf[11..17], &[0x85, 0x01, 0x01, 0x03, 0, 0]);
        // -1 as int64: ten varint bytes.
        assert_eq!(pb.buf.len(), 17 + 2 + 3 + 2 + 1 + 10);
    }
}
