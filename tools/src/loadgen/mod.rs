//! `agent-gateway bench`: replays multi-turn agent sessions (or a Mooncake
//! trace) against any OpenAI-compatible URL and reports what affinity buys:
//! affinity-hit rate, prefix-cache hit rate, TTFT/E2E percentiles, balance.

pub mod report;
pub mod trace;

use bytes::Bytes;
use futures_util::StreamExt;
use report::{Report, TurnRecord};
use serde_json::{json, Value};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    /// Base URL of the gateway (or any OpenAI-compatible server). Several,
    /// comma-separated, are used round-robin per request: the no-gateway baseline.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    #[arg(long, default_value_t = 12)]
    pub sessions: usize,
    #[arg(long, default_value_t = 6)]
    pub turns: usize,
    /// Requests in flight at once.
    #[arg(long, short = 'c', default_value_t = 6)]
    pub concurrency: usize,
    /// Size of the system prompt every session shares, in bytes.
    #[arg(long, default_value_t = 3000)]
    pub system_prompt_bytes: usize,
    /// Size of a per-session document in the first user message, in bytes.
    #[arg(long, default_value_t = 0)]
    pub context_bytes: usize,
    /// The first this-many sessions are heavy: their document is
    /// `--heavy-context-bytes` instead (a skewed mix of long and short sessions).
    #[arg(long, default_value_t = 0)]
    pub heavy_sessions: usize,
    #[arg(long, default_value_t = 24_000)]
    pub heavy_context_bytes: usize,
    /// Size of each new user message, in bytes.
    #[arg(long, default_value_t = 200)]
    pub user_bytes: usize,
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u64,
    /// Pause between a session's turns (tool time), milliseconds.
    #[arg(long, default_value_t = 0)]
    pub think_ms: u64,
    /// Sessions arrive this far apart (ms) instead of all at once.
    #[arg(long, default_value_t = 0)]
    pub arrival_ms: u64,
    /// Child sessions (subagents) each session spawns after its first turn.
    #[arg(long, default_value_t = 0)]
    pub subagents: usize,
    /// Turns each subagent runs.
    #[arg(long, default_value_t = 2)]
    pub subagent_turns: usize,
    #[arg(long, default_value = "x-session-id")]
    pub session_header: String,
    #[arg(long, default_value = "x-parent-session-id")]
    pub parent_header: String,
    /// A new session id on every request: what a gateway sees with affinity off.
    #[arg(long)]
    pub fresh_ids: bool,
    /// Send no session or parent header at all, as the OpenAI SDKs and most
    /// chat front ends do: the gateway knows a conversation only by its prompt.
    #[arg(long)]
    pub keyless: bool,
    #[arg(long, default_value = "qwen3-8b")]
    pub model: String,
    /// Use non-streaming requests (TTFT is then the whole response time).
    #[arg(long)]
    pub no_stream: bool,
    /// Every session's first turn is the same (the shared system prompt and
    /// one first user message): a chat UI's greeting, an agent harness's
    /// task template, sampled rollouts of one task. Conversations diverge
    /// from their second turn, which carries the session's document
    /// (`--context-bytes`) when it has one.
    #[arg(long)]
    pub same_opening: bool,
    /// Each turn a Responses API request (`/v1/responses`) that sends only
    /// its new message and names the turn before by `previous_response_id`:
    /// the replica that stored it holds the rest (the OpenAI Agents SDK's
    /// chaining, Codex over WebSocket).
    #[arg(long)]
    pub responses: bool,
    /// Replay a Mooncake-format trace (JSON lines) instead of synthetic sessions.
    #[arg(long)]
    pub trace: Option<std::path::PathBuf>,
    /// Replay a generated Mooncake-style trace of this many conversations
    /// (see `trace::mooncake_like`) instead of synthetic sessions.
    #[arg(long)]
    pub trace_synthetic: Option<usize>,
    /// In the generated trace, each turn gives the partial last block of the
    /// turn before a new id, as a real trace's `hash_ids` do (a re-tokenised
    /// tail): turns share every full block of the one before, not its last.
    #[arg(long)]
    pub trace_reblock: bool,
    /// Seed of the generated trace.
    #[arg(long, default_value_t = 1)]
    pub trace_seed: u64,
    /// A trace's token ids are drawn below this (a real tokenizer's
    /// vocabulary: 151936 for Qwen3 makes most ids six digits).
    #[arg(long, default_value_t = trace::DEFAULT_VOCAB)]
    pub trace_vocab: u32,
    /// The generated trace's shape: `agentic` (every conversation 2–10
    /// turns, a 3-block shared opening: `trace::mooncake_like`) or
    /// `conversation` (a production chat trace's: most conversations one
    /// turn, one shared block: `trace::conversation_like`) or `documents`
    /// (the same, a third of the conversations opening with one of 32
    /// shared 4,096-token documents: `trace::documents_like`).
    #[arg(long, value_enum, default_value_t = TraceShape::Agentic)]
    pub trace_shape: TraceShape,
    /// Send the trace's requests in its order, each turn after its turn
    /// before (else each conversation runs its turns back to back, and
    /// conversations take turns at the concurrency limit).
    #[arg(long)]
    pub trace_ordered: bool,
    /// Cap on output tokens of trace requests.
    #[arg(long, default_value_t = 32)]
    pub trace_max_output: u64,
    /// Label of this run in reports.
    #[arg(long, default_value = "run")]
    pub label: String,
    /// Session (index) whose per-turn locality table is printed.
    #[arg(long, default_value_t = 0)]
    pub show_session: usize,
    /// Print the report as JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG chart of this run.
    #[arg(long)]
    pub svg: Option<std::path::PathBuf>,
    /// Prefix for session ids (runs with different prefixes never share bindings).
    #[arg(long, default_value = "bench")]
    pub id_prefix: String,
    /// A header sent with every request, `Name: value` (repeatable): a
    /// tenant's key (`Authorization: Bearer ...`), a priority class.
    #[arg(long = "header", value_parser = parse_header)]
    pub headers: Vec<(String, String)>,
}

fn parse_header(s: &str) -> Result<(String, String), String> {
    let (k, v) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: want `Name: value`"))?;
    let (k, v) = (k.trim(), v.trim());
    http::HeaderName::from_bytes(k.as_bytes()).map_err(|e| format!("`{k}`: {e}"))?;
    http::HeaderValue::from_str(v).map_err(|e| format!("`{k}` value: {e}"))?;
    Ok((k.to_string(), v.to_string()))
}

/// The shape of a generated trace (`--trace-shape`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TraceShape {
    Agentic,
    Conversation,
    Documents,
}

impl BenchArgs {
    pub fn seed_study(url: &str) -> Self {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Wrap {
            #[command(flatten)]
            args: BenchArgs,
        }
        let mut a = Wrap::parse_from(["bench"]).args;
        a.url = url.to_string();
        a
    }
}

/// One request of the workload.
#[derive(Debug, Clone)]
pub struct Turn {
    pub session: usize,
    pub turn: usize,
    pub session_id: String,
    pub parent_id: Option<String>,
    pub path: &'static str,
    pub body: Value,
}

/// Runs with different id prefixes get different text, so one run never
/// finds another run's transcripts in a replica's cache.
fn salt(prefix: &str) -> usize {
    prefix.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    }) as usize
}

fn filler(seed: usize, bytes: usize) -> String {
    // Words that vary with the seed, so different sessions share no text.
    let words = [
        "tool", "file", "patch", "test", "plan", "read", "grep", "edit", "diff", "run",
    ];
    let mut s = String::with_capacity(bytes + 16);
    let mut i = seed.wrapping_mul(2_654_435_761);
    while s.len() < bytes {
        i = i
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        s.push_str(words[(i >> 33) % words.len()]);
        s.push_str(&format!("{} ", (i >> 40) % 1000));
    }
    s.truncate(bytes);
    s
}

/// A synthetic agent session: a shared system prompt, an optional private
/// document, and turns that each resend the transcript plus a new message.
struct SessionScript {
    system: Arc<String>,
    context: String,
    messages: Vec<(String, String)>,
}

impl SessionScript {
    /// The last turn as a Responses request: its new message alone after
    /// the first, which also carries the system prompt as `instructions`.
    fn chained(&self, args: &BenchArgs, previous: Option<&str>) -> Value {
        let input = self.messages.last().map_or("", |(_, text)| text.as_str());
        let mut b = json!({"model": args.model, "input": input,
                           "max_output_tokens": args.max_tokens, "stream": !args.no_stream});
        match previous {
            Some(p) => b["previous_response_id"] = json!(p),
            None => b["instructions"] = json!(&*self.system),
        }
        b
    }

    fn body(&self, args: &BenchArgs, stream: bool) -> Value {
        let mut msgs = vec![json!({"role": "system", "content": &*self.system})];
        for (role, content) in &self.messages {
            msgs.push(json!({"role": role, "content": content}));
        }
        let mut b = json!({"model": args.model, "messages": msgs, "max_tokens": args.max_tokens});
        if stream {
            b["stream"] = json!(true);
            b["stream_options"] = json!({"include_usage": true});
        }
        b
    }
}

/// What one request returned.
#[derive(Debug, Default, Clone)]
struct Outcome {
    status: u16,
    backend: Option<String>,
    prompt_tokens: u64,
    cached_tokens: u64,
    ttft: Duration,
    e2e: Duration,
    prefill_us: Option<u64>,
    affinity_hit: Option<bool>,
    text: String,
    /// A Responses answer's id.
    response_id: Option<String>,
}

/// The base URL of the next request: `--url`'s one URL, or its list in turn.
fn next_url(urls: &str) -> &str {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let count = urls.split(',').count();
    let i = if count > 1 {
        NEXT.fetch_add(1, Ordering::Relaxed) % count
    } else {
        0
    };
    urls.split(',')
        .nth(i)
        .unwrap_or(urls)
        .trim()
        .trim_end_matches('/')
}

async fn send(client: &reqwest::Client, args: &BenchArgs, t: &Turn) -> Outcome {
    let started = Instant::now();
    let base = next_url(&args.url);
    let mut req = client.post(format!("{base}{}", t.path)).json(&t.body);
    for (k, v) in &args.headers {
        req = req.header(k.as_str(), v.as_str());
    }
    if !args.keyless {
        req = req.header(args.session_header.as_str(), t.session_id.as_str());
        if let Some(p) = &t.parent_id {
            req = req.header(args.parent_header.as_str(), p.as_str());
        }
    }
    let mut out = Outcome::default();
    let resp = match req.send().await {
        Ok(r) => r,
        Err(_) => {
            out.e2e = started.elapsed();
            return out;
        }
    };
    out.status = resp.status().as_u16();
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    out.backend = header("x-agent-serve-backend")
        .or_else(|| header("x-sim-backend"))
        .or_else(|| Some(base.rsplit('/').next().unwrap_or(base).to_string()));
    out.prefill_us = header("x-sim-prefill-us").and_then(|v| v.parse().ok());
    let sim_cached: Option<u64> = header("x-sim-cached-tokens").and_then(|v| v.parse().ok());
    out.affinity_hit = header("x-agent-serve-affinity-hit").map(|v| v == "true");
    let is_sse = header("content-type").is_some_and(|c| c.starts_with("text/event-stream"));
    let mut usage = Value::Null;
    // llama.cpp's own account of the request (prompt_ms: its prefill time).
    let mut timings = Value::Null;
    if is_sse {
        let mut stream = resp.bytes_stream();
        let mut buf: Vec<u8> = Vec::new();
        let mut first = true;
        while let Some(Ok(chunk)) = stream.next().await {
            if first {
                out.ttft = started.elapsed();
                first = false;
            }
            buf.extend_from_slice(&chunk);
            while let Some(end) = find(&buf, b"\n\n") {
                let event: Bytes = Bytes::copy_from_slice(&buf[..end]);
                buf.drain(..end + 2);
                // The data line, after an `event:` line where the API names
                // its events (Responses, Anthropic).
                let Some(data) = event
                    .split(|&b| b == b'\n')
                    .find_map(|line| line.strip_prefix(b"data: "))
                else {
                    continue;
                };
                if data == b"[DONE]" {
                    continue;
                }
                if let Ok(v) = serde_json::from_slice::<Value>(data) {
                    // The Responses API's events.
                    match v["type"].as_str() {
                        Some("response.created") => {
                            out.response_id = v["response"]["id"].as_str().map(str::to_string);
                        }
                        Some("response.output_text.delta") => {
                            out.text.push_str(v["delta"].as_str().unwrap_or(""));
                        }
                        Some("response.completed") => usage = v["response"]["usage"].clone(),
                        _ => {}
                    }
                    if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                        out.text.push_str(c);
                    } else if let Some(c) = v["choices"][0]["text"].as_str() {
                        out.text.push_str(c);
                    }
                    if v["usage"].is_object() {
                        usage = v["usage"].clone();
                    }
                    if v["timings"].is_object() {
                        timings = v["timings"].clone();
                    }
                }
            }
        }
    } else {
        let body: Value = resp.json().await.unwrap_or(Value::Null);
        out.ttft = started.elapsed();
        usage = body["usage"].clone();
        timings = body["timings"].clone();
        if let Some(c) = body["choices"][0]["message"]["content"].as_str() {
            out.text = c.to_string();
        } else if let Some(c) = body["choices"][0]["text"].as_str() {
            out.text = c.to_string();
        } else if body["object"] == "response" {
            out.response_id = body["id"].as_str().map(str::to_string);
            out.text = body["output"][0]["content"][0]["text"]
                .as_str()
                .unwrap_or("")
                .to_string();
        }
    }
    out.e2e = started.elapsed();
    if let Some(ms) = timings["prompt_ms"].as_f64() {
        out.prefill_us.get_or_insert((ms * 1000.0) as u64);
    }
    // Chat and completions usage, or the Responses API's.
    out.prompt_tokens = usage["prompt_tokens"]
        .as_u64()
        .or(usage["input_tokens"].as_u64())
        .unwrap_or(0);
    // An engine that reports no cache (the simulator with
    // `--no-cache-report`) still says in a header what it found cached.
    out.cached_tokens = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .or(usage["input_tokens_details"]["cached_tokens"].as_u64())
        .or(sim_cached)
        .unwrap_or(0);
    out
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Progress on stderr, only when it is a terminal.
struct Progress {
    done: AtomicUsize,
    total: usize,
    label: String,
    tty: bool,
}

impl Progress {
    fn tick(&self) {
        let done = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if self.tty && (done.is_multiple_of(4) || done == self.total) {
            let width = 30;
            let filled = width * done / self.total.max(1);
            eprint!(
                "\r{:>14} [{}{}] {done}/{}",
                self.label,
                "#".repeat(filled),
                ".".repeat(width - filled),
                self.total
            );
            if done == self.total {
                eprintln!();
            }
        }
    }
}

fn record(t: &Turn, o: &Outcome, parent_session: Option<usize>) -> TurnRecord {
    TurnRecord {
        session: t.session,
        parent_session,
        turn: t.turn,
        status: o.status,
        backend: o.backend.clone(),
        prompt_tokens: o.prompt_tokens,
        cached_tokens: o.cached_tokens,
        ttft: o.ttft,
        e2e: o.e2e,
        prefill_us: o.prefill_us,
        affinity_hit: o.affinity_hit,
    }
}

/// Run the workload `args` describes and report on it.
pub async fn run(args: &BenchArgs) -> Report {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .pool_max_idle_per_host(args.concurrency.max(1))
        .build()
        .expect("an HTTP client");
    let started = Instant::now();
    let records = match (&args.trace, args.trace_synthetic) {
        (Some(path), _) => match std::fs::read_to_string(path) {
            Ok(text) => trace::replay(&client, args, &text).await,
            Err(e) => {
                eprintln!("cannot read trace {}: {e}", path.display());
                Vec::new()
            }
        },
        (None, Some(n)) => {
            let text = match args.trace_shape {
                TraceShape::Agentic => trace::mooncake_like(n, args.trace_seed, args.trace_reblock),
                TraceShape::Conversation => {
                    trace::conversation_like(n, args.trace_seed, args.trace_reblock)
                }
                TraceShape::Documents => {
                    trace::documents_like(n, args.trace_seed, args.trace_reblock)
                }
            };
            trace::replay(&client, args, &text).await
        }
        (None, None) => run_sessions(&client, args).await,
    };
    Report::new(
        args.label.clone(),
        records,
        started.elapsed(),
        args.show_session,
    )
}

async fn run_sessions(client: &reqwest::Client, args: &BenchArgs) -> Vec<TurnRecord> {
    let total = args.sessions * (args.turns + args.subagents * args.subagent_turns);
    let progress = Arc::new(Progress {
        done: AtomicUsize::new(0),
        total,
        label: args.label.clone(),
        tty: std::io::stderr().is_terminal(),
    });
    let system = Arc::new(filler(usize::MAX, args.system_prompt_bytes));
    let permits = Arc::new(Semaphore::new(args.concurrency.max(1)));
    let args = Arc::new(args.clone());
    let mut tasks = Vec::new();
    for s in 0..args.sessions {
        let (client, args, system, permits, progress) = (
            client.clone(),
            Arc::clone(&args),
            Arc::clone(&system),
            Arc::clone(&permits),
            Arc::clone(&progress),
        );
        tasks.push(tokio::spawn(async move {
            if args.arrival_ms > 0 {
                tokio::time::sleep(Duration::from_millis(args.arrival_ms * s as u64)).await;
            }
            let mut out = Vec::new();
            let salt = salt(&args.id_prefix);
            let mut script = SessionScript {
                system: Arc::clone(&system),
                context: filler(
                    salt ^ s,
                    if s < args.heavy_sessions {
                        args.heavy_context_bytes
                    } else {
                        args.context_bytes
                    },
                ),
                messages: Vec::new(),
            };
            let session_id = format!("{}-{s}", args.id_prefix);
            let mut children = Vec::new();
            let mut previous: Option<String> = None;
            for turn in 0..args.turns {
                let user = if turn == 0 && args.same_opening {
                    format!("Turn 0: {}", filler(salt, args.user_bytes))
                } else {
                    // The conversation's own document opens it, or with a
                    // shared opening comes right after it.
                    let document_turn = args.same_opening as usize;
                    let mut user = if turn == document_turn && !script.context.is_empty() {
                        format!("Document:\n{}\n\n", script.context)
                    } else {
                        String::new()
                    };
                    user.push_str(&format!(
                        "Turn {turn}: {}",
                        filler(salt ^ (s * 1000 + turn), args.user_bytes)
                    ));
                    user
                };
                script.messages.push(("user".into(), user));
                let id = if args.fresh_ids {
                    format!("{session_id}-t{turn}")
                } else {
                    session_id.clone()
                };
                let (path, body) = match args.responses {
                    true => ("/v1/responses", script.chained(&args, previous.as_deref())),
                    false => ("/v1/chat/completions", script.body(&args, !args.no_stream)),
                };
                let t = Turn {
                    session: s,
                    turn,
                    session_id: id,
                    parent_id: None,
                    path,
                    body,
                };
                let o = send_limited(&client, &args, &permits, &progress, &t).await;
                script.messages.push(("assistant".into(), o.text.clone()));
                previous = o.response_id.clone();
                out.push(record(&t, &o, None));
                if turn == 0 {
                    for c in 0..args.subagents {
                        children.push(tokio::spawn(run_child(
                            client.clone(),
                            Arc::clone(&args),
                            Arc::clone(&permits),
                            Arc::clone(&progress),
                            s,
                            c,
                            session_id.clone(),
                            script.messages.clone(),
                            Arc::clone(&system),
                        )));
                    }
                }
                if args.think_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(args.think_ms)).await;
                }
            }
            out.append(&mut gather(children).await);
            out
        }));
    }
    gather(tasks).await
}

/// Send one turn once a concurrency permit is free, and count it done.
async fn send_limited(
    client: &reqwest::Client,
    args: &BenchArgs,
    permits: &Semaphore,
    progress: &Progress,
    t: &Turn,
) -> Outcome {
    let o = {
        let _p = permits.acquire().await.expect("semaphore open");
        send(client, args, t).await
    };
    progress.tick();
    o
}

/// The records of every task, in task order (a panicked task contributes none).
async fn gather(tasks: Vec<tokio::task::JoinHandle<Vec<TurnRecord>>>) -> Vec<TurnRecord> {
    let mut records = Vec::new();
    for t in tasks {
        if let Ok(mut r) = t.await {
            records.append(&mut r);
        }
    }
    records
}

/// A subagent: starts from its parent's transcript and runs its own turns
/// under a child session id, sending the parent's id as its parent.
#[allow(clippy::too_many_arguments)]
async fn run_child(
    client: reqwest::Client,
    args: Arc<BenchArgs>,
    permits: Arc<Semaphore>,
    progress: Arc<Progress>,
    parent: usize,
    child: usize,
    parent_id: String,
    transcript: Vec<(String, String)>,
    system: Arc<String>,
) -> Vec<TurnRecord> {
    let mut script = SessionScript {
        system,
        context: String::new(),
        messages: transcript,
    };
    let child_session = 1_000_000 + parent * 1000 + child;
    let mut out = Vec::new();
    for turn in 0..args.subagent_turns {
        script.messages.push((
            "user".into(),
            format!(
                "Subtask {child}.{turn}: {}",
                filler(child_session + turn, args.user_bytes)
            ),
        ));
        let t = Turn {
            session: child_session,
            turn,
            session_id: format!("{parent_id}-sub{child}"),
            parent_id: Some(parent_id.clone()),
            path: "/v1/chat/completions",
            body: script.body(&args, !args.no_stream),
        };
        let o = send_limited(&client, &args, &permits, &progress, &t).await;
        script.messages.push(("assistant".into(), o.text.clone()));
        out.push(record(&t, &o, Some(parent)));
    }
    out
}
