//! A simulated vLLM replica (`agent-gateway sim-backend`): OpenAI-compatible
//! endpoints, a paged prefix cache, a latency model with a bounded running
//! batch, vLLM's metric names, and fault knobs for tests. It stands in for a
//! GPU we do not have; its numbers are a model, not a measurement of vLLM.

pub mod cache;
pub mod kv;

use bytes::Bytes;
use cache::PrefixCache;
use http_body_util::{combinators::BoxBody, BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde::Deserialize;
use serde_json::{json, Value};
use siphasher::sip::SipHasher13;
use std::convert::Infallible;
use std::hash::Hasher;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, Notify, Semaphore};

#[derive(Debug, Clone, clap::Args)]
pub struct SimConfig {
    /// Address to listen on; port 0 picks a free port (printed on stdout).
    #[arg(long, default_value = "127.0.0.1:8001")]
    pub listen: SocketAddr,
    /// Replica name reported in `x-sim-backend`.
    #[arg(long, default_value = "sim-0")]
    pub id: String,
    #[arg(long = "model", default_value = "qwen3-8b")]
    pub models: Vec<String>,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Prefix-cache capacity in blocks (0 = unlimited).
    #[arg(long, default_value_t = 4096)]
    pub cache_blocks: usize,
    /// Prefill time per uncached prompt token, microseconds.
    #[arg(long, default_value_t = 100.0)]
    pub prefill_us_per_token: f64,
    /// Decode time per output token, microseconds.
    #[arg(long, default_value_t = 4000.0)]
    pub decode_us_per_token: f64,
    /// Requests running at once; the rest wait in a queue.
    #[arg(long, default_value_t = 8)]
    pub max_batch: usize,
    /// Probability of answering 500 instead of serving.
    #[arg(long, default_value_t = 0.0)]
    pub fail_rate: f64,
    /// Exit the process after serving this many completion requests.
    #[arg(long)]
    pub exit_after: Option<u64>,
    /// Die at once (SIGKILL-like: no answer, sockets closed by the kernel)
    /// on a completion request whose body holds this text: a request that
    /// kills engines.
    #[arg(long)]
    pub die_on: Option<String>,
    /// Prefill one request at a time (compute contention: a GPU's prefill
    /// is compute-bound, so concurrent prefills queue rather than overlap).
    #[arg(long)]
    pub serial_prefill: bool,
    /// Multiply prefill and decode times (a slow replica); also `POST /sim/config`.
    #[arg(long, default_value_t = 1.0)]
    pub slowdown: f64,
    /// Leave `prompt_tokens_details.cached_tokens` out of `usage`, as vLLM
    /// does without `--enable-prompt-tokens-details` and SGLang without
    /// `--enable-cache-report`. The `x-sim-cached-tokens` header says instead
    /// (for the load tool's measurements, not for the gateway).
    #[arg(long)]
    pub no_cache_report: bool,
    /// Publish KV-cache events as vLLM does (ZeroMQ PUB) on this
    /// `host:port` (port 0: any free one; both endpoints are printed).
    #[arg(long)]
    pub kv_events: Option<String>,
    /// The events' replay socket (ZeroMQ ROUTER), with `--kv-events`.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub kv_replay: String,
}

impl SimConfig {
    pub fn fast(id: &str) -> Self {
        SimConfig {
            listen: "127.0.0.1:0".parse().expect("literal address"),
            id: id.into(),
            models: vec!["qwen3-8b".into()],
            block_size: 16,
            cache_blocks: 0,
            prefill_us_per_token: 0.0,
            decode_us_per_token: 0.0,
            max_batch: 64,
            fail_rate: 0.0,
            exit_after: None,
            die_on: None,
            serial_prefill: false,
            slowdown: 1.0,
            no_cache_report: false,
            kv_events: None,
            kv_replay: "127.0.0.1:0".into(),
        }
    }
}

/// Fault knobs that tests flip at run time with `POST /sim/config`.
#[derive(Debug, Clone, Default, Deserialize, serde::Serialize)]
#[serde(default)]
pub struct Faults {
    pub fail_rate: f64,
    /// Accept requests but never answer them.
    pub hang: bool,
    /// `/health` answers 503.
    pub unhealthy: bool,
    /// Streams pause after their first token until `POST /sim/release`.
    pub hold_streams: bool,
    /// Multiplies prefill and decode times; 0 is taken as 1.
    pub slowdown: f64,
    /// `/metrics` reports this many requests running, whatever runs (an
    /// engine whose gauges lie).
    pub gauge_running: Option<u64>,
    /// `/metrics` reports this many requests waiting, whatever waits.
    pub gauge_waiting: Option<u64>,
    /// The next this many KV event batches are kept for replay but not
    /// published (as a PUB socket past its high-water mark drops them).
    pub drop_kv_batches: u32,
}

/// `path` with every percent-escape decoded (lossy where not UTF-8).
fn percent_decoded(path: &str) -> String {
    let b = path.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (
            b[i],
            b.get(i + 1).copied().and_then(hex),
            b.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

struct Sim {
    cfg: SimConfig,
    cache: Mutex<PrefixCache>,
    batch: Arc<Semaphore>,
    /// Held through each prefill with `--serial-prefill`.
    prefill: tokio::sync::Mutex<()>,
    running: AtomicU64,
    waiting: AtomicU64,
    requests: AtomicU64,
    /// Every request to an API path (`/v1/...`), any method: what a test
    /// reads to know whether a replica was asked at all.
    api_requests: AtomicU64,
    /// Decode time spent (µs) and tokens generated, as vLLM's
    /// `inter_token_latency_seconds` histogram counts them.
    decode_us: AtomicU64,
    decode_tokens: AtomicU64,
    active_streams: AtomicU64,
    faults: Mutex<Faults>,
    release: Notify,
    rng: AtomicU64,
    /// Responses this replica stored (`/v1/responses`), as vLLM keeps them
    /// in its own memory: id -> the conversation through that response.
    stored: Mutex<std::collections::HashMap<String, Arc<Transcript>>>,
    /// The headers of these names the last POST carried (for tests: what
    /// reaches an engine).
    last_headers: Mutex<serde_json::Map<String, Value>>,
    /// The `cache_salt` the last completion carried (for tests).
    last_cache_salt: Mutex<Option<String>>,
    /// Its KV-cache events (`--kv-events`).
    kv: Option<kv::Publisher>,
}

/// Headers a test may ask whether an engine received.
const SEEN_HEADERS: [&str; 5] = [
    "authorization",
    "x-api-key",
    "traceparent",
    "x-request-id",
    "x-session-id",
];

/// A conversation as (role, text) messages.
type Transcript = Vec<(String, String)>;

/// Responses a replica keeps at most; past it the store starts afresh.
const MAX_STORED: usize = 100_000;

/// What an answer looks like.
enum Shape {
    Chat,
    Completion,
    /// The Responses API: the new response's id, the one it follows, and
    /// the conversation through its input (its output is added when stored).
    Responses {
        id: String,
        previous: Option<String>,
        transcript: Vec<(String, String)>,
    },
    /// Anthropic Messages.
    Messages,
}

type Body = BoxBody<Bytes, Infallible>;

fn is_websocket(req: &Request<Incoming>) -> bool {
    req.headers()
        .get("upgrade")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).boxed()
}

fn json_response(status: StatusCode, v: &Value) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(full(v.to_string()))
        .expect("static parts")
}

/// The body hash tests compare against (SipHash-1-3, zero keys).
pub fn body_hash(body: &[u8]) -> String {
    let mut h = SipHasher13::new_with_keys(0, 0);
    h.write(body);
    format!("{:016x}", h.finish())
}

/// Start serving; returns the bound address. The server runs until the process exits.
pub async fn spawn(cfg: SimConfig) -> std::io::Result<SocketAddr> {
    Ok(spawn_with_events(cfg).await?.0)
}

/// [`spawn`], and the endpoints of its KV events (`--kv-events`): the
/// publisher's and the replay socket's.
pub async fn spawn_with_events(
    cfg: SimConfig,
) -> std::io::Result<(SocketAddr, Option<(String, String)>)> {
    let listener = TcpListener::bind(cfg.listen).await?;
    let addr = listener.local_addr()?;
    let kv = match &cfg.kv_events {
        Some(at) => Some(kv::Publisher::bind(at, &cfg.kv_replay, cfg.block_size).await?),
        None => None,
    };
    let endpoints = kv
        .as_ref()
        .map(|k| (k.events_endpoint.clone(), k.replay_endpoint.clone()));
    let sim = Arc::new(Sim {
        kv,
        cache: Mutex::new(PrefixCache::new(cfg.block_size, cfg.cache_blocks)),
        batch: Arc::new(Semaphore::new(cfg.max_batch.max(1))),
        prefill: tokio::sync::Mutex::new(()),
        running: AtomicU64::new(0),
        waiting: AtomicU64::new(0),
        requests: AtomicU64::new(0),
        api_requests: AtomicU64::new(0),
        decode_us: AtomicU64::new(0),
        decode_tokens: AtomicU64::new(0),
        last_headers: Default::default(),
        last_cache_salt: Default::default(),
        active_streams: AtomicU64::new(0),
        faults: Mutex::new(Faults {
            fail_rate: cfg.fail_rate,
            slowdown: cfg.slowdown,
            ..Faults::default()
        }),
        release: Notify::new(),
        rng: AtomicU64::new(0x2545_f491_4f6c_dd1d),
        stored: Mutex::new(Default::default()),
        cfg,
    });
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let sim = Arc::clone(&sim);
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| {
                    let sim = Arc::clone(&sim);
                    async move { Ok::<_, Infallible>(sim.handle(req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .with_upgrades()
                    .await;
            });
        }
    });
    Ok((addr, endpoints))
}

/// `agent-gateway sim-backend`: serve until killed.
pub fn run(cfg: SimConfig) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let (addr, events) = spawn_with_events(cfg).await?;
        println!("listening on {addr}");
        if let Some((events, replay)) = events {
            println!("kv events on {events} replay {replay}");
        }
        std::future::pending::<()>().await;
        Ok(())
    })
}

#[derive(Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    messages: Option<Vec<Message>>,
    prompt: Option<Value>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    /// Keeps this request's prefix cache apart (vLLM's and SGLang's field).
    cache_salt: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Value>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The chat template: `<|role|>\ncontent\n` per message, then the assistant tag.
pub fn render_chat(messages: &[(String, String)]) -> String {
    let mut s = String::new();
    for (role, content) in messages {
        s.push_str("<|");
        s.push_str(role);
        s.push_str("|>\n");
        s.push_str(content);
        s.push('\n');
    }
    s.push_str("<|assistant|>\n");
    s
}

fn content_text(v: &Option<Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

fn prompt_tokens(req: &CompletionRequest) -> Result<Vec<u32>, String> {
    if let Some(msgs) = &req.messages {
        let pairs: Vec<(String, String)> = msgs
            .iter()
            .map(|m| (m.role.clone(), content_text(&m.content)))
            .collect();
        return Ok(cache::tokenize(&render_chat(&pairs)));
    }
    match &req.prompt {
        Some(Value::String(s)) => Ok(cache::tokenize(s)),
        Some(Value::Array(items)) => {
            // A list of token ids, or a batch whose first element is one.
            let ids = match items.first() {
                Some(Value::Array(inner)) => inner,
                _ => items,
            };
            ids.iter()
                .map(|v| {
                    v.as_u64()
                        .map(|t| t as u32)
                        .ok_or_else(|| "prompt token ids must be integers".to_string())
                })
                .collect()
        }
        _ => Err("request needs `messages` or `prompt`".into()),
    }
}

/// The deterministic text of output token `i`.
fn output_token(i: u64) -> String {
    format!("t{} ", i % 97)
}

/// A stream's clock: token i leaves at its start + i × the decode time,
/// paced against the start so that timer granularity does not add up per
/// token (a stream then decodes as fast as a JSON answer does).
struct Pace {
    start: tokio::time::Instant,
    per_token_us: f64,
}

impl Pace {
    fn new(per_token_us: f64) -> Self {
        Pace {
            start: tokio::time::Instant::now(),
            per_token_us,
        }
    }

    /// Wait until token `i` is due.
    async fn token(&self, i: u64) {
        if i > 0 && self.per_token_us >= 1.0 {
            let at = Duration::from_micros((self.per_token_us * i as f64) as u64);
            tokio::time::sleep_until(self.start + at).await;
        }
    }
}

/// A stream of server-sent events, each as the channel gives it.
fn sse_response(rx: mpsc::Receiver<Bytes>) -> Response<Body> {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(StreamBody::new(stream).boxed())
        .expect("static parts")
}

/// A Responses API response object; `usage` in the chat shape (converted).
fn response_object(
    id: &str,
    model: &str,
    previous: Option<&str>,
    status: &str,
    text: &str,
    usage: Option<&Value>,
) -> Value {
    let output = if text.is_empty() {
        json!([])
    } else {
        json!([{"type": "message", "id": format!("msg_{id}"), "status": "completed", "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}])
    };
    let usage = usage.map(|u| {
        let mut r = json!({
            "input_tokens": u["prompt_tokens"],
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"],
        });
        if let Some(cached) = u.get("prompt_tokens_details") {
            r["input_tokens_details"] = cached.clone();
        }
        r
    });
    json!({
        "id": id, "object": "response", "created_at": now_secs(), "model": model, "status": status,
        "output": output, "previous_response_id": previous, "usage": usage,
        "parallel_tool_calls": true, "tool_choice": "auto", "tools": [], "store": true,
    })
}

/// An Anthropic message object without its content; `usage` in the chat
/// shape (converted: Anthropic's `input_tokens` leaves out the cached ones).
fn message_object(id: &str, model: &str, usage: &Value, output_tokens: u64) -> Value {
    let prompt = usage["prompt_tokens"].as_u64().unwrap_or(0);
    let mut u = json!({"output_tokens": output_tokens});
    match usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
        Some(cached) => {
            u["input_tokens"] = json!(prompt - cached.min(prompt));
            u["cache_read_input_tokens"] = json!(cached);
            u["cache_creation_input_tokens"] = json!(0);
        }
        None => u["input_tokens"] = json!(prompt),
    }
    json!({"id": format!("msg_{id}"), "type": "message", "role": "assistant", "model": model,
           "content": [], "stop_reason": null, "stop_sequence": null, "usage": u})
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn sleep_us(us: f64) -> Option<tokio::time::Sleep> {
    (us >= 1.0).then(|| tokio::time::sleep(Duration::from_micros(us as u64)))
}

impl Sim {
    fn chance(&self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        // xorshift64: deterministic per process, no lock.
        let mut x = self.rng.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng.store(x, Ordering::Relaxed);
        ((x >> 11) as f64 / (1u64 << 53) as f64) < p
    }

    /// Publish a change to the cache (`--kv-events`).
    fn publish(&self, events: Vec<kv::CacheEvent>, session: Option<String>) {
        let Some(kv) = &self.kv else {
            return;
        };
        let drop_live = {
            let mut f = self.faults.lock();
            let drop = f.drop_kv_batches > 0 && !events.is_empty();
            f.drop_kv_batches -= drop as u32;
            drop
        };
        kv.publish(events, session, drop_live);
    }

    async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        // Routed on the decoded path, as vLLM's server (uvicorn, Starlette)
        // routes: `/v1/chat/completion%73` is its chat endpoint.
        let path = percent_decoded(req.uri().path());
        let session = req
            .headers()
            .get("x-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let method = req.method().clone();
        if path.starts_with("/v1/") {
            self.api_requests.fetch_add(1, Ordering::Relaxed);
        }
        if method == hyper::Method::POST && !path.starts_with("/sim/") {
            *self.last_headers.lock() = SEEN_HEADERS
                .iter()
                .filter_map(|h| {
                    let v = req.headers().get(*h)?.to_str().ok()?;
                    Some((h.to_string(), json!(v)))
                })
                .collect();
        }
        match (method.as_str(), path.as_str()) {
            ("GET", "/health") => {
                if self.faults.lock().unhealthy {
                    json_response(
                        StatusCode::SERVICE_UNAVAILABLE,
                        &json!({"status": "unhealthy"}),
                    )
                } else {
                    Response::new(full("ok"))
                }
            }
            ("GET", "/v1/models") => {
                let data: Vec<Value> = self
                    .cfg
                    .models
                    .iter()
                    .map(|m| json!({"id": m, "object": "model", "owned_by": "agent-gateway-sim"}))
                    .collect();
                json_response(StatusCode::OK, &json!({"object": "list", "data": data}))
            }
            ("GET", "/metrics") => Response::builder()
                .header("content-type", "text/plain; version=0.0.4")
                .body(full(self.metrics_text()))
                .expect("static parts"),
            ("GET", "/sim/stats") => json_response(StatusCode::OK, &self.stats()),
            ("POST", "/sim/config") => {
                let body = req.into_body().collect().await.map(|b| b.to_bytes());
                match body
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Faults>(&b).ok())
                {
                    Some(f) => {
                        *self.faults.lock() = f.clone();
                        json_response(StatusCode::OK, &json!(f))
                    }
                    None => json_response(StatusCode::BAD_REQUEST, &json!({"error": "bad faults"})),
                }
            }
            ("POST", "/reset_prefix_cache") => {
                // vLLM's own: the cache empties, and its events say so.
                self.cache.lock().clear();
                self.publish(vec![kv::CacheEvent::Cleared], None);
                Response::new(full(""))
            }
            ("POST", "/sim/release") => {
                self.faults.lock().hold_streams = false;
                self.release.notify_waiters();
                json_response(StatusCode::OK, &json!({"released": true}))
            }
            ("POST", "/v1/embeddings") => {
                // A one-shot call: no KV cache, no batch slot, a vector back.
                let body = req.into_body().collect().await.map(|b| b.to_bytes());
                let input = body
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                    .map(|v| v["input"].to_string())
                    .unwrap_or_default();
                let tokens = cache::tokenize(&input).len();
                let mut resp = json_response(
                    StatusCode::OK,
                    &json!({"object": "list", "model": self.cfg.models[0],
                            "data": [{"object": "embedding", "index": 0, "embedding": [0.0, 1.0, 0.5]}],
                            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
                );
                resp.headers_mut()
                    .insert("x-sim-backend", self.cfg.id.parse().expect("printable id"));
                resp
            }
            ("POST", "/v1/chat/completions") | ("POST", "/v1/completions") => {
                let chat = path == "/v1/chat/completions";
                let body = match req.into_body().collect().await {
                    Ok(b) => b.to_bytes(),
                    Err(_) => {
                        return json_response(StatusCode::BAD_REQUEST, &json!({"error": "body"}))
                    }
                };
                let shape = if chat { Shape::Chat } else { Shape::Completion };
                let mut resp = self.clone().complete(shape, &body, session).await;
                let h = resp.headers_mut();
                h.insert("x-sim-backend", self.cfg.id.parse().expect("printable id"));
                h.insert("x-sim-body-len", body.len().into());
                h.insert("x-sim-body-hash", body_hash(&body).parse().expect("hex"));
                resp
            }
            ("POST", "/v1/messages") => {
                // Anthropic Messages: `system` beside the messages.
                let body = req.into_body().collect().await.map(|b| b.to_bytes());
                let Some(v) = body
                    .ok()
                    .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
                else {
                    return self.error(StatusCode::BAD_REQUEST, "invalid JSON");
                };
                let mut messages = Vec::new();
                if !v["system"].is_null() {
                    let system = content_text(&Some(v["system"].clone()));
                    messages.push(json!({"role": "system", "content": system}));
                }
                for m in v["messages"].as_array().into_iter().flatten() {
                    messages.push(json!({"role": m["role"], "content": content_text(&Some(m["content"].clone()))}));
                }
                let chat = json!({"model": v["model"], "messages": messages,
                                  "max_tokens": v["max_tokens"], "stream": v["stream"].as_bool().unwrap_or(false)});
                let mut resp = self
                    .clone()
                    .complete(Shape::Messages, chat.to_string().as_bytes(), session)
                    .await;
                resp.headers_mut()
                    .insert("x-sim-backend", self.cfg.id.parse().expect("printable id"));
                resp
            }
            ("GET", "/v1/responses") if is_websocket(&req) => self.upgrade(req),
            ("POST", "/v1/responses") => {
                let body = match req.into_body().collect().await {
                    Ok(b) => b.to_bytes(),
                    Err(_) => {
                        return json_response(StatusCode::BAD_REQUEST, &json!({"error": "body"}))
                    }
                };
                let mut resp = self.clone().respond(&body, session).await;
                resp.headers_mut()
                    .insert("x-sim-backend", self.cfg.id.parse().expect("printable id"));
                resp
            }
            (method @ ("GET" | "DELETE"), path) if path.starts_with("/v1/responses/") => {
                // A stored response, retrieved (as vLLM's store answers it)
                // or deleted (as OpenAI's API answers it).
                let id = &path["/v1/responses/".len()..];
                let found = match method {
                    "GET" => self.stored.lock().get(id).cloned(),
                    _ => self.stored.lock().remove(id),
                };
                let mut resp = match (found, method) {
                    (Some(t), "GET") => json_response(
                        StatusCode::OK,
                        &json!({"id": id, "object": "response", "status": "completed",
                                "output": [{"type": "message", "role": "assistant",
                                            "content": [{"type": "output_text",
                                                         "text": t.last().map_or("", |(_, text)| text.as_str())}]}]}),
                    ),
                    (Some(_), _) => json_response(
                        StatusCode::OK,
                        &json!({"id": id, "object": "response", "deleted": true}),
                    ),
                    (None, _) => json_response(
                        StatusCode::NOT_FOUND,
                        &json!({"error": {"message": format!("Response with id '{id}' not found."),
                                          "type": "invalid_request_error", "param": Value::Null, "code": 404}}),
                    ),
                };
                resp.headers_mut()
                    .insert("x-sim-backend", self.cfg.id.parse().expect("printable id"));
                resp
            }
            _ => json_response(StatusCode::NOT_FOUND, &json!({"error": "not found"})),
        }
    }

    /// `/v1/responses`: the conversation so far comes from this replica's
    /// store when the request follows a stored response (404 when this
    /// replica never stored it, as vLLM answers), then `instructions` and
    /// `input` (a string, or message items).
    async fn respond(self: Arc<Self>, body: &[u8], session: Option<String>) -> Response<Body> {
        let Ok(v) = serde_json::from_slice::<Value>(body) else {
            return self.error(StatusCode::BAD_REQUEST, "invalid JSON");
        };
        let previous = v["previous_response_id"].as_str().map(str::to_string);
        let mut transcript = match &previous {
            Some(id) => match self.stored.lock().get(id) {
                Some(t) => t.as_ref().clone(),
                None => {
                    return json_response(
                        StatusCode::NOT_FOUND,
                        &json!({"error": {"message": format!("Response with id '{id}' not found."),
                                          "type": "invalid_request_error", "param": Value::Null, "code": 404}}),
                    )
                }
            },
            None => Vec::new(),
        };
        if let Some(system) = v["instructions"].as_str() {
            transcript.push(("system".into(), system.to_string()));
        }
        match &v["input"] {
            Value::String(text) => transcript.push(("user".into(), text.clone())),
            Value::Array(items) => {
                for item in items {
                    let role = item["role"].as_str().unwrap_or("user").to_string();
                    transcript.push((role, content_text(&Some(item["content"].clone()))));
                }
            }
            _ => return self.error(StatusCode::BAD_REQUEST, "request needs `input`"),
        }
        let messages = transcript
            .iter()
            .map(|(role, content)| json!({"role": role, "content": content}))
            .collect::<Vec<_>>();
        let chat = json!({
            "model": v["model"],
            "messages": messages,
            "max_tokens": v["max_output_tokens"].as_u64().unwrap_or(16),
            "stream": v["stream"].as_bool().unwrap_or(false),
            "cache_salt": v["cache_salt"],
        });
        let n = self.requests.load(Ordering::Relaxed);
        let shape = Shape::Responses {
            id: format!(
                "resp_{}{:x}",
                self.cfg
                    .id
                    .replace(|c: char| !c.is_ascii_alphanumeric(), ""),
                n + 1
            ),
            previous,
            transcript,
        };
        self.complete(shape, chat.to_string().as_bytes(), session)
            .await
    }

    /// `/v1/responses` over WebSocket (OpenAI's WebSocket mode): each
    /// `response.create` message is a Responses request (`stream` ignored),
    /// answered with `response.created` and `response.completed` events, or
    /// an `error` event (a `previous_response_id` never stored here: 404).
    fn upgrade(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let Some(key) = req
            .headers()
            .get("sec-websocket-key")
            .and_then(|k| k.to_str().ok())
        else {
            return self.error(StatusCode::BAD_REQUEST, "no Sec-WebSocket-Key");
        };
        let accept = crate::ws::accept_key(key);
        let sim = Arc::clone(&self);
        tokio::spawn(async move {
            let Ok(io) = hyper::upgrade::on(req).await else {
                return;
            };
            let mut socket = crate::ws::Socket::server(TokioIo::new(io));
            while let Ok(Some(text)) = socket.recv_text().await {
                for event in sim.clone().over_websocket(&text).await {
                    if socket.send_text(&event.to_string()).await.is_err() {
                        return;
                    }
                }
            }
        });
        let mut resp = Response::new(full(""));
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        let h = resp.headers_mut();
        h.insert("upgrade", "websocket".parse().expect("static"));
        h.insert("connection", "upgrade".parse().expect("static"));
        h.insert("sec-websocket-accept", accept.parse().expect("base64"));
        h.insert("x-sim-backend", self.cfg.id.parse().expect("printable id"));
        resp
    }

    /// The events one WebSocket message gets back.
    async fn over_websocket(self: Arc<Self>, text: &str) -> Vec<Value> {
        let error = |status: u16, message: String| {
            vec![json!({"type": "error", "status": status,
                        "error": {"type": "invalid_request_error", "message": message}})]
        };
        let mut body = match serde_json::from_str::<Value>(text) {
            Ok(v) if v["type"] == "response.create" => v,
            _ => return error(400, "expected a response.create message".into()),
        };
        body["stream"] = json!(false);
        let resp = self.respond(body.to_string().as_bytes(), None).await;
        let status = resp.status().as_u16();
        let bytes = resp
            .into_body()
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let answer: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status != 200 {
            let message = answer["error"]["message"]
                .as_str()
                .or(answer["message"].as_str())
                .unwrap_or("failed")
                .to_string();
            return error(status, message);
        }
        vec![
            json!({"type": "response.created", "response": {"id": answer["id"], "object": "response", "status": "in_progress"}}),
            json!({"type": "response.completed", "response": answer}),
        ]
    }

    /// Keep a response (and the conversation through it) for follow-ups.
    fn store(&self, id: &str, mut transcript: Vec<(String, String)>, output: &str) {
        transcript.push(("assistant".into(), output.to_string()));
        let mut stored = self.stored.lock();
        if stored.len() >= MAX_STORED {
            stored.clear();
        }
        stored.insert(id.to_string(), Arc::new(transcript));
    }

    fn error(&self, status: StatusCode, message: &str) -> Response<Body> {
        json_response(
            status,
            &json!({"object": "error", "message": message, "type": "BadRequestError", "code": status.as_u16()}),
        )
    }

    async fn complete(
        self: Arc<Self>,
        shape: Shape,
        body: &[u8],
        session: Option<String>,
    ) -> Response<Body> {
        let chat = !matches!(shape, Shape::Completion);
        if let Some(marker) = &self.cfg.die_on {
            if body.windows(marker.len()).any(|w| w == marker.as_bytes()) {
                // SAFETY: signals this process, which ends at once.
                unsafe {
                    libc::kill(libc::getpid(), libc::SIGKILL);
                }
            }
        }
        let served = self.requests.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(n) = self.cfg.exit_after {
            if served >= n {
                tokio::spawn(async {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    std::process::exit(0);
                });
            }
        }
        let faults = self.faults.lock().clone();
        if faults.hang {
            std::future::pending::<()>().await;
        }
        if self.chance(faults.fail_rate) {
            return self.error(StatusCode::INTERNAL_SERVER_ERROR, "simulated failure");
        }
        let req: CompletionRequest = match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return self.error(StatusCode::BAD_REQUEST, &format!("invalid JSON: {e}")),
        };
        let tokens = match prompt_tokens(&req) {
            Ok(t) => t,
            Err(e) => return self.error(StatusCode::BAD_REQUEST, &e),
        };
        let model = req
            .model
            .clone()
            .unwrap_or_else(|| self.cfg.models[0].clone());
        if req.cache_salt.as_deref() == Some("") {
            // vLLM refuses an empty salt.
            return self.error(StatusCode::BAD_REQUEST, "cache_salt must not be empty");
        }
        let salt = req.cache_salt.as_deref();
        self.last_cache_salt.lock().clone_from(&req.cache_salt);
        let max_out = req
            .max_completion_tokens
            .or(req.max_tokens)
            .unwrap_or(16)
            .clamp(1, 4096);

        self.waiting.fetch_add(1, Ordering::Relaxed);
        let queued_at = std::time::Instant::now();
        let permit = self.batch_permit().await;
        let queue_us = queued_at.elapsed().as_micros() as u64;
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        self.running.fetch_add(1, Ordering::Relaxed);

        let slowdown = self.slowdown();
        let prefill_started = std::time::Instant::now();
        let cached = {
            let _serial = match self.cfg.serial_prefill {
                true => Some(self.prefill.lock().await),
                false => None,
            };
            // The cache is read when this prompt's prefill starts, as an
            // engine's scheduler does: a prompt queued behind another that
            // shares its prefix finds the blocks that one computed.
            let cached = self.cache.lock().lookup_salted(&tokens, salt);
            let us = (tokens.len() - cached) as f64 * self.cfg.prefill_us_per_token * slowdown;
            if let Some(s) = sleep_us(us) {
                s.await;
            }
            cached
        };
        let prefill_us = prefill_started.elapsed().as_micros() as u64;
        let no_report = self.cfg.no_cache_report;
        let changed = self.cache.lock().insert_salted(&tokens, salt);
        self.publish(changed, session);
        let timing = move |mut r: Response<Body>| {
            r.headers_mut().insert("x-sim-queue-us", queue_us.into());
            r.headers_mut()
                .insert("x-sim-prefill-us", prefill_us.into());
            if no_report {
                r.headers_mut()
                    .insert("x-sim-cached-tokens", (cached as u64).into());
            }
            r
        };
        let mut usage = json!({
            "prompt_tokens": tokens.len(),
            "completion_tokens": max_out,
            "total_tokens": tokens.len() as u64 + max_out,
        });
        if !self.cfg.no_cache_report {
            usage["prompt_tokens_details"] = json!({"cached_tokens": cached});
        }
        let id = format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, served);
        // Counted as it is scheduled (the engine's own histogram counts
        // each token as it comes; its average is the same).
        self.decode_us.fetch_add(
            (max_out as f64 * self.cfg.decode_us_per_token * slowdown) as u64,
            Ordering::Relaxed,
        );
        self.decode_tokens.fetch_add(max_out, Ordering::Relaxed);

        if !req.stream {
            if let Some(s) = sleep_us(max_out as f64 * self.cfg.decode_us_per_token * slowdown) {
                s.await;
            }
            let text: String = (0..max_out).map(output_token).collect();
            if let Shape::Responses {
                id,
                previous,
                transcript,
            } = shape
            {
                self.store(&id, transcript, &text);
                drop(permit);
                self.running.fetch_sub(1, Ordering::Relaxed);
                let r = response_object(
                    &id,
                    &model,
                    previous.as_deref(),
                    "completed",
                    &text,
                    Some(&usage),
                );
                return timing(json_response(StatusCode::OK, &r));
            }
            if let Shape::Messages = shape {
                drop(permit);
                self.running.fetch_sub(1, Ordering::Relaxed);
                let mut m = message_object(&id, &model, &usage, max_out);
                m["content"] = json!([{"type": "text", "text": text}]);
                m["stop_reason"] = json!("max_tokens");
                return timing(json_response(StatusCode::OK, &m));
            }
            let choice = if chat {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"})
            } else {
                json!({"index": 0, "text": text, "finish_reason": "length"})
            };
            drop(permit);
            self.running.fetch_sub(1, Ordering::Relaxed);
            return timing(json_response(
                StatusCode::OK,
                &json!({
                    "id": id, "object": if chat { "chat.completion" } else { "text_completion" },
                    "created": now_secs(), "model": model, "choices": [choice], "usage": usage,
                }),
            ));
        }

        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        let (tx, rx) = mpsc::channel::<Bytes>(16);
        let sim = Arc::clone(&self);
        sim.active_streams.fetch_add(1, Ordering::Relaxed);
        if let Shape::Responses {
            id,
            previous,
            transcript,
        } = shape
        {
            // The Responses API's events: created, a delta a token, completed
            // (with the whole response and its usage); no `[DONE]`.
            let text: String = (0..max_out).map(output_token).collect();
            sim.store(&id, transcript, &text);
            tokio::spawn(async move {
                let mut seq = 0u64;
                let mut event = |kind: &str, mut v: Value| {
                    v["type"] = json!(kind);
                    v["sequence_number"] = json!(seq);
                    seq += 1;
                    Bytes::from(format!("event: {kind}\ndata: {v}\n\n"))
                };
                let prev = previous.as_deref();
                let created = response_object(&id, &model, prev, "in_progress", "", None);
                let mut open = tx
                    .send(event("response.created", json!({"response": created})))
                    .await
                    .is_ok();
                let pace = Pace::new(sim.cfg.decode_us_per_token * slowdown);
                for i in 0..max_out {
                    if !open {
                        break;
                    }
                    pace.token(i).await;
                    let delta = json!({"item_id": format!("msg_{id}"), "output_index": 0,
                                       "content_index": 0, "delta": output_token(i)});
                    open = tx
                        .send(event("response.output_text.delta", delta))
                        .await
                        .is_ok();
                }
                if open {
                    let done = response_object(&id, &model, prev, "completed", &text, Some(&usage));
                    let _ = tx
                        .send(event("response.completed", json!({"response": done})))
                        .await;
                }
                drop(permit);
                sim.running.fetch_sub(1, Ordering::Relaxed);
                sim.active_streams.fetch_sub(1, Ordering::Relaxed);
            });
            return timing(sse_response(rx));
        }
        if let Shape::Messages = shape {
            // Anthropic's events: message_start (with the input's usage),
            // a text block a delta a token, message_delta (the output's).
            tokio::spawn(async move {
                let event =
                    |kind: &str, v: Value| Bytes::from(format!("event: {kind}\ndata: {v}\n\n"));
                let mut open = tx
                    .send(event(
                        "message_start",
                        json!({"type": "message_start",
                        "message": message_object(&id, &model, &usage, 1)}),
                    ))
                    .await
                    .is_ok();
                open = open
                    && tx
                        .send(event(
                            "content_block_start",
                            json!({"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": ""}}),
                        ))
                        .await
                        .is_ok();
                let pace = Pace::new(sim.cfg.decode_us_per_token * slowdown);
                for i in 0..max_out {
                    if !open {
                        break;
                    }
                    pace.token(i).await;
                    open = tx
                        .send(event(
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": 0,
                            "delta": {"type": "text_delta", "text": output_token(i)}}),
                        ))
                        .await
                        .is_ok();
                }
                if open {
                    for (kind, v) in [
                        (
                            "content_block_stop",
                            json!({"type": "content_block_stop", "index": 0}),
                        ),
                        (
                            "message_delta",
                            json!({"type": "message_delta",
                            "delta": {"stop_reason": "max_tokens", "stop_sequence": null},
                            "usage": {"output_tokens": max_out}}),
                        ),
                        ("message_stop", json!({"type": "message_stop"})),
                    ] {
                        if tx.send(event(kind, v)).await.is_err() {
                            break;
                        }
                    }
                }
                drop(permit);
                sim.running.fetch_sub(1, Ordering::Relaxed);
                sim.active_streams.fetch_sub(1, Ordering::Relaxed);
            });
            return timing(sse_response(rx));
        }
        tokio::spawn(async move {
            let object = if chat {
                "chat.completion.chunk"
            } else {
                "text_completion"
            };
            let created = now_secs();
            let event = |choice: Value, usage: Value| {
                let v = json!({"id": id, "object": object, "created": created, "model": model,
                               "choices": choice, "usage": usage});
                Bytes::from(format!("data: {v}\n\n"))
            };
            let pace = Pace::new(sim.cfg.decode_us_per_token * slowdown);
            for i in 0..max_out {
                pace.token(i).await;
                let finish = if i + 1 == max_out {
                    json!("length")
                } else {
                    Value::Null
                };
                let choice = if chat {
                    json!([{"index": 0, "delta": {"role": "assistant", "content": output_token(i)}, "finish_reason": finish}])
                } else {
                    json!([{"index": 0, "text": output_token(i), "finish_reason": finish}])
                };
                if tx.send(event(choice, Value::Null)).await.is_err() {
                    break;
                }
                if i == 0 {
                    let hold = sim.release.notified();
                    if sim.faults.lock().hold_streams {
                        hold.await;
                    }
                }
            }
            if include_usage {
                let _ = tx.send(event(json!([]), usage)).await;
            }
            let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
            drop(permit);
            sim.running.fetch_sub(1, Ordering::Relaxed);
            sim.active_streams.fetch_sub(1, Ordering::Relaxed);
        });
        timing(sse_response(rx))
    }

    fn slowdown(&self) -> f64 {
        match self.faults.lock().slowdown {
            s if s > 0.0 && s.is_finite() => s,
            _ => 1.0,
        }
    }

    async fn batch_permit(&self) -> tokio::sync::OwnedSemaphorePermit {
        Arc::clone(&self.batch)
            .acquire_owned()
            .await
            .expect("the batch semaphore is never closed")
    }

    fn stats(&self) -> Value {
        let c = self.cache.lock();
        json!({
            "id": self.cfg.id,
            "requests": self.requests.load(Ordering::Relaxed),
            "api_requests": self.api_requests.load(Ordering::Relaxed),
            "running": self.running.load(Ordering::Relaxed),
            "waiting": self.waiting.load(Ordering::Relaxed),
            "active_streams": self.active_streams.load(Ordering::Relaxed),
            "prefix_cache_queries": c.queries_tokens,
            "prefix_cache_hits": c.hit_tokens,
            "cache_blocks": c.len_blocks(),
            "last_headers": self.last_headers.lock().clone(),
            "last_cache_salt": self.last_cache_salt.lock().clone(),
        })
    }

    fn metrics_text(&self) -> String {
        let lies = self.faults.lock().clone();
        let c = self.cache.lock();
        let mut out = String::new();
        for m in &self.cfg.models {
            let l = format!("{{model_name=\"{m}\"}}");
            out.push_str(&format!(
                "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{l} {}\n\
                 # TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{l} {}\n\
                 # TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{l} {}\n\
                 # TYPE vllm:prefix_cache_queries_total counter\nvllm:prefix_cache_queries_total{l} {}\n\
                 # TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{l} {}\n",
                lies.gauge_running
                    .unwrap_or_else(|| self.running.load(Ordering::Relaxed)),
                lies.gauge_waiting
                    .unwrap_or_else(|| self.waiting.load(Ordering::Relaxed)),
                c.usage(),
                c.queries_tokens,
                c.hit_tokens,
            ));
        }
        out.push_str(&format!(
            "# TYPE vllm:inter_token_latency_seconds histogram\n\
             vllm:inter_token_latency_seconds_sum {}\n\
             vllm:inter_token_latency_seconds_count {}\n",
            self.decode_us.load(Ordering::Relaxed) as f64 / 1e6,
            self.decode_tokens.load(Ordering::Relaxed),
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn start() -> SocketAddr {
        let mut cfg = SimConfig::fast("t");
        cfg.block_size = 16;
        spawn(cfg).await.expect("sim starts")
    }

    fn chat(stream: bool) -> Value {
        json!({
            "model": "qwen3-8b",
            "messages": [{"role": "system", "content": "s".repeat(400)}, {"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": stream,
            "stream_options": {"include_usage": true},
        })
    }

    async fn post(c: &reqwest::Client, url: &str, body: &Value) -> Value {
        c.post(url)
            .json(body)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn usage_reports_cached_prefix_tokens() {
        let addr = start().await;
        let c = reqwest::Client::new();
        let url = format!("http://{addr}/v1/chat/completions");
        let first: Value = post(&c, &url, &chat(false)).await;
        let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(first["usage"]["completion_tokens"], 3);
        assert_eq!(first["usage"]["total_tokens"], prompt + 3);
        assert_eq!(first["choices"][0]["message"]["content"], "t0 t1 t2 ");
        let second: Value = post(&c, &url, &chat(false)).await;
        // Whole 16-token blocks of the identical prompt are cached.
        assert_eq!(
            second["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
            prompt / 16 * 16
        );
        let m = c
            .get(format!("http://{addr}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(m.contains(&format!(
            "vllm:prefix_cache_queries_total{{model_name=\"qwen3-8b\"}} {}",
            2 * prompt
        )));
        assert!(m.contains("vllm:num_requests_running{model_name=\"qwen3-8b\"} 0"));
    }

    #[tokio::test]
    async fn a_prompt_queued_behind_a_serial_prefill_finds_the_prefix_it_computed() {
        let mut cfg = SimConfig::fast("t");
        cfg.serial_prefill = true;
        // About 2 s of prefill for the first prompt: the second arrives
        // while it runs, and waits for it.
        cfg.prefill_us_per_token = 20_000.0;
        let addr = spawn(cfg).await.expect("sim starts");
        let c = reqwest::Client::new();
        let url = format!("http://{addr}/v1/chat/completions");
        let first = tokio::spawn({
            let (c, url) = (c.clone(), url.clone());
            async move { post(&c, &url, &chat(false)).await }
        });
        // Readiness: the first prompt is admitted (it is prefilling).
        loop {
            let m = c
                .get(format!("http://{addr}/metrics"))
                .send()
                .await
                .unwrap();
            let m = m.text().await.unwrap();
            if m.contains("vllm:num_requests_running{model_name=\"qwen3-8b\"} 1") {
                break;
            }
            tokio::task::yield_now().await;
        }
        let second = post(&c, &url, &chat(false)).await;
        let first = first.await.unwrap();
        let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
        assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
        assert_eq!(
            second["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap(),
            prompt / 16 * 16
        );
    }

    #[tokio::test]
    async fn sse_framing_is_openai_compatible() {
        let addr = start().await;
        let resp = reqwest::Client::new()
            .post(format!("http://{addr}/v1/chat/completions"))
            .json(&chat(true))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let text = resp.text().await.unwrap();
        let events: Vec<&str> = text.split_terminator("\n\n").collect();
        assert_eq!(
            events.len(),
            3 + 1 + 1,
            "3 tokens, a usage chunk, [DONE]: {text}"
        );
        assert_eq!(*events.last().unwrap(), "data: [DONE]");
        let chunks: Vec<Value> = events[..4]
            .iter()
            .map(|e| serde_json::from_str(e.strip_prefix("data: ").expect("data: prefix")).unwrap())
            .collect();
        for c in &chunks[..3] {
            assert_eq!(c["object"], "chat.completion.chunk");
            assert!(c["choices"][0]["delta"]["content"].is_string());
            assert!(c["usage"].is_null());
        }
        assert_eq!(chunks[2]["choices"][0]["finish_reason"], "length");
        assert_eq!(chunks[3]["choices"], json!([]));
        assert!(chunks[3]["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
    }

    #[tokio::test]
    async fn token_id_prompts_and_bad_requests() {
        let addr = start().await;
        let c = reqwest::Client::new();
        let url = format!("http://{addr}/v1/completions");
        let ids: Vec<u32> = (0..40).collect();
        let r: Value = post(&c, &url, &json!({"prompt": ids, "max_tokens": 1})).await;
        assert_eq!(r["usage"]["prompt_tokens"], 40);
        let bad = c.post(&url).body("{not json").send().await.unwrap();
        assert_eq!(bad.status(), 400);
        let missing = c
            .post(&url)
            .json(&json!({"max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(missing.status(), 400);
    }
}
