//! Engines' KV-cache events as the gateway's view of their caches
//! (`kv_events`), against simulated replicas that publish them as vLLM does
//! (ZeroMQ, msgpack, a replay socket): sessions named upstream, predictions
//! from the events, a batch lost and recovered, an engine restarted, and a
//! session its draining backend evicted moving on.
//! (`tests/vllm.rs` runs the same against real vLLM.)

mod common;

use common::*;
use serde_json::{json, Value};

/// An append-only agent conversation (each turn extends the last prompt).
struct Conversation {
    messages: Vec<Value>,
}

impl Conversation {
    fn new(name: &str) -> Conversation {
        let system =
            format!("You are agent {name}; read the file, run the test and fix it. ").repeat(12);
        Conversation {
            messages: vec![json!({"role": "system", "content": system})],
        }
    }

    fn next(&mut self, turn: usize) -> Value {
        if turn > 0 {
            self.messages
                .push(json!({"role": "assistant", "content": format!("Done with step {turn}; the test passes now.")}));
        }
        self.messages.push(json!({"role": "user", "content": format!("Step {turn}: the tool printed an error on line {}. Fix it.", turn * 11)}));
        json!({"model": "qwen3-8b", "messages": self.messages, "max_tokens": 4})
    }
}

async fn kv_of(gw: &Gateway, id: &str) -> Value {
    gw.admin_backend(id).await["kv_events"].clone()
}

/// A turn of `session` through `gw` to the engine `backend`, returned once
/// the engine's events for it (the blocks it stored) have reached the
/// gateway: they come after the answer, and a turn sent before them is routed
/// on what came before.
async fn turn(
    c: &reqwest::Client,
    gw: &Gateway,
    backend: &str,
    session: &str,
    body: &Value,
) -> Reply {
    let events = || async { kv_of(gw, backend).await["events"].as_u64().unwrap_or(0) };
    let before = events().await;
    let r = chat(c, gw, &[("x-session-id", session)], body).await;
    wait_until("the turn's events applied", || async {
        events().await > before
    })
    .await;
    r
}

async fn predictions(gw: &Gateway, source: &str, outcome: &str) -> f64 {
    gw.metric(&format!(
        "agentserve_kv_predictions_total{{outcome=\"{outcome}\",source=\"{source}\",tier=\"default\"}}"
    ))
    .await
}

/// A gateway in front of `sims`, each with its events; `extra`: YAML.
async fn gateway(sims: &[&SimBackend], extra: &str) -> Gateway {
    let tiers = [tier("default", true, &["qwen3-8b"], sims)];
    let dir = tempfile::tempdir().unwrap();
    let (port, metrics_port) = (free_port(), free_port_pair());
    let kv: Vec<_> = sims
        .iter()
        .map(|s| (s.id.as_str(), s.addr, sim_kv_events(s)))
        .collect();
    let extra = format!(
        "{FAST_HEALTH}{}  allow_explicit_target: true\n{extra}",
        affinity_yaml(600)
    );
    let yaml = with_kv_events(
        config_yaml(port, metrics_port, dir.path(), &tiers, &extra),
        &kv,
    );
    let gw = Gateway::start_yaml(dir, port, metrics_port, &yaml).await;
    for s in sims {
        wait_until("the engine's events followed", || async {
            kv_of(&gw, &s.id).await["exact"] == true
        })
        .await;
    }
    gw
}

const EVENTS: &[&str] = &["--kv-events", "127.0.0.1:0", "--block-size", "16"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_events_say_what_it_holds_through_a_lost_batch_and_a_restart() {
    let mut sim = SimBackend::start("ev-0", EVENTS);
    let gw = gateway(&[&sim], "").await;
    let c = client();

    // Sessions go upstream named by their binding key, not the client's id.
    let mut s = Conversation::new("s");
    for t in 0..3 {
        let r = turn(&c, &gw, "ev-0", "s", &s.next(t)).await;
        assert_eq!(r.status, 200);
    }
    let seen = sim.stats().await["last_headers"]["x-session-id"].clone();
    let seen = seen.as_str().expect("the engine got X-Session-ID");
    assert_eq!(seen.len(), 32, "{seen}");
    assert_ne!(seen, "s");
    // Its later turns were predicted from the events, rightly.
    gw.metric_reaches(
        "agentserve_kv_predictions_total{outcome=\"right\",source=\"events\",tier=\"default\"}",
        2.0,
    )
    .await;
    assert_eq!(predictions(&gw, "events", "wrong").await, 0.0);

    // A batch lost on the way is recovered from the replay socket: the
    // session whose blocks it stored is known, and predicted from them.
    sim.set_faults(json!({"drop_kv_batches": 1})).await;
    let mut d = Conversation::new("d");
    let r = chat(&c, &gw, &[("x-session-id", "d")], &d.next(0)).await;
    assert_eq!(r.status, 200);
    let mut e = Conversation::new("e");
    let r = chat(&c, &gw, &[("x-session-id", "e")], &e.next(0)).await;
    assert_eq!(r.status, 200);
    wait_until("the lost batch replayed", || async {
        kv_of(&gw, "ev-0").await["replayed_batches"] == 1
    })
    .await;
    assert_eq!(kv_of(&gw, "ev-0").await["exact"], true);
    let r = chat(&c, &gw, &[("x-session-id", "d")], &d.next(1)).await;
    assert_eq!(r.status, 200);
    gw.metric_reaches(
        "agentserve_kv_predictions_total{outcome=\"right\",source=\"events\",tier=\"default\"}",
        3.0,
    )
    .await;

    // The engine killed: what it held is forgotten before any turn reaches
    // it again; restarted on the same sockets, its events are followed again
    // and its empty cache predicted as empty.
    let held = kv_of(&gw, "ev-0").await["blocks_held"].as_u64().unwrap();
    assert!(held > 0);
    sim.kill();
    wait_until("the dead engine's holdings forgotten", || async {
        let kv = kv_of(&gw, "ev-0").await;
        kv["exact"] == false && kv["blocks_held"] == 0
    })
    .await;
    let (events, replay) = sim.kv.clone().unwrap();
    let (events, replay) = (
        events.trim_start_matches("tcp://").to_string(),
        replay.trim_start_matches("tcp://").to_string(),
    );
    sim.restart(&[
        "--kv-events",
        &events,
        "--kv-replay",
        &replay,
        "--block-size",
        "16",
    ]);
    wait_until("its events followed again", || async {
        kv_of(&gw, "ev-0").await["exact"] == true
    })
    .await;
    wait_until("the restarted engine healthy", || async {
        chat(&c, &gw, &[], &chat_body("qwen3-8b", 0)).await.status == 200
    })
    .await;
    let r = chat(&c, &gw, &[("x-session-id", "s")], &s.next(3)).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    gw.metric_reaches(
        "agentserve_kv_predictions_total{outcome=\"right\",source=\"events\",tier=\"default\"}",
        4.0,
    )
    .await;
    assert_eq!(predictions(&gw, "events", "wrong").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_its_draining_backend_evicted_moves_and_one_it_holds_stays() {
    let a = SimBackend::start("drain-a", EVENTS);
    let b = SimBackend::start("drain-b", EVENTS);
    let gw = gateway(&[&a, &b], "").await;
    let c = client();
    let mut conv = Conversation::new("kept");
    let first = chat(
        &c,
        &gw,
        &[
            ("x-session-id", "kept"),
            ("x-agent-serve-backend-id", "drain-a"),
        ],
        &conv.next(0),
    )
    .await;
    assert_eq!(first.status, 200);
    // Bound where it went? Its next turn, unnamed, says.
    let r = chat(&c, &gw, &[("x-session-id", "kept")], &conv.next(1)).await;
    let home = r.backend.clone().unwrap();
    let (home_sim, other) = if home == "drain-a" {
        (&a, "drain-b")
    } else {
        (&b, "drain-a")
    };
    // Drained without moving sessions: one whose cache is there stays.
    let drain = client()
        .post(gw.admin_url(&format!("/admin/backends/{home}/drain")))
        .json(&json!({"move_sessions": false}))
        .send()
        .await
        .unwrap();
    assert!(drain.status().is_success());
    let r = chat(&c, &gw, &[("x-session-id", "kept")], &conv.next(2)).await;
    assert_eq!(
        r.backend.as_deref(),
        Some(home.as_str()),
        "it holds the session: stay"
    );
    // Its engine empties its cache (vLLM's reset_prefix_cache): the
    // session holds nothing there, and moves off the draining backend.
    let reset = client()
        .post(home_sim.url("/reset_prefix_cache"))
        .send()
        .await
        .unwrap();
    assert!(reset.status().is_success());
    wait_until("the engine's clear seen", || async {
        kv_of(&gw, &home).await["blocks_held"] == 0
    })
    .await;
    let r = chat(&c, &gw, &[("x-session-id", "kept")], &conv.next(3)).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.backend.as_deref(), Some(other), "evicted: it moves");
}

/// A ZeroMQ peer written by hand (ZMTP 3.0, NULL mechanism): an engine's
/// publisher or replay socket that sends whatever the test says, including
/// what no engine would.
mod hostile {
    use std::io::Result;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    pub async fn handshake(s: &mut TcpStream, socket_type: &str) -> Result<()> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        s.write_all(&greeting).await?;
        let mut theirs = [0u8; 64];
        s.read_exact(&mut theirs).await?;
        let mut ready = vec![5u8];
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        ready.extend_from_slice(socket_type.as_bytes());
        frame(s, 0x04, &ready).await?;
        read_frame(s).await?;
        Ok(())
    }

    pub async fn read_frame(s: &mut TcpStream) -> Result<(u8, Vec<u8>)> {
        let flags = s.read_u8().await?;
        let len = match flags & 0x02 {
            0 => s.read_u8().await? as u64,
            _ => s.read_u64().await?,
        };
        let mut data = vec![0; len.min(1 << 20) as usize];
        s.read_exact(&mut data).await?;
        Ok((flags, data))
    }

    pub async fn frame(s: &mut TcpStream, flags: u8, data: &[u8]) -> Result<()> {
        match u8::try_from(data.len()) {
            Ok(len) => s.write_all(&[flags, len]).await?,
            Err(_) => {
                s.write_u8(flags | 0x02).await?;
                s.write_u64(data.len() as u64).await?;
            }
        }
        s.write_all(data).await
    }

    pub async fn message(s: &mut TcpStream, frames: &[&[u8]]) -> Result<()> {
        for (i, f) in frames.iter().enumerate() {
            frame(s, (i + 1 < frames.len()) as u8, f).await?;
        }
        Ok(())
    }

    /// A batch of one `BlockStored` event of `blocks` hashes from `first`,
    /// `pad` bytes larger (a field no decoder reads).
    pub fn batch(first: u64, blocks: u64, pad: usize) -> Vec<u8> {
        use rmpv::Value;
        let hashes = (first..first + blocks).map(Value::from).collect();
        let stored = Value::Map(vec![
            ("type".into(), "BlockStored".into()),
            ("block_hashes".into(), Value::Array(hashes)),
            ("parent_block_hash".into(), Value::Nil),
            ("block_size".into(), 16.into()),
            ("pad".into(), Value::Binary(vec![0; pad])),
        ]);
        let mut out = Vec::new();
        rmpv::encode::write_value(
            &mut out,
            &Value::Array(vec![0.0.into(), Value::Array(vec![stored])]),
        )
        .unwrap();
        out
    }
}

/// What the hostile publisher is told to send on its connection.
enum Order {
    /// A message of these frames.
    Message(Vec<Vec<u8>>),
    /// These bytes as they are, after which the gateway is expected to
    /// drop the connection: the publisher waits for that, then accepts the
    /// next.
    Raw(Vec<u8>),
}

/// An engine's event sockets that send what must not hurt the gateway: a
/// frame header claiming 2^62 bytes, a 100 MB batch, a replay of 20,000
/// batches of 16 KB, sequence numbers that go back. The gateway stays up,
/// requests through it meanwhile all succeed, its memory comes back within
/// 64 MiB, and a sequence that goes back is taken as a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_event_publisher_cannot_hurt_the_gateway() {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
    use std::sync::Arc;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;
    let sim = SimBackend::start("ev-0", &[]);
    let publisher = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let events = format!(
        "{{ endpoint: \"tcp://{}\", replay: \"tcp://{}\" }}",
        publisher.local_addr().unwrap(),
        router.local_addr().unwrap()
    );
    let (order, mut orders) = tokio::sync::mpsc::unbounded_channel::<Order>();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = publisher.accept().await.unwrap();
            if hostile::handshake(&mut s, "PUB").await.is_err() {
                continue;
            }
            // The subscription, then orders until one ends the connection.
            let _ = hostile::read_frame(&mut s).await;
            while let Some(o) = orders.recv().await {
                match o {
                    Order::Message(frames) => {
                        let frames: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
                        if hostile::message(&mut s, &frames).await.is_err() {
                            break;
                        }
                    }
                    Order::Raw(bytes) => {
                        let _ = s.write_all(&bytes).await;
                        // Until the gateway has closed it.
                        while hostile::read_frame(&mut s).await.is_ok() {}
                        break;
                    }
                }
            }
        }
    });
    // The replay socket: `replay_batches` batches of 16 KB from the asked
    // sequence on (once), then the end.
    let replay_batches = Arc::new(AtomicU64::new(0));
    let n = replay_batches.clone();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = router.accept().await.unwrap();
            let n = n.clone();
            tokio::spawn(async move {
                hostile::handshake(&mut s, "ROUTER").await?;
                hostile::read_frame(&mut s).await?;
                let (_, start) = hostile::read_frame(&mut s).await?;
                let start = i64::from_be_bytes(start.try_into().unwrap_or([0; 8]));
                let count = n.swap(0, Relaxed) as i64;
                for seq in start..start + count {
                    let b = hostile::batch(1_000_000 + seq as u64 * 4, 4, 16 * 1024);
                    hostile::message(&mut s, &[b"", &seq.to_be_bytes(), &b]).await?;
                }
                hostile::message(&mut s, &[b"", &(-1i64).to_be_bytes(), b""]).await
            });
        }
    });

    let tiers = [tier("default", true, &["qwen3-8b"], &[&sim])];
    let dir = tempfile::tempdir().unwrap();
    let (port, metrics_port) = (free_port(), free_port_pair());
    let extra = format!("{FAST_HEALTH}{}", affinity_yaml(600));
    let yaml = with_kv_events(
        config_yaml(port, metrics_port, dir.path(), &tiers, &extra),
        &[(sim.id.as_str(), sim.addr, events)],
    );
    let gw = Gateway::start_yaml(dir, port, metrics_port, &yaml).await;
    let kv = || async { kv_of(&gw, "ev-0").await };
    let live = |seq: i64, first: u64, blocks: u64| {
        let batch = hostile::batch(first, blocks, 0);
        Order::Message(vec![Vec::new(), seq.to_be_bytes().to_vec(), batch])
    };
    // Live batches 0..3 of 10 blocks each: the view is exact, 30 blocks.
    for seq in 0..3 {
        order.send(live(seq, seq as u64 * 10, 10)).unwrap();
    }
    wait_until("the first batches applied", || async {
        let v = kv().await;
        v["blocks_held"] == 30 && v["exact"] == true
    })
    .await;

    // Requests go on through the gateway while the publisher misbehaves.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (stop, url) = (stop.clone(), gw.url("/v1/chat/completions"));
        tokio::spawn(async move {
            let c = client();
            let (mut ok, mut failed) = (0, 0);
            for i in 0..100_000 {
                if stop.load(Relaxed) {
                    break;
                }
                let r = c.post(&url).json(&chat_body("qwen3-8b", i)).send().await;
                match r.map(|r| r.status().as_u16()) {
                    Ok(200) => ok += 1,
                    _ => failed += 1,
                }
            }
            (ok, failed)
        })
    };
    let rss_before = rss_kib(gw.pid());
    let lost = || async { kv().await["connections_lost"].as_u64().unwrap() };
    // A frame header claiming 2^62 bytes.
    let mut huge = vec![0x02];
    huge.extend_from_slice(&(1u64 << 62).to_be_bytes());
    order.send(Order::Raw(huge)).unwrap();
    wait_until("the connection dropped", || async { lost().await >= 1 }).await;
    wait_until("subscribed again", || async { kv().await["exact"] == true }).await;
    // The next connection starts with a replay of 20,000 batches of 16 KB,
    // once this one has dropped for a 100 MB batch.
    replay_batches.store(20_000, Relaxed);
    let mut big = vec![0x01, 0, 0x01, 8];
    big.extend_from_slice(&3i64.to_be_bytes());
    big.push(0x02);
    big.extend_from_slice(&(100u64 << 20).to_be_bytes());
    big.resize(big.len() + (100 << 20), 0x90);
    order.send(Order::Raw(big)).unwrap();
    wait_until("the connection dropped again", || async {
        lost().await >= 2
    })
    .await;
    wait_until("the replay applied", || async {
        let v = kv().await;
        v["exact"] == true && v["events"].as_u64().unwrap() >= 20_003
    })
    .await;
    stop.store(true, Relaxed);
    let (ok, failed) = load.await.unwrap();
    assert!(ok > 0);
    assert_eq!(failed, 0, "requests failed while the publisher misbehaved");
    let rss_after = rss_kib(gw.pid());
    eprintln!(
        "hostile publisher: {ok} requests answered, {failed} failed; gateway RSS {rss_before} KiB \
         before, {rss_after} KiB after; {} connections dropped",
        lost().await
    );
    assert!(
        rss_after < rss_before + 64 * 1024,
        "RSS {rss_before} KiB -> {rss_after} KiB"
    );

    // A sequence that goes back on a live connection: the engine restarted.
    let applied = kv().await["events"].as_u64().unwrap();
    order.send(live(20_000, 90_000_000, 5)).unwrap();
    wait_until("a live batch", || async {
        kv().await["events"].as_u64().unwrap() > applied
    })
    .await;
    // Back to 3, with nothing to replay: what it holds is not known.
    order.send(live(3, 80_000_000, 4)).unwrap();
    wait_until("the restart seen", || async {
        let v = kv().await;
        v["exact"] == false && v["blocks_held"] == 4
    })
    .await;
    // Back to 0: the engine's first batch again, and all it holds.
    order.send(live(0, 70_000_000, 7)).unwrap();
    wait_until("exact again", || async {
        let v = kv().await;
        v["exact"] == true && v["blocks_held"] == 7
    })
    .await;
    let r = chat(&client(), &gw, &[], &chat_body("qwen3-8b", 0)).await;
    assert_eq!(r.status, 200);
}

/// Toward an engine whose events are followed, `X-Session-ID` is the
/// gateway's: a keyless request's own (here the operator keys sessions by
/// another header) never reaches the engine, which would label its blocks
/// with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clients_own_session_id_never_labels_an_engines_blocks() {
    let sim = SimBackend::start("ev-0", EVENTS);
    let gw = gateway(
        &[&sim],
        "  session_headers: [x-agent-session]\n  prefix: { enabled: false }\n",
    )
    .await;
    let r = chat(
        &client(),
        &gw,
        &[("x-session-id", "client-label")],
        &chat_body("qwen3-8b", 0),
    )
    .await;
    assert_eq!(r.status, 200);
    let seen = sim.stats().await["last_headers"]["x-session-id"].clone();
    assert!(seen.is_null(), "the engine got {seen}");
    // A keyed request: the gateway's own name for its session.
    let r = chat(
        &client(),
        &gw,
        &[("x-agent-session", "s"), ("x-session-id", "client-label")],
        &chat_body("qwen3-8b", 1),
    )
    .await;
    assert_eq!(r.status, 200);
    let seen = sim.stats().await["last_headers"]["x-session-id"].clone();
    assert_eq!(seen.as_str().map(str::len), Some(32), "{seen}");
}
