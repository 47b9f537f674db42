//! Criterion benchmark of the response path's usage reading (no network):
//! keeping the tail of a long streamed (SSE) response so its final `usage`
//! event can be read, against the baseline it replaced — cutting the kept tail
//! back to 16 KB on every chunk, which moved up to 16 KB per chunk once a
//! stream passed 16 KB.
//!
//! Run: `cargo bench --bench response`

use agent_gateway::proxy::response::{UsageScanner, USAGE_TAIL_BYTES};
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion};
use std::time::Duration;

/// The replaced scanner's push: the window cut back on every chunk.
fn push_cutting_every_chunk(tail: &mut Vec<u8>, chunk: &[u8]) {
    if chunk.len() >= USAGE_TAIL_BYTES {
        tail.clear();
        tail.extend_from_slice(&chunk[chunk.len() - USAGE_TAIL_BYTES..]);
        return;
    }
    let overflow = (tail.len() + chunk.len()).saturating_sub(USAGE_TAIL_BYTES);
    if overflow > 0 {
        tail.drain(..overflow);
    }
    tail.extend_from_slice(chunk);
}

fn bench_usage_tail(c: &mut Criterion) {
    // One SSE event per token, ~150 bytes each, as engines stream them.
    let event = format!(
        "data: {{\"choices\":[{{\"delta\":{{\"content\":\"{}\"}}}}]}}\n\n",
        "x".repeat(90)
    );
    let mut g = c.benchmark_group("usage_tail_sse");
    for tokens in [100usize, 2_000] {
        let bytes = tokens * event.len();
        g.bench_with_input(
            BenchmarkId::new("window_cut_when_twice_full", bytes),
            &tokens,
            |b, &n| {
                b.iter(|| {
                    let mut s = UsageScanner::default();
                    for _ in 0..n {
                        s.push(black_box(event.as_bytes()));
                    }
                    black_box(s.kept())
                })
            },
        );
        g.bench_with_input(
            BenchmarkId::new("baseline_cut_every_chunk", bytes),
            &tokens,
            |b, &n| {
                b.iter(|| {
                    let mut tail = Vec::new();
                    for _ in 0..n {
                        push_cutting_every_chunk(&mut tail, black_box(event.as_bytes()));
                    }
                    black_box(tail.len())
                })
            },
        );
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(500));
    targets = bench_usage_tail
}
criterion_main!(benches);
