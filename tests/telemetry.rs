//! OpenTelemetry traces end to end: the gateway's spans, exported as
//! OTLP/HTTP protobuf, received and decoded by a real OTLP receiver
//! (`scripts/otlp-receiver.py`, on the `opentelemetry-proto` package), and
//! the `traceparent` the engine gets.

mod common;

use common::*;
use serde_json::{json, Value};
use std::process::{Child, Command};

/// The OTLP receiver, a process on a port of its own.
struct Receiver {
    port: u16,
    child: Child,
}

impl Receiver {
    async fn start() -> Receiver {
        let port = free_port();
        let child = Command::new(agent_gateway_tools::engine::default_python())
            .arg(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/scripts/otlp-receiver.py"
            ))
            .arg(port.to_string())
            .spawn()
            .expect("the engine venv's python (run scripts/setup.sh)");
        let r = Receiver { port, child };
        wait_until("the OTLP receiver to listen", || async {
            reqwest::get(r.url()).await.is_ok_and(|r| r.status() == 200)
        })
        .await;
        r
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/spans", self.port)
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    async fn spans(&self) -> Vec<Value> {
        reqwest::get(self.url())
            .await
            .unwrap()
            .json::<Vec<Value>>()
            .await
            .unwrap()
    }

    /// The spans of trace `trace`, once there are `n` of them.
    async fn trace(&self, trace: &str, n: usize) -> Vec<Value> {
        wait_until(&format!("{n} spans of trace {trace}"), || async {
            self.spans()
                .await
                .iter()
                .filter(|s| s["trace_id"] == trace)
                .count()
                >= n
        })
        .await;
        self.spans()
            .await
            .into_iter()
            .filter(|s| s["trace_id"] == trace)
            .collect()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn telemetry_yaml(endpoint: &str, ratio: f64) -> String {
    format!(
        "{}telemetry:\n  otlp:\n    endpoint: \"{endpoint}\"\n  sample_ratio: {ratio}\n",
        affinity_yaml(1800)
    )
}

/// What the engine that answered `reply` last received as `traceparent`.
async fn upstream_traceparent(sims: &[SimBackend], reply: &Reply) -> String {
    let sim = sims
        .iter()
        .find(|s| Some(&s.id) == reply.backend.as_ref())
        .expect("the answering backend");
    sim.stats().await["last_headers"]["traceparent"]
        .as_str()
        .unwrap_or_else(|| panic!("no traceparent reached {}", sim.id))
        .to_string()
}

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

#[tokio::test]
async fn spans_join_the_callers_trace_with_genai_attributes_and_the_engine_nests_under_them() {
    let receiver = Receiver::start().await;
    let (sims, gw) = fleet(2, &telemetry_yaml(&receiver.endpoint(), 1.0)).await;
    let c = client();
    let traceparent = format!("00-{TRACE}-{CALLER_SPAN}-01");
    let mut replies = Vec::new();
    for turn in 0..2 {
        let r = chat(
            &c,
            &gw,
            &[
                ("traceparent", &traceparent),
                ("tracestate", "vendor=opaque"),
                ("x-session-id", "traced"),
                ("x-request-id", &format!("otel-turn-{turn}")),
            ],
            &chat_body("qwen3-8b", turn),
        )
        .await;
        assert_eq!(r.status, 200);
        replies.push(r);
    }
    let spans = receiver.trace(TRACE, 2).await;
    for (turn, reply) in replies.iter().enumerate() {
        let id = format!("otel-turn-{turn}");
        let span = spans
            .iter()
            .find(|s| s["attributes"]["agent_gateway.request_id"] == id.as_str())
            .unwrap_or_else(|| panic!("a span for {id}: {spans:?}"));
        let a = &span["attributes"];
        assert_eq!(
            span["parent_span_id"], CALLER_SPAN,
            "the caller's span is the parent"
        );
        assert_eq!(span["name"], "chat qwen3-8b");
        assert_eq!(span["kind"], 2, "a server span");
        assert_eq!(span["service"], "agent-gateway");
        assert_eq!(a["gen_ai.operation.name"], "chat");
        assert_eq!(a["gen_ai.request.model"], "qwen3-8b");
        let usage = &reply.json()["usage"];
        assert_eq!(a["gen_ai.usage.input_tokens"], usage["prompt_tokens"]);
        assert_eq!(a["gen_ai.usage.output_tokens"], usage["completion_tokens"]);
        assert_eq!(
            a["gen_ai.usage.cache_read.input_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"]
        );
        let sim = sims
            .iter()
            .find(|s| Some(&s.id) == reply.backend.as_ref())
            .unwrap();
        assert_eq!(a["server.address"], "127.0.0.1");
        assert_eq!(a["server.port"], json!(sim.addr.port()));
        assert_eq!(a["agent_gateway.backend"], sim.id.as_str());
        assert_eq!(a["agent_gateway.tier"], "default");
        assert_eq!(a["agent_gateway.session"], "traced");
        assert_eq!(a["agent_gateway.affinity_hit"], json!(turn == 1));
        assert_eq!(a["http.response.status_code"], 200);
        assert!(a["agent_gateway.queue_wait_ms"].is_number(), "{a}");
        // The engine's traceparent: the same trace, the gateway's span as
        // its parent, the caller's sampling.
        // (The engine keeps the last one: both turns went to it.)
        if turn == 1 {
            let up = upstream_traceparent(&sims, reply).await;
            assert_eq!(
                up,
                format!("00-{TRACE}-{}-01", span["span_id"].as_str().unwrap())
            );
        }
    }
    let warm = spans
        .iter()
        .find(|s| s["attributes"]["agent_gateway.request_id"] == "otel-turn-1")
        .unwrap();
    assert!(
        warm["attributes"]["gen_ai.usage.cache_read.input_tokens"].as_u64() > Some(0),
        "the warm turn's cached tokens: {warm}"
    );
    assert!(
        gw.metric("agentserve_otel_spans_total{result=\"exported\"}")
            .await
            >= 2.0
    );
}

#[tokio::test]
async fn a_caller_that_does_not_sample_gets_no_span_and_a_new_trace_gets_a_root_span() {
    let receiver = Receiver::start().await;
    let (sims, gw) = fleet(1, &telemetry_yaml(&receiver.endpoint(), 1.0)).await;
    let c = client();
    let unsampled = "11111111111111111111111111111111";
    let r = chat(
        &c,
        &gw,
        &[("traceparent", &format!("00-{unsampled}-{CALLER_SPAN}-00"))],
        &chat_body("m", 0),
    )
    .await;
    assert_eq!(r.status, 200);
    let up = upstream_traceparent(&sims, &r).await;
    assert!(up.starts_with(&format!("00-{unsampled}-")), "{up}");
    assert!(up.ends_with("-00"), "the caller's decision goes on: {up}");
    assert_ne!(&up[36..52], CALLER_SPAN, "the gateway's own span id");

    // No traceparent: a trace starts at the gateway (sampled at ratio 1).
    let r = chat(&c, &gw, &[("x-request-id", "root")], &chat_body("m", 1)).await;
    assert_eq!(r.status, 200);
    let up = upstream_traceparent(&sims, &r).await;
    let trace = &up[3..35];
    let spans = receiver.trace(trace, 1).await;
    assert_eq!(spans[0]["parent_span_id"], "", "a root span");
    assert_eq!(spans[0]["span_id"], &up[36..52]);
    assert!(up.ends_with("-01"), "{up}");
    // Spans are exported in the order requests end: the unsampled request's
    // would have come first.
    assert!(
        receiver
            .spans()
            .await
            .iter()
            .all(|s| s["trace_id"] != unsampled),
        "an unsampled request exported a span"
    );
}

#[tokio::test]
async fn a_collector_that_is_down_costs_requests_nothing_and_its_failures_are_counted() {
    let closed = format!("http://127.0.0.1:{}", free_port());
    let (sims, gw) = fleet(1, &telemetry_yaml(&closed, 1.0)).await;
    let c = client();
    for turn in 0..3 {
        let r = chat(&c, &gw, &[("x-session-id", "s")], &chat_body("m", turn)).await;
        assert_eq!(r.status, 200);
        assert!(upstream_traceparent(&sims, &r).await.starts_with("00-"));
    }
    gw.metric_reaches("agentserve_otel_spans_total{result=\"failed\"}", 3.0)
        .await;
}

#[tokio::test]
async fn without_telemetry_a_callers_traceparent_passes_through_untouched() {
    let (sims, gw) = fleet(1, &affinity_yaml(1800)).await;
    let traceparent = format!("00-{TRACE}-{CALLER_SPAN}-01");
    let r = chat(
        &client(),
        &gw,
        &[("traceparent", &traceparent)],
        &chat_body("m", 0),
    )
    .await;
    assert_eq!(r.status, 200);
    assert_eq!(upstream_traceparent(&sims, &r).await, traceparent);
}
