//! Replaying a Mooncake-format trace: one JSON object a line with `timestamp`
//! (ms), `input_length`, `output_length` and `hash_ids` (each id one block of
//! 512 tokens). Prompts are sent as token ids so a prefix cache sees exactly
//! the trace's reuse. Sessions are a line's `session` when it has one (the
//! generated traces of [`mooncake_like`] do), else inferred: a request whose
//! `hash_ids` start with the whole `hash_ids` of an earlier request is that
//! request's next turn.
//! Requests run in timestamp order, a session's turns one after another, at
//! most `--concurrency` at once (absolute timestamps are not replayed).

use super::report::TurnRecord;
use super::{gather, send_limited, BenchArgs, Progress, Turn};
use serde::Deserialize;
use serde_json::json;
use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use tokio::sync::Semaphore;

pub const BLOCK_TOKENS: u64 = 512;

#[derive(Debug, Clone, Deserialize, serde::Serialize)]
pub struct TraceLine {
    pub timestamp: f64,
    pub input_length: u64,
    pub output_length: u64,
    pub hash_ids: Vec<u64>,
    /// The conversation it belongs to, when the trace says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<usize>,
}

/// Parse JSON lines; blank lines are skipped, a bad line is an error naming it.
pub fn parse(text: &str) -> Result<Vec<TraceLine>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1)))
        .collect()
}

/// (session, turn) of every line, in input order: the lines' own sessions
/// when every line names one, else inferred from their prefixes.
pub fn sessions(lines: &[TraceLine]) -> Vec<(usize, usize)> {
    if lines.is_empty() || lines.iter().any(|l| l.session.is_none()) {
        return infer_sessions(lines);
    }
    let mut turns: HashMap<usize, usize> = HashMap::new();
    lines
        .iter()
        .map(|l| {
            let s = l.session.unwrap_or(0);
            let t = turns.entry(s).or_insert(0);
            *t += 1;
            (s, *t - 1)
        })
        .collect()
}

/// (session, turn) of every line, in input order.
pub fn infer_sessions(lines: &[TraceLine]) -> Vec<(usize, usize)> {
    // Rolling hash of a full hash_ids list → (session, turns so far).
    let mut ends: HashMap<u64, usize> = HashMap::new();
    let mut turns: Vec<usize> = Vec::new();
    let mut out = Vec::with_capacity(lines.len());
    for line in lines {
        let mut prefixes = Vec::with_capacity(line.hash_ids.len());
        let mut h = 0x51_7cc1_b727_220a_u64;
        for id in &line.hash_ids {
            h = mix(h ^ id);
            prefixes.push(h);
        }
        let session = prefixes
            .iter()
            .rev()
            .find_map(|p| ends.get(p).copied())
            .unwrap_or_else(|| {
                turns.push(0);
                turns.len() - 1
            });
        out.push((session, turns[session]));
        turns[session] += 1;
        if let Some(&full) = prefixes.last() {
            ends.insert(full, session);
        }
    }
    out
}

/// Token ids are drawn below this by default (five digits at most).
pub const DEFAULT_VOCAB: u32 = 50_000;

/// The token ids of a trace request: 512 deterministic ids per hash id
/// below `vocab` (a real tokenizer's: Qwen3's 151,936 makes most of them
/// six digits), cut (or extended with ids unique to `line_no`) to
/// `input_length`.
pub fn prompt_ids(line: &TraceLine, line_no: usize, vocab: u32) -> Vec<u32> {
    let vocab = vocab.max(2) as u64;
    let mut ids = Vec::with_capacity(line.input_length as usize);
    'outer: for &h in &line.hash_ids {
        for j in 0..BLOCK_TOKENS {
            if ids.len() as u64 >= line.input_length {
                break 'outer;
            }
            ids.push((mix(h.wrapping_mul(1_000_003).wrapping_add(j)) % vocab) as u32);
        }
    }
    let mut j = 0u64;
    while (ids.len() as u64) < line.input_length {
        ids.push((mix((line_no as u64) << 32 | j) % vocab) as u32);
        j += 1;
    }
    ids
}

pub async fn replay(client: &reqwest::Client, args: &BenchArgs, text: &str) -> Vec<TurnRecord> {
    let mut lines = match parse(text) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("bad trace: {e}");
            return Vec::new();
        }
    };
    lines.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    let sessions = sessions(&lines);
    let mut per_session: Vec<Vec<Turn>> = Vec::new();
    for (i, (line, &(session, turn))) in lines.iter().zip(&sessions).enumerate() {
        if per_session.len() <= session {
            per_session.resize_with(session + 1, Vec::new);
        }
        let mut body = json!({
            "model": args.model,
            "prompt": prompt_ids(line, i, args.trace_vocab),
            "max_tokens": line.output_length.clamp(1, args.trace_max_output),
        });
        if !args.no_stream {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let base = format!("{}-trace-{session}", args.id_prefix);
        per_session[session].push(Turn {
            session,
            turn,
            session_id: if args.fresh_ids {
                format!("{base}-t{turn}")
            } else {
                base
            },
            parent_id: None,
            path: "/v1/completions",
            body,
        });
    }
    let progress = Arc::new(Progress {
        done: AtomicUsize::new(0),
        total: lines.len(),
        label: args.label.clone(),
        tty: std::io::stderr().is_terminal(),
    });
    let permits = Arc::new(Semaphore::new(args.concurrency.max(1)));
    let args = Arc::new(args.clone());
    if args.trace_ordered {
        return in_order(client, args, permits, progress, &sessions, per_session).await;
    }
    let mut tasks = Vec::new();
    for turns in per_session {
        let (client, args, permits, progress) = (
            client.clone(),
            Arc::clone(&args),
            Arc::clone(&permits),
            Arc::clone(&progress),
        );
        tasks.push(tokio::spawn(async move {
            let mut out = Vec::new();
            for t in turns {
                let o = send_limited(&client, &args, &permits, &progress, &t).await;
                out.push(super::record(&t, &o, None));
            }
            out
        }));
    }
    gather(tasks).await
}

/// Every request in the trace's order (`--trace-ordered`): each waits for
/// a permit in its turn, then for its conversation's turn before, so a
/// conversation's next turn comes among the requests the trace has beside
/// it, not behind every conversation's first.
async fn in_order(
    client: &reqwest::Client,
    args: Arc<BenchArgs>,
    permits: Arc<Semaphore>,
    progress: Arc<Progress>,
    order: &[(usize, usize)],
    per_session: Vec<Vec<Turn>>,
) -> Vec<TurnRecord> {
    let mut turns: Vec<std::collections::VecDeque<Turn>> =
        per_session.into_iter().map(Into::into).collect();
    // Per conversation: its turn before, done.
    let mut before: Vec<Option<tokio::sync::oneshot::Receiver<()>>> =
        (0..turns.len()).map(|_| None).collect();
    let mut tasks = Vec::new();
    for &(session, _) in order {
        let Some(t) = turns[session].pop_front() else {
            continue;
        };
        let permit = Arc::clone(&permits)
            .acquire_owned()
            .await
            .expect("semaphore open");
        let wait = before[session].take();
        let (done, next) = tokio::sync::oneshot::channel();
        before[session] = Some(next);
        let (client, args, progress) = (client.clone(), Arc::clone(&args), Arc::clone(&progress));
        tasks.push(tokio::spawn(async move {
            if let Some(w) = wait {
                let _ = w.await;
            }
            let o = super::send(&client, &args, &t).await;
            drop(permit);
            progress.tick();
            let _ = done.send(());
            vec![super::record(&t, &o, None)]
        }));
    }
    gather(tasks).await
}

/// A small synthetic trace in the Mooncake format (for the demo and tests):
/// `sessions` conversations of `turns` turns sharing a 2-block system prefix.
pub fn synthetic(sessions: usize, turns: usize) -> String {
    let mut out = String::new();
    let mut next_id = 1000u64;
    for s in 0..sessions {
        let mut ids = vec![1, 2];
        for t in 0..turns {
            for _ in 0..(if t == 0 { 3 } else { 1 }) {
                ids.push(next_id);
                next_id += 1;
            }
            let line = json!({
                "timestamp": (t * 10_000 + s * 100) as f64,
                "input_length": ids.len() as u64 * BLOCK_TOKENS - 100,
                "output_length": 16,
                "hash_ids": ids,
            });
            out.push_str(&line.to_string());
            out.push('\n');
        }
    }
    out
}

/// A generated trace in the Mooncake format, shaped like a production
/// conversation trace: `conversations` conversations that all open with
/// the same 3-block system prefix, then 2–6 blocks of their own; each later
/// turn (1–9 of them) adds 1–3 blocks; every prompt ends in a partial block.
/// Conversations start at random times over a minute and pause 0.5–3 s
/// between turns. With `reblock`, a turn gives the partial last block of
/// the turn before a new id (the token ids there differ, as when a client
/// re-tokenises the previous answer): it shares every full block of the
/// turn before but not that one, as a real trace's `hash_ids` do. Without,
/// each turn extends the one before byte for byte. Lines carry their
/// conversation (`session`).
pub fn mooncake_like(conversations: usize, seed: u64, reblock: bool) -> String {
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = move |n: u64| {
        rng = mix(rng);
        rng % n.max(1)
    };
    let mut fresh_id = 100_000u64;
    let mut lines = Vec::new();
    for c in 0..conversations {
        let mut ids: Vec<u64> = vec![1, 2, 3];
        let mut at = next(60_000) as f64;
        let turns = 2 + next(9) as usize;
        for t in 0..turns {
            if t > 0 && reblock {
                // The last block was partial: it comes back with new ids.
                ids.pop();
                ids.push(fresh_id);
                fresh_id += 1;
            }
            let add = if t == 0 { 2 + next(5) } else { 1 + next(3) };
            for _ in 0..add {
                ids.push(fresh_id);
                fresh_id += 1;
            }
            let partial = 32 + next(448);
            lines.push(TraceLine {
                timestamp: at,
                input_length: ids.len() as u64 * BLOCK_TOKENS - (BLOCK_TOKENS - partial),
                output_length: 50 + next(250),
                hash_ids: ids.clone(),
                session: Some(c),
            });
            at += 500.0 + next(2_500) as f64;
        }
    }
    jsonl(lines)
}

/// A generated trace in the Mooncake format shaped like a production chat
/// trace's first 15 minutes (`--trace-shape conversation`): of
/// `conversations`, about 74% a single turn (1,395 of 1,895) and the rest
/// 2.7 turns on average; every prompt opens with the same 512-token block
/// (a system prompt all share) and from its second block on is its
/// conversation's own; first turns a median 14 blocks (log-normal, up to
/// 200), each later turn 1–6 blocks more, at most 241; conversations start
/// over 900 s, turns 5–120 s apart. `reblock` as in [`mooncake_like`].
pub fn conversation_like(conversations: usize, seed: u64, reblock: bool) -> String {
    chat_like(conversations, seed, reblock, false)
}

/// How many long documents [`documents_like`] draws from, how many blocks
/// each (4,096 tokens: about 16 KB of text), and the share of conversations
/// that open with one.
pub const DOCUMENTS: u64 = 32;
pub const DOCUMENT_BLOCKS: u64 = 8;
pub const DOCUMENT_SHARE: f64 = 1.0 / 3.0;

/// [`conversation_like`] where a third of the conversations
/// (`--trace-shape documents`) open, after the shared system prompt, with
/// one of [`DOCUMENTS`] long documents ([`DOCUMENT_BLOCKS`] blocks each,
/// drawn alike), then ask their own 1–4 blocks about it and go on as any
/// conversation: the same document sent by many users, each conversation
/// its own.
pub fn documents_like(conversations: usize, seed: u64, reblock: bool) -> String {
    chat_like(conversations, seed, reblock, true)
}

fn chat_like(conversations: usize, seed: u64, reblock: bool, documents: bool) -> String {
    let mut rng = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut unit = move || {
        rng = mix(rng);
        (rng >> 11) as f64 / (1u64 << 53) as f64
    };
    let mut fresh_id = 1_000_000u64;
    let mut lines = Vec::new();
    for c in 0..conversations {
        let mut turns = 1;
        if unit() >= 1395.0 / 1895.0 {
            turns = 2;
            while turns < 12 && unit() < 0.4 {
                turns += 1;
            }
        }
        // A median of 14 blocks: log-normal, sigma 0.9 (Box-Muller).
        let z = (-2.0 * unit().max(1e-12).ln()).sqrt() * (std::f64::consts::TAU * unit()).cos();
        let first = ((14f64.ln() + 0.9 * z).exp().round() as usize).clamp(2, 200);
        let mut ids: Vec<u64> = vec![1];
        let mut at = unit() * 900_000.0;
        // Drawn only for this shape: the conversation shape's trace stays
        // what it was, id for id.
        let mut first = first;
        if documents && unit() < DOCUMENT_SHARE {
            let d = (unit() * DOCUMENTS as f64) as u64;
            ids.extend((0..DOCUMENT_BLOCKS).map(|j| 10 + d * DOCUMENT_BLOCKS + j));
            first = 2 + (unit() * 4.0) as usize;
        }
        for t in 0..turns {
            if t > 0 && reblock {
                ids.pop();
                ids.push(fresh_id);
                fresh_id += 1;
            }
            let add = match t {
                0 => first - 1,
                _ => 1 + (unit() * 6.0) as usize,
            };
            for _ in 0..add.min(241 - ids.len().min(241)) {
                ids.push(fresh_id);
                fresh_id += 1;
            }
            let partial = 1 + (unit() * 511.0) as u64;
            lines.push(TraceLine {
                timestamp: at,
                input_length: ids.len() as u64 * BLOCK_TOKENS - (BLOCK_TOKENS - partial),
                output_length: 50 + (unit() * 600.0) as u64,
                hash_ids: ids.clone(),
                session: Some(c),
            });
            at += 5_000.0 + unit() * 115_000.0;
        }
    }
    jsonl(lines)
}

/// SplitMix64's finaliser: the synthetic trace's ids from its seed.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// `lines` in time order, one JSON object a line.
fn jsonl(mut lines: Vec<TraceLine>) -> String {
    lines.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    let mut out = String::new();
    for l in &lines {
        if let Ok(text) = serde_json::to_string(l) {
            out.push_str(&text);
            out.push('\n');
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_inferred_from_prefixes() {
        let lines = parse(&synthetic(3, 4)).unwrap();
        let mut sorted = lines.clone();
        sorted.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
        let s = infer_sessions(&sorted);
        let sessions: std::collections::HashSet<usize> = s.iter().map(|x| x.0).collect();
        assert_eq!(sessions.len(), 3);
        // Each session's turns are numbered 0..4 in order.
        for sess in sessions {
            let turns: Vec<usize> = s.iter().filter(|x| x.0 == sess).map(|x| x.1).collect();
            assert_eq!(turns, vec![0, 1, 2, 3]);
        }
    }

    #[test]
    fn generated_traces_share_full_blocks_and_re_id_the_partial_one() {
        for reblock in [false, true] {
            let lines = parse(&mooncake_like(20, 7, reblock)).unwrap();
            let s = sessions(&lines);
            let mut last: HashMap<usize, (usize, Vec<u32>)> = HashMap::new();
            let mut pairs = 0;
            for (i, (line, &(session, turn))) in lines.iter().zip(&s).enumerate() {
                let ids = prompt_ids(line, i, DEFAULT_VOCAB);
                assert_eq!(ids.len() as u64, line.input_length);
                assert_eq!(line.hash_ids[..3], [1, 2, 3]);
                if let Some((before_turn, before)) = last.get(&session) {
                    assert_eq!(*before_turn + 1, turn);
                    pairs += 1;
                    let full = before.len() / BLOCK_TOKENS as usize * BLOCK_TOKENS as usize;
                    // Every full block of the turn before is shared...
                    assert_eq!(ids[..full], before[..full]);
                    // ...and its partial one only byte for byte.
                    assert_eq!(ids[..before.len()] == before[..], !reblock);
                }
                last.insert(session, (turn, ids));
            }
            assert!(pairs > 40, "{pairs}");
        }
    }

    #[test]
    fn the_conversation_shape_is_the_production_traces() {
        let lines = parse(&conversation_like(1895, 1, true)).unwrap();
        let s = sessions(&lines);
        let mut turns: HashMap<usize, usize> = HashMap::new();
        for &(session, _) in &s {
            *turns.entry(session).or_default() += 1;
        }
        let single = turns.values().filter(|&&n| n == 1).count();
        let mut blocks: Vec<usize> = lines.iter().map(|l| l.hash_ids.len()).collect();
        blocks.sort_unstable();
        let median = blocks[blocks.len() / 2];
        eprintln!(
            "{} requests, {} conversations, {single} single-turn, median {median} blocks, max {}",
            lines.len(),
            turns.len(),
            blocks[blocks.len() - 1]
        );
        assert_eq!(turns.len(), 1895);
        assert!((1300..1500).contains(&single), "{single}");
        assert!((2500..3000).contains(&lines.len()), "{}", lines.len());
        assert!((13..=19).contains(&median), "{median}");
        assert!(blocks[blocks.len() - 1] <= 241);
        // One shared block, then each conversation's own.
        let mut owner: HashMap<u64, usize> = HashMap::new();
        for (line, &(session, _)) in lines.iter().zip(&s) {
            assert_eq!(line.hash_ids[0], 1);
            for id in &line.hash_ids[1..] {
                assert_eq!(*owner.entry(*id).or_insert(session), session);
            }
        }
    }

    #[test]
    fn a_third_of_the_document_shapes_conversations_open_with_a_shared_document() {
        let lines = parse(&documents_like(1895, 1, true)).unwrap();
        let s = sessions(&lines);
        let document = |l: &TraceLine| {
            (l.hash_ids.len() > DOCUMENT_BLOCKS as usize && l.hash_ids[1] < 1_000_000)
                .then(|| (l.hash_ids[1] - 10) / DOCUMENT_BLOCKS)
        };
        let mut opened: HashMap<usize, Option<u64>> = HashMap::new();
        let mut owner: HashMap<u64, usize> = HashMap::new();
        for (line, &(session, _)) in lines.iter().zip(&s) {
            assert_eq!(line.hash_ids[0], 1);
            let doc = document(line);
            // A conversation keeps the opening it started with.
            assert_eq!(*opened.entry(session).or_insert(doc), doc);
            let own = match doc {
                Some(d) => {
                    let blocks = (0..DOCUMENT_BLOCKS).map(|j| 10 + d * DOCUMENT_BLOCKS + j);
                    assert!(line.hash_ids[1..].iter().copied().take(8).eq(blocks));
                    &line.hash_ids[1 + DOCUMENT_BLOCKS as usize..]
                }
                None => &line.hash_ids[1..],
            };
            assert!(!own.is_empty());
            for id in own {
                assert_eq!(*owner.entry(*id).or_insert(session), session);
            }
        }
        let with: Vec<u64> = opened.values().filter_map(|d| *d).collect();
        let share = with.len() as f64 / opened.len() as f64;
        assert!((0.28..0.38).contains(&share), "{share}");
        let distinct: std::collections::HashSet<u64> = with.iter().copied().collect();
        assert_eq!(distinct.len() as u64, DOCUMENTS);
        // The conversation shape has none.
        let plain = parse(&conversation_like(1895, 1, true)).unwrap();
        assert!(plain.iter().all(|l| document(l).is_none()));
    }

    #[test]
    fn prompts_share_blocks_where_hash_ids_do() {
        let a = TraceLine {
            timestamp: 0.0,
            input_length: 1024,
            output_length: 1,
            hash_ids: vec![7, 8],
            session: None,
        };
        let b = TraceLine {
            timestamp: 1.0,
            input_length: 1500,
            output_length: 1,
            hash_ids: vec![7, 9, 10],
            session: None,
        };
        let (pa, pb) = (
            prompt_ids(&a, 0, DEFAULT_VOCAB),
            prompt_ids(&b, 1, DEFAULT_VOCAB),
        );
        assert_eq!(pa.len(), 1024);
        assert_eq!(pb.len(), 1500);
        assert_eq!(pa[..512], pb[..512]);
        assert_ne!(pa[512..], pb[512..1024]);
        assert!(parse("{\"timestamp\": 1}\n")
            .unwrap_err()
            .starts_with("line 1"));
    }
}
