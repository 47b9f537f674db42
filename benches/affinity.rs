//! Criterion benchmarks of the affinity core (no network):
//! - a hit on a live binding (lookup + lease + release),
//! - HRW choice over 8, 64 and 1,024 backends (equal and mixed weights),
//! - a first-placement decision with load signals (read every candidate's
//!   bindings and requests, then bounded-load HRW) over 8 and 1,024 backends,
//! - the candidate list every request builds from its tier (health checks,
//!   ejection, load signals of each backend) over 8 and 1,024 backends, with
//!   the per-backend read of Pingora's health registry it made before the
//!   verdicts were cached rebuilt beside it as the baseline,
//! - binding-table insert into, and a sweep pass of, a table holding 1M
//!   bindings, through the router,
//! - table memory per binding (printed),
//! - prefix-aware routing (`affinity.prefix`): a keyless chat request's
//!   decision — canonical prompt and its block hashes, the conversation's
//!   name, the index lookup at 8 backends, bounded-load placement and the
//!   index update — for 32 KiB and 256 KiB prompts, beside the JSON parse of
//!   the body's top level that routing reads it from; index memory per entry
//!   (printed).
//!
//! Run: `cargo bench --bench affinity`

use agent_gateway::affinity::hrw::{self, HrwHasher, KeyKind};
use agent_gateway::affinity::{Affinity, Candidate, Choice, SessionRef};
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use std::time::Duration;

fn fleet(h: &HrwHasher, n: u32, mixed: bool) -> Vec<Candidate> {
    (0..n)
        .map(|i| Candidate {
            slot: i,
            seed: h.backend_seed(&format!("vllm-{i}")),
            weight: if mixed { 1 + i % 4 } else { 1 },
            ..Default::default()
        })
        .collect()
}

fn bench_hit(c: &mut Criterion) {
    let h = HrwHasher::new("bench");
    let a = Affinity::new(1_000_000, Some(Duration::from_secs(1800)));
    let cands = fleet(&h, 8, false);
    let sessions: Vec<SessionRef> = (0..10_000)
        .map(|i| SessionRef::new(&h, KeyKind::Session, "default", &format!("session-{i}")))
        .collect();
    for s in &sessions {
        if let Some(Choice::Go(mut sel)) = a.select_backend(s, 0, &cands, false) {
            if let Some(l) = sel.lease.as_mut() {
                l.confirm();
            }
        }
    }
    let mut i = 0;
    c.bench_function("select_backend/hit (8 backends, 10k live bindings)", |b| {
        b.iter(|| {
            i = (i + 1) % sessions.len();
            match a.select_backend(&sessions[i], 0, &cands, false) {
                Some(Choice::Go(sel)) => {
                    debug_assert!(sel.affinity_hit);
                    black_box(sel.backend)
                }
                _ => unreachable!("every session is bound"),
            }
        })
    });
    c.bench_function("session key hashing (fingerprint + HRW hash)", |b| {
        b.iter(|| {
            black_box(SessionRef::new(
                &h,
                KeyKind::Session,
                "default",
                black_box("0b5c3f4e-8d2a-4c55-9a7e-3f1d2b6c7a90"),
            ))
        })
    });
}

fn bench_hrw(c: &mut Criterion) {
    let h = HrwHasher::new("bench");
    let mut g = c.benchmark_group("hrw_choose");
    for n in [8u32, 64, 1024] {
        for mixed in [false, true] {
            let cands = fleet(&h, n, mixed);
            let label = if mixed { "weighted" } else { "equal" };
            let mut k = 0u64;
            g.bench_with_input(BenchmarkId::new(label, n), &cands, |b, cands| {
                b.iter(|| {
                    k = k.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    black_box(hrw::choose(k, cands))
                })
            });
        }
    }
    g.finish();
}

fn bench_placement(c: &mut Criterion) {
    use agent_gateway::affinity::placement::{self, FirstKind, LoadMeasure};
    let h = HrwHasher::new("bench");
    let a = Affinity::new(100_000, Some(Duration::from_secs(1800)));
    let mut g = c.benchmark_group("placement_with_load");
    for n in [8u32, 1024] {
        let mut cands = fleet(&h, n, true);
        for (i, c) in cands.iter_mut().enumerate() {
            c.in_flight = (i % 7) as u64;
            c.engine_requests = (i % 5) as u64;
            c.queued_tokens = (i % 3) as u64 * 1_000;
            c.prefill_us_per_token = 50.0;
            c.head_ms = (i % 4) as u64 * 10;
        }
        // Live bindings spread over the fleet, so the load reads are real.
        for i in 0..20_000u32 {
            let s = SessionRef::new(&h, KeyKind::Session, "default", &format!("pre-{i}"));
            let _ = a.select_backend(&s, 0, &cands, true);
        }
        // Bounded HRW as configured by default (queue-aware), the same without
        // the queues (the baseline of what queue-awareness costs), least loaded.
        let variants = [
            ("BoundedHrw", FirstKind::BoundedHrw, true),
            ("BoundedHrw_queue_blind", FirstKind::BoundedHrw, false),
            ("LeastLoaded", FirstKind::LeastLoaded, false),
        ];
        for (name, kind, queue_aware) in variants {
            let bounded = placement::bounded_hrw::BoundedHrw {
                balance_factor: 1.1,
                speed_aware: false,
                queue_aware,
                prior_us_per_token: 100.0,
            };
            let first = placement::build(kind, bounded);
            let mut k = 0u64;
            g.bench_with_input(BenchmarkId::new(name, n), &cands, |b, cands| {
                b.iter(|| {
                    k = k.wrapping_add(0x9e37_79b9_7f4a_7c15);
                    let load: Vec<u64> = cands
                        .iter()
                        .map(|c| LoadMeasure::Combined.of(c, a.backend_bindings(c.slot)))
                        .collect();
                    black_box(first.place(k, cands, &load))
                })
            });
        }
    }
    g.finish();
}

fn bench_candidates(c: &mut Criterion) {
    use agent_gateway::config::Config;
    use agent_gateway::metrics::Metrics;
    use agent_gateway::upstream::{health, Routing, Slots};
    use futures_util::FutureExt;
    use pingora_load_balancing::{discovery::Static, Backends};
    use std::sync::Arc;
    let mut g = c.benchmark_group("candidates");
    for n in [8usize, 1024] {
        let backends: String = (0..n)
            .map(|i| {
                format!(
                    "      - {{ id: vllm-{i}, addr: \"127.0.0.1:{}\" }}\n",
                    20_000 + i
                )
            })
            .collect();
        let yaml = format!(
            "tiers:\n  default:\n    default: true\n    backends:\n{backends}affinity: {{ hash_key: 7f45881d0a53d8a0c98655a16835aef433ef3ea968cb67815fdb64798d7d55a4 }}\n"
        );
        let config = Arc::new(Config::from_yaml(&yaml).expect("a valid bench config"));
        let check = health::ReloadableCheck::new(&config);
        let (registry, _service) = health::registry_and_service(&config.health, &check);
        let routing = Routing::build(
            Arc::clone(&config),
            &Slots::default(),
            &registry,
            &Metrics::new(),
        )
        .expect("one tier");
        let tier = Arc::clone(routing.default_tier());
        g.bench_with_input(BenchmarkId::new("cached health", n), &tier, |b, t| {
            b.iter(|| black_box(t.candidates(&[])))
        });
        // The same list plus what it cost before: each backend's verdict read
        // from a view of the same backends over the same registry.
        let view = Backends::new_with_health_registry(
            Static::new(tier.backends.iter().map(|b| b.lb.clone()).collect()),
            Arc::clone(&registry),
        );
        let _ = view.update(|_| {}).now_or_never();
        g.bench_with_input(
            BenchmarkId::new("registry read per backend (before)", n),
            &tier,
            |b, t| {
                b.iter(|| {
                    let ready = t.backends.iter().filter(|b| view.ready(&b.lb)).count();
                    black_box((ready, t.candidates(&[])))
                })
            },
        );
    }
    g.finish();
}

/// The binding table, reached as the proxy reaches it: through the router
/// (`Affinity::select_backend` with one candidate, so that placement is
/// trivial; the lease confirmed and dropped, as a request's end does).
fn bench_table(c: &mut Criterion) {
    const N: usize = 1_000_000;
    let h = HrwHasher::new("bench");
    let one = fleet(&h, 1, false);
    let key = |i: u64| (i as u128).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
    let bind = |a: &std::sync::Arc<Affinity>, i: u64| {
        if let Some(Choice::Go(mut sel)) =
            a.select_backend(&SessionRef::conversation(key(i)), 0, &one, true)
        {
            if let Some(l) = sel.lease.as_mut() {
                l.confirm();
            }
        }
    };
    let a = Affinity::new(N, Some(Duration::from_secs(1800)));
    for i in 0..N as u64 {
        bind(&a, i);
    }
    let live = a.bindings().len();
    println!(
        "binding table: {live} bindings, ~{} heap bytes per binding",
        a.table_heap_bytes() / live.max(1)
    );
    let mut i = N as u64;
    c.bench_function("table/insert into a full 1M table (evicts LRU)", |b| {
        b.iter(|| {
            i += 1;
            bind(&a, i);
        })
    });
    c.bench_function("table/sweep one pass of 1M expired", |b| {
        b.iter_batched(
            || {
                let a = Affinity::new(N, Some(Duration::from_millis(1)));
                for i in 0..N as u64 {
                    bind(&a, i);
                }
                std::thread::sleep(Duration::from_millis(5));
                a
            },
            |a| black_box(a.sweep()),
            criterion::BatchSize::PerIteration,
        )
    });
}

/// A chat body of about `bytes`: an 8 KiB system prompt every conversation
/// shares, then conversation `c`'s turns.
fn chat_body(c: usize, bytes: usize) -> Vec<u8> {
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "Follow the repository's conventions. ".repeat(230)}),
    ];
    let mut t = 0;
    while serde_json::to_vec(&messages).unwrap().len() < bytes {
        let text =
            format!("conversation {c} turn {t}: ") + &"read the file and run the tests ".repeat(30);
        let role = if t % 2 == 0 { "user" } else { "assistant" };
        messages.push(serde_json::json!({"role": role, "content": text}));
        t += 1;
    }
    serde_json::to_vec(
        &serde_json::json!({"model": "qwen3-8b", "messages": messages, "stream": true}),
    )
    .unwrap()
}

fn bench_prefix(c: &mut Criterion) {
    use agent_gateway::affinity::placement::{bounded_hrw::BoundedHrw, FirstPlacement};
    use agent_gateway::affinity::prefix::{Prefix, PrefixConfig};
    use agent_gateway::affinity::session::BodyProbe;
    let h = HrwHasher::new("bench");
    let prefix = Prefix::new(
        &PrefixConfig::default(),
        h.prefix_seed(),
        Duration::from_secs(1800),
    );
    let cands = fleet(&h, 8, false);
    let place = BoundedHrw {
        balance_factor: 1.0,
        speed_aware: false,
        queue_aware: true,
        prior_us_per_token: 100.0,
    };
    // An index holding 500 other conversations of 32 KiB, spread over the fleet.
    for other in 0..500 {
        let body = chat_body(10_000 + other, 32 << 10);
        let probe = BodyProbe::parse(&body).unwrap();
        let mut p = prefix
            .read("default", Some("qwen3-8b"), true, false, &probe)
            .unwrap();
        p.routed(&prefix, (other % 8) as u32, true);
    }
    let mut g = c.benchmark_group("prefix_decision");
    for kib in [32usize, 256] {
        let body = chat_body(kib, kib << 10);
        let probe = BodyProbe::parse(&body).unwrap();
        // Its conversation's earlier turn is held by backend 3.
        let earlier = chat_body(kib, (kib << 10) * 3 / 4);
        let earlier_probe = BodyProbe::parse(&earlier).unwrap();
        let mut e = prefix
            .read("default", Some("qwen3-8b"), true, false, &earlier_probe)
            .unwrap();
        e.routed(&prefix, 3, true);
        // `decide_messages`: the same body as an Anthropic Messages request,
        // whose prompt is searched for `cache_control` markers.
        for (name, markers) in [("decide", false), ("decide_messages", true)] {
            g.bench_function(BenchmarkId::new(name, format!("{kib} KiB")), |b| {
                b.iter(|| {
                    let mut p = prefix
                        .read("default", Some("qwen3-8b"), true, markers, &probe)
                        .unwrap();
                    let key = black_box(p.conversation().map_or(0, |c| c.id as u64));
                    let mut cands = cands.clone();
                    prefix.fill_probation(&mut cands);
                    p.look_up(&prefix, &mut cands);
                    let load = [4u64; 8];
                    let i = place.place(key, &cands, &load).unwrap();
                    debug_assert_eq!(cands[i].slot, 3);
                    black_box(p.routed(&prefix, cands[i].slot, true))
                })
            });
        }
        // The next turn of a conversation: each iteration's setup routes its
        // earlier turn again (an end to continue), the timed part continues it.
        g.bench_function(BenchmarkId::new("continue", format!("{kib} KiB")), |b| {
            b.iter_batched(
                || {
                    let mut e = prefix
                        .read("default", Some("qwen3-8b"), true, false, &earlier_probe)
                        .unwrap();
                    e.routed(&prefix, 3, false);
                },
                |()| {
                    let mut p = prefix
                        .read("default", Some("qwen3-8b"), true, false, &probe)
                        .unwrap();
                    let c = p.conversation().unwrap();
                    let key = black_box(c.id as u64);
                    let continued = c.continues.map(|c| c.slot);
                    let mut cands = cands.clone();
                    prefix.fill_probation(&mut cands);
                    p.look_up(&prefix, &mut cands);
                    let load = [4u64; 8];
                    let i = place.place(key, &cands, &load).unwrap();
                    black_box(p.routed(&prefix, cands[i].slot, true));
                    continued
                },
                criterion::BatchSize::PerIteration,
            )
        });
        // What was timed is a continuation (checked outside the timing, on
        // an index of its own: the benches run before it, or filtered out,
        // leave the shared one in any state).
        let fresh = Prefix::new(
            &PrefixConfig::default(),
            h.prefix_seed(),
            Duration::from_secs(1800),
        );
        let mut e = fresh
            .read("default", Some("qwen3-8b"), true, false, &earlier_probe)
            .unwrap();
        e.routed(&fresh, 3, false);
        let p = fresh
            .read("default", Some("qwen3-8b"), true, false, &probe)
            .unwrap();
        assert_eq!(
            p.conversation().and_then(|c| c.continues).map(|c| c.slot),
            Some(3)
        );
        g.bench_function(
            BenchmarkId::new("body_top_level_parse", format!("{kib} KiB")),
            |b| b.iter(|| black_box(BodyProbe::parse(black_box(&body)).is_some())),
        );
    }
    g.finish();
    // Memory an entry takes once the index is full (its maps are made at
    // their full size up front): an 8 MiB index filled past its cap.
    let full = agent_gateway::affinity::prefix::index::PrefixIndex::new(8 << 20, 600_000);
    for salt in 0..200_000u64 {
        let c: Vec<u64> = (0..4).map(|i| hrw::mix(salt << 8 | i)).collect();
        full.record(&c, (salt % 8) as u32, 1, true);
    }
    println!(
        "prefix index, full: {} entries in {} heap bytes ({:.0} bytes an entry; {} at most by construction)",
        full.len(),
        full.heap_bytes(),
        full.heap_bytes() as f64 / full.len().max(1) as f64,
        agent_gateway::affinity::prefix::index::ENTRY_BYTES
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = bench_hit, bench_hrw, bench_placement, bench_candidates, bench_table, bench_prefix
}
criterion_main!(benches);
