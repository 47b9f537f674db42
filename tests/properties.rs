//! No panic reachable from input (issue 9): property tests, on stable, of
//! every parser a client or an operator feeds — session keys from headers and
//! bodies, the response JSON appender and usage scanner under arbitrary
//! chunkings of arbitrary bytes, and config loading from arbitrary YAML.

use agent_gateway::affinity::session::{self, BodyProbe};
use agent_gateway::config::Config;
use agent_gateway::proxy::response::{JsonAppender, UsageScanner};
use bytes::Bytes;
use proptest::prelude::*;
use serde_json::{json, Value};

const MEMBER: &[u8] = br#""x_agent_serve":{"backend":"b","affinity_hit":true}"#;

/// Cut `bytes` at the given points (taken modulo its length).
fn chunked(bytes: &[u8], cuts: &[usize]) -> Vec<Bytes> {
    let mut at: Vec<usize> = cuts
        .iter()
        .map(|c| if bytes.is_empty() { 0 } else { c % bytes.len() })
        .collect();
    at.push(0);
    at.push(bytes.len());
    at.sort_unstable();
    at.dedup();
    at.windows(2)
        .map(|w| Bytes::copy_from_slice(&bytes[w[0]..w[1]]))
        .collect()
}

fn append(chunks: Vec<Bytes>) -> (Vec<u8>, usize) {
    let mut a = JsonAppender::new(MEMBER.to_vec());
    let mut out = Vec::new();
    for c in chunks {
        out.extend_from_slice(&a.push(c));
    }
    out.extend_from_slice(&a.finish());
    (out, a.extra_len())
}

/// JSON values a little like API responses, nested a few levels.
fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map("[a-z_{}\"\\\\ ]{0,8}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Any bytes, any chunking: never a panic, the promised length exactly,
    /// and the body's own bytes come first, unchanged, except that a JSON
    /// object's closing brace moves after the member.
    #[test]
    fn appender_keeps_its_promise_on_arbitrary_bytes(
        body in prop::collection::vec(any::<u8>(), 0..400),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let (out, extra) = append(chunked(&body, &cuts));
        prop_assert_eq!(out.len(), body.len() + extra);
        let kept = out.iter().zip(&body).take_while(|(a, b)| a == b).count();
        let tail_start = body.iter().rposition(|b| *b == b'}').unwrap_or(body.len());
        prop_assert!(kept >= tail_start.min(body.len()) || kept == body.len());
    }

    /// A JSON object, any chunking: still JSON, every member kept, plus ours.
    #[test]
    fn appender_merges_into_any_object(
        v in prop::collection::btree_map("[a-z]{1,6}", json_value(), 0..6),
        pretty in any::<bool>(),
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let obj = Value::Object(v.into_iter().collect());
        let body = if pretty {
            serde_json::to_vec_pretty(&obj).unwrap()
        } else {
            serde_json::to_vec(&obj).unwrap()
        };
        let (out, _) = append(chunked(&body, &cuts));
        let merged: Value = serde_json::from_slice(&out).expect("still JSON");
        let mut expect = obj.clone();
        expect["x_agent_serve"] = json!({"backend": "b", "affinity_hit": true});
        prop_assert_eq!(merged, expect);
    }

    /// The usage scanner: no panic on any bytes in any chunking, and usage
    /// found whatever the chunking when the body carries it.
    #[test]
    fn usage_scanner_survives_anything_and_finds_usage(
        noise in prop::collection::vec(any::<u8>(), 0..300),
        prompt in 0u64..1_000_000,
        cached in 0u64..1_000_000,
        cuts in prop::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut s = UsageScanner::default();
        for c in chunked(&noise, &cuts) {
            s.push(&c);
        }
        let _ = s.usage();
        let cached = cached.min(prompt);
        let body = serde_json::to_vec(&json!({
            "id": "x", "choices": [{"text": "hi"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": 1,
                      "prompt_tokens_details": {"cached_tokens": cached}}
        }))
        .unwrap();
        let mut s = UsageScanner::default();
        for c in chunked(&body, &cuts) {
            s.push(&c);
        }
        let u = s.usage().expect("usage read");
        prop_assert_eq!((u.prompt_tokens, u.cached_tokens), (prompt, Some(cached)));
    }

    /// Session keys from headers: any bytes a client can put in a header
    /// value are accepted or refused, never a panic; what is accepted is
    /// short and free of control characters.
    #[test]
    fn session_headers_are_validated_not_trusted(
        values in prop::collection::vec(
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..300),
                // Mostly acceptable bytes, so that every outcome is reached.
                prop::collection::vec(prop::sample::select(b"ab  \t\x7f\xc3\xa9".to_vec()), 0..30),
                "[a-zé ]{0,300}".prop_map(String::into_bytes),
            ],
            0..4,
        ),
    ) {
        let names = vec![
            http::HeaderName::from_static("x-session-id"),
            http::HeaderName::from_static("x-other-id"),
        ];
        let mut headers = http::HeaderMap::new();
        let mut sent: Vec<(usize, Vec<u8>)> = Vec::new();
        for (i, v) in values.iter().enumerate() {
            if let Ok(hv) = http::HeaderValue::from_bytes(v) {
                headers.append(if i % 2 == 0 { "x-session-id" } else { "x-other-id" }, hv);
                sent.push((i % 2, v.clone()));
            }
        }
        // What SPEC §8 says of them, worked out apart from the gateway: each
        // name's values checked in precedence order; the first acceptable
        // non-blank value is the key.
        let mut expect: Result<Option<String>, ()> = Ok(None);
        for name in 0..2 {
            let of_name: Vec<&Vec<u8>> = sent.iter().filter(|(n, _)| *n == name).map(|(_, v)| v).collect();
            let Some(first) = of_name.first() else { continue };
            let bad = first.len() > 256
                || first.iter().any(|&b| b < 0x20 || b == 0x7f)
                || std::str::from_utf8(first).is_err()
                || of_name.iter().any(|v| v != first);
            if bad {
                expect = Err(());
                break;
            }
            let value = std::str::from_utf8(first).unwrap().trim();
            if !value.is_empty() && expect == Ok(None) {
                expect = Ok(Some(value.to_string()));
            }
        }
        let got = session::from_headers(&session::RequestHeaders::new(&headers), &names)
            .map(|id| id.map(|id| id.id))
            .map_err(|_| ());
        prop_assert_eq!(got, expect);
    }

    /// Session keys and model from bodies: any bytes, never a panic.
    #[test]
    fn body_probe_survives_any_bytes(body in prop::collection::vec(any::<u8>(), 0..600)) {
        let fields = vec![
            vec!["prompt_cache_key".to_string()],
            vec!["metadata".to_string(), "user_id".to_string()],
        ];
        if let Some(p) = BodyProbe::parse(&body) {
            let _ = p.model();
            let _ = p.is_stream();
            if let Some(id) = p.session(&fields) {
                prop_assert!(id.id.len() <= 256);
            }
        }
    }

    /// Body probes of JSON-shaped bodies with odd session values.
    #[test]
    fn body_probe_on_json_with_any_values(v in json_value(), meta in json_value()) {
        let body = serde_json::to_vec(&json!({
            "model": v.clone(), "prompt_cache_key": v, "metadata": {"user_id": meta}
        }))
        .unwrap();
        let fields = vec![
            vec!["prompt_cache_key".to_string()],
            vec!["metadata".to_string(), "user_id".to_string()],
        ];
        if let Some(p) = BodyProbe::parse(&body) {
            let _ = p.model();
            let _ = p.session(&fields);
        }
    }

    /// Config loading: arbitrary text, never a panic.
    #[test]
    fn config_from_arbitrary_text(text in ".{0,400}") {
        let _ = Config::from_yaml(&text);
    }

    /// Config loading: YAML-ish text built from config words and structure.
    #[test]
    fn config_from_yaml_like_text(
        lines in prop::collection::vec(
            (0usize..6, prop::sample::select(vec![
                "server:", "tiers:", "default:", "backends:", "- { id: a, addr: \"127.0.0.1:1\" }",
                "listen: [\"127.0.0.1:0\"]", "affinity:", "sticky_ttl_seconds: -1",
                "hash_key: x", "[[[", "}}", "models: [a, b]", "weight: 99999999999999999999",
                "outlier:", "consecutive_failures: 0", "health:", "interval_ms: 1", "&a", "*a",
                "!!binary aGk=", "? complex", "admin:", "listen: 0.0.0.0:1",
            ])),
            0..24,
        ),
    ) {
        let text: String = lines
            .iter()
            .map(|(indent, word)| format!("{}{}\n", "  ".repeat(*indent), word))
            .collect();
        let _ = Config::from_yaml(&text);
    }
}

#[test]
fn deeply_nested_config_is_refused_before_parsing() {
    for text in [
        format!("server: {}{}", "[".repeat(100_000), "]".repeat(100_000)),
        format!("server: {}1{}", "{a: ".repeat(50_000), "}".repeat(50_000)),
        (0..600)
            .map(|i| format!("{}k{i}:\n", " ".repeat(i)))
            .collect::<String>(),
    ] {
        let e = Config::from_yaml(&text).expect_err("refused");
        let msg = e.to_string();
        assert!(
            msg.contains("nested") || msg.contains("deeper"),
            "{}",
            &msg[..msg.len().min(200)]
        );
    }
}
