//! What a load run measured, as tables, JSON and an SVG chart.

use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write;
use std::time::Duration;

/// One request as the client saw it.
#[derive(Debug, Clone)]
pub struct TurnRecord {
    pub session: usize,
    pub parent_session: Option<usize>,
    pub turn: usize,
    pub status: u16,
    pub backend: Option<String>,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub ttft: Duration,
    pub e2e: Duration,
    pub prefill_us: Option<u64>,
    /// The gateway's verdict (`x-agent-serve-affinity-hit`), when it sent one.
    pub affinity_hit: Option<bool>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
}

fn percentiles(mut v: Vec<Duration>) -> Percentiles {
    v.sort();
    let at = |q: f64| {
        if v.is_empty() {
            return 0.0;
        }
        // Nearest-rank percentile.
        let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
        v[rank - 1].as_secs_f64() * 1000.0
    };
    Percentiles {
        p50_ms: at(0.50),
        p95_ms: at(0.95),
        p99_ms: at(0.99),
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct LocalityRow {
    pub turn: usize,
    pub backend: Option<String>,
    pub input_tokens: u64,
    pub cached_tokens: u64,
    pub prefill_ms: Option<f64>,
    pub ttft_ms: f64,
}

/// One of a run's slowest requests (`Report::slowest`).
#[derive(Debug, Clone, Serialize)]
pub struct SlowRequest {
    pub session: usize,
    /// Turn number, from 1.
    pub turn: usize,
    pub backend: Option<String>,
    pub input_tokens: u64,
    pub cached_tokens: u64,
    pub affinity_hit: Option<bool>,
    pub e2e_ms: f64,
}

/// How many of a run's slowest requests a report lists.
const SLOWEST: usize = 10;

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub label: String,
    pub requests: usize,
    pub errors: usize,
    /// Requests the gateway reported as affinity hits (reused a live binding).
    pub affinity_hit_rate: f64,
    /// Turns ≥ 2 that landed on the previous turn's backend.
    pub same_backend_rate: f64,
    /// Distinct backends that served a conversation's turns, on average
    /// (1.00: every conversation stayed on one replica).
    pub replicas_per_conversation: f64,
    /// Σ cached prompt tokens / Σ prompt tokens.
    pub prefix_cache_hit_rate: f64,
    /// The same over conversations' later turns (from the second on):
    /// what a warm turn found cached.
    pub warm_prefix_cache_hit_rate: f64,
    /// The same over conversations' first turns: what a new conversation
    /// found cached of an opening others sent before it.
    pub first_prefix_cache_hit_rate: f64,
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub ttft: Percentiles,
    /// Every answered request's time to first token, ms, in ascending
    /// order: for pooling several runs' tails (one run's p99 of a few dozen
    /// requests is its slowest one).
    pub ttfts_ms: Vec<f64>,
    pub e2e: Percentiles,
    /// End-to-end latency of the requests the gateway called affinity hits,
    /// and of the rest (first turns, rebinds): in a fleet a miss is what asks
    /// the shared store, a hit at steady state asks nothing.
    pub e2e_hit: Percentiles,
    pub e2e_miss: Percentiles,
    pub elapsed_s: f64,
    pub requests_per_s: f64,
    pub per_backend: BTreeMap<String, usize>,
    /// Busiest backend's requests / mean requests per backend.
    pub balance_max_over_mean: f64,
    /// Share of subagent turns served by the parent's backend (None: no subagents).
    pub subagent_colocation: Option<f64>,
    pub locality: Vec<LocalityRow>,
    /// The run's slowest requests, slowest first: what its tail is made of.
    pub slowest: Vec<SlowRequest>,
    /// Requests the gateway re-sent on a fresh connection
    /// (`agentserve_upstream_retries_total`), when the run went through one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_retries: Option<u64>,
    /// Times the gateway's prefix index was corrected by what the engines
    /// reported (`agentserve_prefix_index_corrections_total`), when read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index_corrections: Option<u64>,
}

impl Report {
    pub fn new(label: String, records: Vec<TurnRecord>, elapsed: Duration, show: usize) -> Report {
        let ok: Vec<&TurnRecord> = records.iter().filter(|r| r.status == 200).collect();
        let errors = records.len() - ok.len();

        // Affinity hits as the client sees them: same backend as the previous turn.
        let mut by_session: HashMap<usize, Vec<&TurnRecord>> = HashMap::new();
        for r in &ok {
            by_session.entry(r.session).or_default().push(r);
        }
        let replicas_per_conversation = if by_session.is_empty() {
            0.0
        } else {
            let distinct = by_session.values().map(|turns| {
                turns
                    .iter()
                    .filter_map(|r| r.backend.as_deref())
                    .collect::<std::collections::HashSet<_>>()
                    .len()
            });
            distinct.sum::<usize>() as f64 / by_session.len() as f64
        };
        let (mut later, mut same) = (0usize, 0usize);
        for turns in by_session.values_mut() {
            turns.sort_by_key(|r| r.turn);
            for pair in turns.windows(2) {
                later += 1;
                same += (pair[0].backend.is_some() && pair[0].backend == pair[1].backend) as usize;
            }
        }

        let prompt: u64 = ok.iter().map(|r| r.prompt_tokens).sum();
        let cached: u64 = ok.iter().map(|r| r.cached_tokens).sum();
        let (first_prompt, first_cached) = ok
            .iter()
            .filter(|r| r.turn == 0)
            .fold((0u64, 0u64), |(p, c), r| {
                (p + r.prompt_tokens, c + r.cached_tokens)
            });
        let warm = ok.iter().filter(|r| r.turn > 0);
        let (warm_prompt, warm_cached) = warm.fold((0u64, 0u64), |(p, c), r| {
            (p + r.prompt_tokens, c + r.cached_tokens)
        });
        let mut per_backend = BTreeMap::new();
        for r in &ok {
            if let Some(b) = &r.backend {
                *per_backend.entry(b.clone()).or_insert(0) += 1;
            }
        }
        let balance = if per_backend.is_empty() {
            0.0
        } else {
            let max = *per_backend.values().max().unwrap_or(&0) as f64;
            let mean = per_backend.values().sum::<usize>() as f64 / per_backend.len() as f64;
            max / mean
        };

        let parent_backend = |p: usize| {
            by_session
                .get(&p)
                .and_then(|t| t.first())
                .and_then(|r| r.backend.clone())
        };
        let children: Vec<&&TurnRecord> =
            ok.iter().filter(|r| r.parent_session.is_some()).collect();
        let subagent_colocation = (!children.is_empty()).then(|| {
            let co = children
                .iter()
                .filter(|r| {
                    r.backend.is_some()
                        && r.backend == parent_backend(r.parent_session.unwrap_or(0))
                })
                .count();
            co as f64 / children.len() as f64
        });

        let locality = by_session
            .get(&show)
            .map(|turns| {
                turns
                    .iter()
                    .map(|r| LocalityRow {
                        turn: r.turn + 1,
                        backend: r.backend.clone(),
                        input_tokens: r.prompt_tokens,
                        cached_tokens: r.cached_tokens,
                        prefill_ms: r.prefill_us.map(|us| us as f64 / 1000.0),
                        ttft_ms: r.ttft.as_secs_f64() * 1000.0,
                    })
                    .collect()
            })
            .unwrap_or_default();

        let mut by_e2e = ok.clone();
        by_e2e.sort_by_key(|r| std::cmp::Reverse(r.e2e));
        let slowest = by_e2e
            .iter()
            .take(SLOWEST)
            .map(|r| SlowRequest {
                session: r.session,
                turn: r.turn + 1,
                backend: r.backend.clone(),
                input_tokens: r.prompt_tokens,
                cached_tokens: r.cached_tokens,
                affinity_hit: r.affinity_hit,
                e2e_ms: r.e2e.as_secs_f64() * 1000.0,
            })
            .collect();

        Report {
            label,
            requests: records.len(),
            errors,
            affinity_hit_rate: if ok.is_empty() {
                0.0
            } else {
                ok.iter().filter(|r| r.affinity_hit == Some(true)).count() as f64 / ok.len() as f64
            },
            replicas_per_conversation,
            same_backend_rate: if later == 0 {
                0.0
            } else {
                same as f64 / later as f64
            },
            prefix_cache_hit_rate: if prompt == 0 {
                0.0
            } else {
                cached as f64 / prompt as f64
            },
            first_prefix_cache_hit_rate: first_cached as f64 / first_prompt.max(1) as f64,
            warm_prefix_cache_hit_rate: if warm_prompt == 0 {
                0.0
            } else {
                warm_cached as f64 / warm_prompt as f64
            },
            prompt_tokens: prompt,
            cached_tokens: cached,
            ttft: percentiles(ok.iter().map(|r| r.ttft).collect()),
            ttfts_ms: {
                let mut v: Vec<f64> = ok.iter().map(|r| r.ttft.as_secs_f64() * 1000.0).collect();
                v.sort_by(f64::total_cmp);
                v
            },
            e2e: percentiles(ok.iter().map(|r| r.e2e).collect()),
            e2e_hit: percentiles(
                ok.iter()
                    .filter(|r| r.affinity_hit == Some(true))
                    .map(|r| r.e2e)
                    .collect(),
            ),
            e2e_miss: percentiles(
                ok.iter()
                    .filter(|r| r.affinity_hit != Some(true))
                    .map(|r| r.e2e)
                    .collect(),
            ),
            elapsed_s: elapsed.as_secs_f64(),
            requests_per_s: records.len() as f64 / elapsed.as_secs_f64().max(1e-9),
            per_backend,
            balance_max_over_mean: balance,
            subagent_colocation,
            locality,
            slowest,
            upstream_retries: None,
            index_corrections: None,
        }
    }
}

/// Side-by-side comparison of runs.
/// What the columns of [`comparison_table`] mean.
pub const COLUMNS: &str = "\
Columns: affinity hit = turns sent to the backend their session was bound to (from the gateway's
x-agent-serve-affinity-hit); same backend as last turn = turns served where the conversation's
previous turn was; replicas per conversation = distinct replicas that served one conversation
(1.00: never moved); prefix-cache hit = share of prompt tokens the replicas found cached (the
engines' own count: what affinity saves); TTFT / E2E = time to first token / to the whole answer,
median and 99th percentile; req/s = throughput; balance = busiest replica's requests / the mean
(1.00: even). \"ideal\" is one replica whose cache never evicts: the hit rate affinity approaches;
its latency and throughput are one replica's compute, not three, so it is slower.
";

pub fn comparison_table(reports: &[Report]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| run | requests | errors | affinity hit | same backend as last turn | replicas per conversation | prefix-cache hit | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | req/s | balance |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for r in reports {
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.1}% | {:.1}% | {:.2} | {:.1}% | {:.0} ms | {:.0} ms | {:.0} ms | {:.0} ms | {:.1} | {:.2} |",
            r.label,
            r.requests,
            r.errors,
            r.affinity_hit_rate * 100.0,
            r.same_backend_rate * 100.0,
            r.replicas_per_conversation,
            r.prefix_cache_hit_rate * 100.0,
            r.ttft.p50_ms,
            r.ttft.p99_ms,
            r.e2e.p50_ms,
            r.e2e.p99_ms,
            r.requests_per_s,
            r.balance_max_over_mean,
        );
    }
    s
}

/// Several variants, each run on the same populations of session ids:
/// `runs[v][r]` is variant `v` on population `r`. Means per variant, and the
/// mean of its per-population ratios against variant 0 (the baseline ran on
/// the same ids, so the hash's luck cancels out of each ratio).
pub fn repeats_table(variants: &[&str], runs: &[Vec<Report>]) -> String {
    let mean = |xs: &mut dyn Iterator<Item = f64>| {
        let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
        sum / n.max(1) as f64
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| variant | runs | errors | balance | prefix-cache hit | req/s | E2E p99 | req/s × first | E2E p99 × first |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let Some(base) = runs.first() else {
        return s;
    };
    for (name, rs) in variants.iter().zip(runs) {
        let pairs = || rs.iter().zip(base);
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {:.2} | {:.1}% | {:.1} | {:.0} ms | {:.2} | {:.2} |",
            rs.len(),
            rs.iter().map(|r| r.errors).sum::<usize>(),
            mean(&mut rs.iter().map(|r| r.balance_max_over_mean)),
            mean(&mut rs.iter().map(|r| r.prefix_cache_hit_rate)) * 100.0,
            mean(&mut rs.iter().map(|r| r.requests_per_s)),
            mean(&mut rs.iter().map(|r| r.e2e.p99_ms)),
            mean(&mut pairs().map(|(r, b)| r.requests_per_s / b.requests_per_s.max(1e-9))),
            mean(&mut pairs().map(|(r, b)| r.e2e.p99_ms / b.e2e.p99_ms.max(1e-9))),
        );
    }
    s
}

/// Variants side by side, means over repeats, each against the first
/// variant's run on the same population: throughput, balance (busiest
/// backend over the mean), prefix-cache hit, same replica turn to turn,
/// latency and how often the engines corrected the prefix index.
/// Chains of stored responses: errors (a misplaced turn is a 404), replicas
/// per conversation, and what warm turns found cached, against the first.
pub fn chain_table(variants: &[&str], runs: &[Vec<Report>]) -> String {
    let mean = |xs: &mut dyn Iterator<Item = f64>| {
        let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
        sum / n.max(1) as f64
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| variant | requests | errors | replicas/conv | warm turns' cached share | × first | req/s | E2E p99 |"
    );
    let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
    let Some(base) = runs.first() else {
        return s;
    };
    for (name, rs) in variants.iter().zip(runs) {
        let warm = |r: &Report| r.warm_prefix_cache_hit_rate;
        let _ = writeln!(
            s,
            "| {name} | {} | {} | {:.2} | {:.3} | {:.3} | {:.1} | {:.0} ms |",
            rs.iter().map(|r| r.requests).sum::<usize>(),
            rs.iter().map(|r| r.errors).sum::<usize>(),
            mean(&mut rs.iter().map(|r| r.replicas_per_conversation)),
            mean(&mut rs.iter().map(warm)),
            mean(
                &mut rs
                    .iter()
                    .zip(base)
                    .map(|(r, b)| warm(r) / warm(b).max(1e-9))
            ),
            mean(&mut rs.iter().map(|r| r.requests_per_s)),
            mean(&mut rs.iter().map(|r| r.e2e.p99_ms)),
        );
    }
    s
}

pub fn keyless_table(variants: &[&str], runs: &[Vec<Report>]) -> String {
    let mean = |xs: &mut dyn Iterator<Item = f64>| {
        let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
        sum / n.max(1) as f64
    };
    let mut s = String::new();
    let _ = writeln!(
        s,
        "| variant | errors | req/s | × first | max/mean | prefix-cache hit | × first | first turns' hit | same replica | replicas/conv | E2E p50 | E2E p99 | p99 × first | corrections |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    let Some(base) = runs.first() else {
        return s;
    };
    for (name, rs) in variants.iter().zip(runs) {
        let pairs = || rs.iter().zip(base);
        let ratio =
            |f: &dyn Fn(&Report) -> f64| mean(&mut pairs().map(|(r, b)| f(r) / f(b).max(1e-9)));
        let _ = writeln!(
            s,
            "| {name} | {} | {:.1} | {:.2} | {:.2} | {:.3} | {:.3} | {:.3} | {:.3} | {:.2} | {:.0} ms | {:.0} ms | {:.2} | {} |",
            rs.iter().map(|r| r.errors).sum::<usize>(),
            mean(&mut rs.iter().map(|r| r.requests_per_s)),
            ratio(&|r| r.requests_per_s),
            mean(&mut rs.iter().map(|r| r.balance_max_over_mean)),
            mean(&mut rs.iter().map(|r| r.prefix_cache_hit_rate)),
            ratio(&|r| r.prefix_cache_hit_rate),
            mean(&mut rs.iter().map(|r| r.first_prefix_cache_hit_rate)),
            mean(&mut rs.iter().map(|r| r.same_backend_rate)),
            mean(&mut rs.iter().map(|r| r.replicas_per_conversation)),
            mean(&mut rs.iter().map(|r| r.e2e.p50_ms)),
            mean(&mut rs.iter().map(|r| r.e2e.p99_ms)),
            ratio(&|r| r.e2e.p99_ms),
            rs.iter()
                .map(|r| r.index_corrections.unwrap_or(0))
                .sum::<u64>(),
        );
    }
    s
}

/// One run in full: summary, per-backend load, subagents, locality table.
pub fn detail(r: &Report) -> String {
    let mut s = comparison_table(std::slice::from_ref(r));
    let _ = writeln!(s);
    let loads: Vec<String> = r
        .per_backend
        .iter()
        .map(|(b, n)| format!("{b}: {n}"))
        .collect();
    let _ = writeln!(s, "per-backend requests: {}", loads.join(", "));
    let _ = writeln!(
        s,
        "E2E by the gateway's verdict: hits p50 {:.2} ms / p99 {:.2} ms, misses p50 {:.2} ms / p99 {:.2} ms",
        r.e2e_hit.p50_ms, r.e2e_hit.p99_ms, r.e2e_miss.p50_ms, r.e2e_miss.p99_ms
    );
    if let Some(c) = r.subagent_colocation {
        let _ = writeln!(
            s,
            "subagent co-location (child turns on the parent's backend): {:.1}%",
            c * 100.0
        );
    }
    if !r.locality.is_empty() {
        let _ = writeln!(s, "\nper-turn locality of one session:\n");
        let _ = writeln!(
            s,
            "| turn | backend | input tokens | cached tokens | prefill ms | TTFT ms |"
        );
        let _ = writeln!(s, "|---:|---|---:|---:|---:|---:|");
        for row in &r.locality {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {:.1} |",
                row.turn,
                row.backend.as_deref().unwrap_or("-"),
                row.input_tokens,
                row.cached_tokens,
                row.prefill_ms
                    .map_or("-".to_string(), |m| format!("{m:.1}")),
                row.ttft_ms,
            );
        }
    }
    s
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// One measure of the chart: its heading, colour, value of a run and how
/// the value is printed.
struct Measure {
    heading: &'static str,
    better: &'static str,
    color: &'static str,
    value: fn(&Report) -> f64,
    decimals: usize,
}

const MEASURES: [Measure; 4] = [
    Measure {
        heading: "prefix-cache hit, %",
        better: "higher is better",
        color: "#2b6cb0",
        value: |r| r.prefix_cache_hit_rate * 100.0,
        decimals: 1,
    },
    Measure {
        heading: "TTFT p50, ms",
        better: "lower is better",
        color: "#dd6b20",
        value: |r| r.ttft.p50_ms,
        decimals: 0,
    },
    Measure {
        heading: "TTFT p99, ms",
        better: "lower is better",
        color: "#c53030",
        value: |r| r.ttft.p99_ms,
        decimals: 0,
    },
    Measure {
        heading: "throughput, req/s",
        better: "higher is better",
        color: "#38a169",
        value: |r| r.requests_per_s,
        decimals: 1,
    },
];

/// The runs as a chart that reads at a glance: one row per run (its name
/// beside it, no legend to match colours with), one panel per measure, each
/// panel's bars on their own scale from zero with the value at the bar's
/// end. Runs named `group: variant` are grouped under the group's name.
pub fn svg(reports: &[Report], title: &str) -> String {
    const ROW: f64 = 22.0;
    const PANEL: f64 = 190.0;
    const GAP: f64 = 24.0;
    let split = |label: &str| match label.split_once(": ") {
        Some((group, rest)) => (group.to_string(), rest.to_string()),
        None => (String::new(), label.to_string()),
    };
    // Rows: a group's heading (when it changes), then its runs.
    let mut rows: Vec<(Option<String>, Option<&Report>)> = Vec::new();
    let mut group = None;
    for r in reports {
        let (g, _) = split(&r.label);
        if !g.is_empty() && group.as_ref() != Some(&g) {
            rows.push((Some(g.clone()), None));
        }
        group = Some(g);
        rows.push((None, Some(r)));
    }
    let label_w = reports
        .iter()
        .map(|r| split(&r.label).1.chars().count())
        .max()
        .unwrap_or(10)
        .clamp(10, 70) as f64
        * 6.6
        + 24.0;
    let top = 78.0;
    let w = label_w + MEASURES.len() as f64 * (PANEL + GAP);
    let h = top + rows.len() as f64 * ROW + 16.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="12" y="24" font-size="16" font-weight="bold">{}</text>"#,
        esc(title)
    );
    for (m, measure) in MEASURES.iter().enumerate() {
        let x0 = label_w + m as f64 * (PANEL + GAP);
        let max = reports
            .iter()
            .map(|r| (measure.value)(r))
            .filter(|v| v.is_finite())
            .fold(0.0, f64::max);
        let _ = writeln!(
            s,
            r#"<text x="{x0:.1}" y="{}" font-weight="bold">{}</text>"#,
            top - 30.0,
            esc(measure.heading)
        );
        let _ = writeln!(
            s,
            r#"<text x="{x0:.1}" y="{}" fill="dimgray" font-size="11">{}</text>"#,
            top - 15.0,
            measure.better
        );
        let _ = writeln!(
            s,
            r#"<line x1="{x0:.1}" y1="{}" x2="{x0:.1}" y2="{}" stroke="darkgray"/>"#,
            top - 6.0,
            top + rows.len() as f64 * ROW
        );
        for (i, (_, run)) in rows.iter().enumerate() {
            let Some(r) = run else { continue };
            let v = (measure.value)(r);
            let y = top + i as f64 * ROW;
            // Room for the printed value after the longest bar.
            let len = if max > 0.0 && v.is_finite() {
                (v / max).clamp(0.0, 1.0) * (PANEL - 48.0)
            } else {
                0.0
            };
            let _ = writeln!(
                s,
                r#"<rect x="{x0:.1}" y="{:.1}" width="{len:.1}" height="{:.1}" fill="{}"><title>{}: {v:.2}</title></rect>"#,
                y + 3.0,
                ROW - 8.0,
                measure.color,
                esc(&r.label)
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" font-size="11">{:.*}</text>"#,
                x0 + len + 4.0,
                y + ROW - 7.0,
                measure.decimals,
                v
            );
        }
    }
    for (i, (heading, run)) in rows.iter().enumerate() {
        let y = top + i as f64 * ROW + ROW - 7.0;
        match (heading, run) {
            (Some(g), _) => {
                let _ = writeln!(
                    s,
                    r#"<text x="12" y="{y:.1}" font-weight="bold">{}</text>"#,
                    esc(g)
                );
            }
            (None, Some(r)) => {
                let (g, name) = split(&r.label);
                let indent = if g.is_empty() { 12.0 } else { 24.0 };
                let _ = writeln!(s, r#"<text x="{indent}" y="{y:.1}">{}</text>"#, esc(&name));
            }
            _ => {}
        }
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(session: usize, turn: usize, backend: &str, prompt: u64, cached: u64) -> TurnRecord {
        TurnRecord {
            session,
            parent_session: None,
            turn,
            status: 200,
            backend: Some(backend.into()),
            prompt_tokens: prompt,
            cached_tokens: cached,
            ttft: Duration::from_millis(10 * (turn as u64 + 1)),
            e2e: Duration::from_millis(20 * (turn as u64 + 1)),
            prefill_us: Some(1000),
            affinity_hit: Some(turn > 0),
        }
    }

    #[test]
    fn hit_rates_and_balance() {
        let records = vec![
            rec(0, 0, "a", 100, 0),
            rec(0, 1, "a", 200, 96),
            rec(0, 2, "b", 300, 0),
            rec(1, 0, "b", 100, 0),
            rec(1, 1, "b", 200, 96),
        ];
        let r = Report::new("x".into(), records, Duration::from_secs(1), 0);
        assert!((r.same_backend_rate - 2.0 / 3.0).abs() < 1e-9);
        assert!((r.affinity_hit_rate - 3.0 / 5.0).abs() < 1e-9);
        assert!((r.prefix_cache_hit_rate - 192.0 / 900.0).abs() < 1e-9);
        assert_eq!(r.per_backend["b"], 3);
        assert!((r.balance_max_over_mean - 1.2).abs() < 1e-9);
        assert_eq!(r.locality.len(), 3);
        assert_eq!(r.ttft.p50_ms, 20.0);
        // Hits are the turns 1 and 2 (40, 40, 60 ms); misses the first turns (20, 20 ms).
        assert_eq!((r.e2e_hit.p50_ms, r.e2e_hit.p99_ms), (40.0, 60.0));
        assert_eq!((r.e2e_miss.p50_ms, r.e2e_miss.p99_ms), (20.0, 20.0));
        assert!(svg(std::slice::from_ref(&r), "t").starts_with("<svg"));
        assert!(comparison_table(&[r]).contains("| x | 5 | 0 | 60.0% | 66.7% |"));
    }

    #[test]
    fn the_chart_names_every_run_once_draws_throughput_and_no_text_overlaps() {
        let runs: Vec<Report> = [
            "seed: with session ids",
            "seed: without session ids (keyless)",
            "seed: affinity off",
            "long: with session ids",
            "long: without session ids (keyless)",
            "long: affinity off",
            "long: ideal (1 replica, unlimited cache)",
            "placement: bounded_hrw, queue-aware, one replica slowed 3×",
            "placement: least_loaded",
            "placement: round_robin",
            "placement: hrw",
            "seed again: the same runs, 13 in all",
            "no group here",
        ]
        .iter()
        .enumerate()
        .map(|(i, label)| {
            let records = (0..4)
                .map(|t| rec(i, t, "b0", 1000, 100 * i as u64))
                .collect();
            Report::new(
                label.to_string(),
                records,
                Duration::from_millis(500 + 100 * i as u64),
                0,
            )
        })
        .collect();
        let svg = svg(&runs, "a title");
        let texts: Vec<(f64, f64, String)> = svg
            .lines()
            .filter(|l| l.starts_with("<text"))
            .map(|l| {
                let attr = |name: &str| -> f64 {
                    let at = l.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
                    l[at..].split('"').next().unwrap().parse().unwrap()
                };
                let body = l.split('>').nth(1).unwrap().split('<').next().unwrap();
                (attr("x"), attr("y"), body.to_string())
            })
            .collect();
        let short = |l: &str| esc(l.split_once(": ").map_or(l, |(_, n)| n));
        for r in &runs {
            let name = short(&r.label);
            let runs_named = runs.iter().filter(|o| short(&o.label) == name).count();
            let rows = texts.iter().filter(|t| t.2 == name).count();
            assert_eq!(rows, runs_named, "{name}: a row per run, no legend");
        }
        assert!(svg.contains("throughput, req/s"));
        for (g, n) in [
            ("seed", 1),
            ("seed again", 1),
            ("long", 1),
            ("placement", 1),
        ] {
            assert_eq!(texts.iter().filter(|t| t.2 == g).count(), n, "group {g}");
        }
        // Boxes at 7 px a character (wider than the 6.6 laid out), 12 px high.
        let boxes: Vec<(f64, f64, f64)> = texts
            .iter()
            .map(|(x, y, t)| (*x, *x + 7.0 * t.chars().count() as f64, *y))
            .collect();
        for (i, a) in boxes.iter().enumerate() {
            for b in &boxes[i + 1..] {
                let apart = a.1 <= b.0 || b.1 <= a.0 || (a.2 - b.2).abs() >= 12.0;
                assert!(apart, "texts overlap: {a:?} {b:?}\n{svg}");
            }
        }
        let width: f64 = svg
            .split("width=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            boxes.iter().all(|b| b.1 <= width),
            "nothing falls off the image"
        );
    }
}
