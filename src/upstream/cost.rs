//! The cost model of one backend: what its answers teach about its speed
//! (prefill cost per uncached token, queueing delay) and the prefill work
//! this gateway has queued there now. Placement, queue-aware relief and the
//! soft policy read it through [`crate::affinity::Candidate`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What a backend's responses teach about its speed, learned online from the
/// time to first byte and the `usage` the gateway reads: prefill cost per
/// uncached token, and the queueing delay before a request starts. The
/// cost-aware soft policy weighs these (ΔQ against p_hit · T_saved), with the
/// prefill work this gateway has queued there now: the estimated uncached
/// tokens of its requests there that have not begun to answer.
#[derive(Debug, Default)]
pub struct CostEstimate {
    /// EWMA, nanoseconds per uncached prompt token (0: no sample yet).
    prefill_ns_per_token: AtomicU64,
    /// The last explained sample when it was a step away from the average
    /// ([`STEP`]), ns per token; 0: it was not.
    stepped_ns: AtomicU64,
    /// EWMA, nanoseconds per uncached token of answers sent with no other
    /// prefill queued here: what a prefill costs on its own, whether or not
    /// the engine runs prefills side by side (0: no sample yet).
    own_ns_per_token: AtomicU64,
    /// EWMA, microseconds between request start and the start of its prefill.
    queue_us: AtomicU64,
    /// EWMA, nanoseconds per generated token, from streamed answers (first
    /// byte to last) and from the engine's own count of time per output
    /// token ([`CostEstimate::observe_engine_decode`]); 0: none yet.
    decode_ns_per_token: AtomicU64,
    /// The engine's counters of decode time (µs) and tokens at its last
    /// scrape (0: not read yet; the first read teaches the engine's
    /// average so far).
    engine_decode_us: AtomicU64,
    engine_decode_tokens: AtomicU64,
    /// EWMA, tokens of a new session's first prompt the backend answered as
    /// cached: the prefix its sessions share (a system prompt).
    shared_prefix: AtomicU64,
    samples: AtomicU64,
    /// Tokens whose prefill time the averaged samples explained (served
    /// alone, or with the queue they were sent behind): see
    /// [`COST_CONFIDENT_TOKENS`].
    taught_tokens: AtomicU64,
    /// Estimated uncached tokens of this gateway's requests at the backend
    /// that have had no first byte back yet: prefill work still ahead.
    queued_tokens: AtomicU64,
    /// The request now at the head of that queue, in one word so that a
    /// reader never pairs one head's start with another's size (which made a
    /// fresh head look overdue): `clock::now_ms` when it began to prefill
    /// (sent to an empty queue, or the one before it answered) in the high
    /// 40 bits, its estimated tokens (0: nothing queued; saturating) in the
    /// low 24. See [`pack_head`].
    head: AtomicU64,
    /// Those requests, oldest first: which one is the head, and what it
    /// brought. Written on send and on first byte only; readers use the
    /// atomics above.
    queue: parking_lot::Mutex<std::collections::VecDeque<Queued>>,
    next_ticket: AtomicU64,
}

/// One request in a backend's queue of prefill work.
#[derive(Debug, Clone, Copy)]
struct Queued {
    ticket: u64,
    tokens: u64,
    /// A request sent after it had its first byte first: the backend did
    /// not serve the two in the order the gateway sent them.
    overtaken: bool,
}

/// A request counted in its backend's queue ([`CostEstimate::enqueue`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enqueued {
    /// What [`CostEstimate::dequeue`] takes back out (0: nothing was queued).
    pub ticket: u64,
    /// The prefill work it went in behind, tokens: the queue less what its
    /// head has done at the learned cost (0 when that head looks done).
    pub ahead: u64,
    /// Whether it went in behind requests still waiting for their first byte
    /// at all (the head among them, however far past its estimate).
    pub behind: bool,
    /// That work ahead as time, ns: the queue less its head's progress, at
    /// what one prefill costs on its own (0: that cost not known yet).
    /// What [`CostEstimate::prefill_vote`] weighs its wait against.
    pub work_ahead_ns: u64,
}

impl Enqueued {
    /// What [`CostEstimate::observe`] takes: `Some(ahead)` when it was
    /// sent behind queued requests.
    pub fn behind(&self) -> Option<u64> {
        self.behind.then_some(self.ahead)
    }
}

/// A backend's queue of prefill work at one moment, as placement and the
/// soft policy read it ([`CostEstimate::queue_at`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueView {
    /// Estimated uncached tokens without a first byte yet, the head's included.
    pub tokens: u64,
    /// How long the head has been prefilling, ms.
    pub head_ms: u64,
    /// The head's own estimated tokens.
    pub head_tokens: u64,
}

/// Responses a backend must have answered before its learned cost is used…
pub const COST_MIN_SAMPLES: u64 = 5;
/// …unless fewer have already explained this many tokens' prefill: one
/// long prompt served alone times the backend far better than five short
/// ones, whose fixed overheads weigh as much as their tokens. A fleet's first
/// heavy prefills thus teach its speed while the sessions behind them are
/// still being placed.
pub const COST_CONFIDENT_TOKENS: u64 = 4096;

/// An answer votes on whether prefills queue here only when the work it was
/// sent behind would take at least this long on its own: less is lost in a
/// host's noise and the engine's fixed overheads.
pub const VOTE_MIN_AHEAD: Duration = Duration::from_millis(20);

/// Weight of a new sample in the moving averages.
const EWMA_ALPHA: f64 = 0.3;

/// A streamed answer teaches the decode speed once it generated this many
/// tokens (fewer: its end is mostly the stream's fixed overhead).
const DECODE_MIN_TOKENS: u64 = 8;

/// Until the decode speed is known, a JSON answer of at most this many
/// generated tokens still teaches the prefill cost: its decode is taken to
/// be a small part of its time to first byte. Where the engine reports its
/// decode time ([`CostEstimate::observe_engine_decode`]: vLLM, SGLang and
/// llama.cpp do) that is known from its first scrape on; an engine that
/// reports none and decodes slowly (16 tokens at 62 ms are a second) is
/// taken for a slow prefill until a stream teaches its decode speed.
pub const DECODE_NEGLIGIBLE_TOKENS: u64 = 16;

/// Two explained samples in a row this many times above (or below) the
/// learned cost are a step, not noise: the cost jumps to the later one. A
/// backend that has just slowed down 3× (a throttled GPU, a noisy
/// neighbour) then reads as slow on its second slow answer rather than
/// its fifth, before its queue has grown by another four turns; one spike
/// from a busy host moves it no further than the average does.
pub const STEP: f64 = 1.5;

/// The cost per token is learned from responses whose wait the gateway can
/// explain: served alone (no other request in flight there when it was
/// sent), the TTFB is the prefill of its own uncached tokens; sent behind
/// requests that were still prefilling, it is theirs and its own, so the
/// sample is the TTFB over all those tokens (a backend that slows down under
/// load teaches it at once) — and over its own alone when the head it went
/// in behind looked done: a head running past its estimate is what a
/// backend that has just slowed down shows first. Any other busy response
/// (behind requests the gateway has no tokens for: decoding, or another
/// client's) may only pull the estimate down: averaging it would book that
/// queue as slowness.
fn ewma(cell: &AtomicU64, sample: f64) {
    let old = cell.load(Ordering::Relaxed);
    let next = if old == 0 {
        sample
    } else {
        old as f64 + EWMA_ALPHA * (sample - old as f64)
    };
    cell.store(next.max(0.0).round() as u64, Ordering::Relaxed);
}

fn lower(cell: &AtomicU64, sample: f64) {
    let old = cell.load(Ordering::Relaxed) as f64;
    if old == 0.0 || sample < old {
        ewma(cell, sample);
    }
}

impl CostEstimate {
    /// One response: its time to first byte, its prompt / cached tokens,
    /// whether it was the only request in flight at the backend when sent,
    /// and, if it was sent behind queued requests, their tokens
    /// ([`Enqueued::behind`]).
    pub fn observe(
        &self,
        ttfb: Duration,
        prompt: u64,
        cached: u64,
        alone: bool,
        behind: Option<u64>,
    ) {
        let uncached = prompt.saturating_sub(cached);
        let ttfb_ns = ttfb.as_nanos() as f64;
        // The cost per token is learned from prefills that dominate their TTFB;
        // what it does not explain is queueing. The tokens whose prefill the
        // TTFB explains: its own served alone, or with the queue ahead of it
        // (a request sent alone went in behind nothing).
        let explained = match behind {
            Some(ahead) => ahead + uncached,
            None if alone => uncached,
            None => 0,
        };
        if explained >= 64 {
            self.learn_cost(ttfb_ns / explained as f64);
            self.taught_tokens.fetch_add(explained, Ordering::Relaxed);
        } else if uncached >= 64 {
            lower(&self.prefill_ns_per_token, ttfb_ns / uncached as f64);
        }
        let per_token = self.prefill_ns_per_token.load(Ordering::Relaxed) as f64;
        if per_token > 0.0 {
            let queue_ns = (ttfb_ns - per_token * uncached as f64).max(0.0);
            ewma(&self.queue_us, queue_ns / 1000.0);
        }
        self.samples.fetch_add(1, Ordering::Relaxed);
    }

    /// An answer sent with no other prefill queued here, in order: its
    /// prefill part over its `uncached` tokens is what one prefill costs
    /// on its own.
    /// Returns whether it was the first to teach that cost.
    pub fn observe_own(&self, prefill: Duration, uncached: u64) -> bool {
        if uncached < 64 {
            return false;
        }
        let first = self.own_ns_per_token.load(Ordering::Relaxed) == 0;
        ewma(
            &self.own_ns_per_token,
            prefill.as_nanos() as f64 / uncached as f64,
        );
        first
    }

    /// Whether [`CostEstimate::observe_own`] taught what one prefill costs.
    pub fn knows_own_cost(&self) -> bool {
        self.own_ns_per_token.load(Ordering::Relaxed) > 0
    }

    /// Whether an answer sent behind `ahead` of others' prefill work (as
    /// [`Enqueued::work_ahead_ns`] put it when it was sent), whose prefill
    /// part took `prefill` for its own `uncached` tokens, waited for that
    /// work (`Some(true)`: this engine's prefills queue behind each other)
    /// or ran beside it (`Some(false)`): past its own prefill at the cost
    /// one takes alone, it waited at least half the work ahead, or not.
    /// `None` when that cost was not known when it was sent, or the work
    /// ahead is too little to tell from noise ([`VOTE_MIN_AHEAD`]).
    pub fn prefill_vote(&self, prefill: Duration, uncached: u64, ahead: Duration) -> Option<bool> {
        self.vote_between(prefill, uncached, ahead, (0.5, 0.5))
    }

    /// [`CostEstimate::prefill_vote`] for an answer part of whose work
    /// ahead was another gateway's, known only roughly (how far along it
    /// was is a guess): it votes only when it waited at least three
    /// quarters of that work, or a quarter at most.
    pub fn prefill_vote_rough(
        &self,
        prefill: Duration,
        uncached: u64,
        ahead: Duration,
    ) -> Option<bool> {
        self.vote_between(prefill, uncached, ahead, (0.25, 0.75))
    }

    /// Waited `at_most` of the work ahead or less: ran beside it; `at_least`
    /// or more: waited for it; between: no vote.
    fn vote_between(
        &self,
        prefill: Duration,
        uncached: u64,
        ahead: Duration,
        (at_most, at_least): (f64, f64),
    ) -> Option<bool> {
        let ns = self.own_ns_per_token.load(Ordering::Relaxed) as f64;
        let ahead_ns = ahead.as_nanos() as f64;
        if ns == 0.0 || ahead < VOTE_MIN_AHEAD {
            return None;
        }
        let waited = prefill.as_nanos() as f64 - uncached as f64 * ns;
        match waited {
            w if w >= ahead_ns * at_least => Some(true),
            w if w < ahead_ns * at_most => Some(false),
            _ => None,
        }
    }

    /// A streamed answer: `after_first_byte` from its first byte to its end,
    /// over `completion` generated tokens, teaches the decode speed.
    pub fn observe_decode(&self, after_first_byte: Duration, completion: u64) {
        if completion >= DECODE_MIN_TOKENS {
            ewma(
                &self.decode_ns_per_token,
                after_first_byte.as_nanos() as f64 / completion as f64,
            );
        }
    }

    /// The engine's own cumulative decode time (`seconds`) over its
    /// generated tokens (`tokens`), as one scrape read them (vLLM's and
    /// SGLang's `inter_token_latency_seconds` histogram, llama.cpp's
    /// `tokens_predicted_seconds_total`): what came since the last scrape
    /// teaches the decode speed, so that a JSON answer's decode can be told
    /// from its prefill where no stream taught it. A counter that went back
    /// (the engine restarted) starts over.
    pub fn observe_engine_decode(&self, seconds: f64, tokens: f64) {
        if !(seconds.is_finite() && tokens.is_finite() && seconds >= 0.0 && tokens >= 0.0) {
            return;
        }
        let (us, n) = ((seconds * 1e6) as u64, tokens as u64);
        let before_us = self.engine_decode_us.swap(us, Ordering::Relaxed);
        let before_n = self.engine_decode_tokens.swap(n, Ordering::Relaxed);
        if n < before_n || us < before_us {
            return;
        }
        let (dn, dus) = (n - before_n, us - before_us);
        if dn >= DECODE_MIN_TOKENS {
            // At least 1 ns: an engine that decodes in no measurable time
            // has a decode speed known all the same (0 reads as unknown).
            let ns = (dus as f64 * 1000.0 / dn as f64).max(1.0);
            ewma(&self.decode_ns_per_token, ns);
        } else {
            // Too few to teach: counted with the next scrape's.
            self.engine_decode_us.store(before_us, Ordering::Relaxed);
            self.engine_decode_tokens.store(before_n, Ordering::Relaxed);
        }
    }

    /// Learned decode time per generated token, µs.
    pub fn decode_us_per_token(&self) -> Option<f64> {
        match self.decode_ns_per_token.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(ns as f64 / 1000.0),
        }
    }

    /// The part of a response's time to first byte that was queue and
    /// prefill, as [`CostEstimate::observe`] takes it. A streamed answer's
    /// first byte is its first token: all of it. A JSON answer's first byte
    /// follows its whole decode: its `completion` tokens at the decode speed
    /// streams or the engine's counters taught are taken off; before either
    /// did, only an answer of at most [`DECODE_NEGLIGIBLE_TOKENS`] teaches,
    /// and a longer one teaches nothing rather than book its decode as
    /// prefill.
    pub fn prefill_part(
        &self,
        ttfb: Duration,
        completion: u64,
        streamed: bool,
    ) -> Option<Duration> {
        if streamed {
            return Some(ttfb);
        }
        match self.decode_ns_per_token.load(Ordering::Relaxed) {
            0 if completion <= DECODE_NEGLIGIBLE_TOKENS => Some(ttfb),
            0 => None,
            ns => Some(ttfb.saturating_sub(Duration::from_nanos(ns.saturating_mul(completion)))),
        }
    }

    /// One explained sample of the cost, ns per token: averaged, unless it
    /// and the one before are a [`STEP`] away in the same direction.
    fn learn_cost(&self, sample: f64) {
        let old = self.prefill_ns_per_token.load(Ordering::Relaxed) as f64;
        let step = |x: f64| old > 0.0 && (x > STEP * old || x * STEP < old);
        if !step(sample) {
            self.stepped_ns.store(0, Ordering::Relaxed);
            return ewma(&self.prefill_ns_per_token, sample);
        }
        let before = self
            .stepped_ns
            .swap(sample.round() as u64, Ordering::Relaxed) as f64;
        if before > 0.0 && step(before) && (before > old) == (sample > old) {
            self.prefill_ns_per_token
                .store(sample.round() as u64, Ordering::Relaxed);
            self.stepped_ns.store(0, Ordering::Relaxed);
        } else {
            ewma(&self.prefill_ns_per_token, sample);
        }
    }

    /// Prefill cost per uncached token, µs: learned after `min_samples`
    /// responses (or [`COST_CONFIDENT_TOKENS`] explained), `prior` until then.
    pub fn prefill_us_per_token(&self, prior: f64, min_samples: u64) -> f64 {
        let ns = self.prefill_ns_per_token.load(Ordering::Relaxed);
        let taught = self.samples.load(Ordering::Relaxed) >= min_samples
            || self.taught_tokens.load(Ordering::Relaxed) >= COST_CONFIDENT_TOKENS;
        if ns == 0 || !taught {
            prior
        } else {
            ns as f64 / 1000.0
        }
    }

    /// The learned cost per token, µs, once enough responses taught it.
    pub fn learned_us_per_token(&self) -> Option<f64> {
        Some(self.prefill_us_per_token(0.0, COST_MIN_SAMPLES)).filter(|&us| us > 0.0)
    }

    /// Responses observed so far.
    pub fn samples(&self) -> u64 {
        self.samples.load(Ordering::Relaxed)
    }

    pub fn queue_us(&self) -> u64 {
        self.queue_us.load(Ordering::Relaxed)
    }

    /// A new session's first prompt was answered with `cached` tokens found
    /// cached (a subagent's is not: it finds its parent's transcript).
    pub fn observe_first_prompt(&self, cached: u64) {
        ewma(&self.shared_prefix, cached as f64);
    }

    /// The prefix new sessions' first prompts find cached here, tokens.
    pub fn shared_prefix(&self) -> u64 {
        self.shared_prefix.load(Ordering::Relaxed)
    }

    /// The prefill a prompt of `body` tokens (estimated from its size) brings
    /// here when nothing is known of its session: less the prefix this
    /// backend's new sessions find cached, since an engine keeps the system
    /// prompt its sessions share; never less than a quarter of the body, as
    /// that prefix may not be this prompt's. Counting the whole body, a
    /// fleet's light first turns behind one another read as several times
    /// their prefill, so what their answers taught per token was as many
    /// times too low, and a queue of heavy prefills looked short.
    pub fn body_estimate(&self, body: u64) -> u64 {
        body.saturating_sub(self.shared_prefix()).max(body / 4)
    }

    /// A request estimated to prefill `tokens` is sent: it joins the queue,
    /// behind the queued tokens less the head's progress at the learned cost
    /// ([`crate::affinity::queued_after`]). Each call is matched by one
    /// [`CostEstimate::dequeue`] of its ticket.
    pub fn enqueue(&self, tokens: u64) -> Enqueued {
        if tokens == 0 {
            let ahead = self.queue_at(crate::clock::now_ms());
            return Enqueued {
                ticket: 0,
                ahead: self.ahead(ahead),
                behind: ahead.tokens > 0,
                work_ahead_ns: self.work_ahead_ns(ahead),
            };
        }
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed) + 1;
        let mut queue = self.queue.lock();
        let now_ms = crate::clock::now_ms();
        let before = self.queue_at(now_ms);
        let behind = !queue.is_empty();
        if !behind {
            self.head
                .store(pack_head(now_ms, tokens), Ordering::Relaxed);
        }
        queue.push_back(Queued {
            ticket,
            tokens,
            overtaken: false,
        });
        self.queued_tokens.fetch_add(tokens, Ordering::Relaxed);
        drop(queue);
        Enqueued {
            ticket,
            ahead: self.ahead(before),
            behind,
            work_ahead_ns: self.work_ahead_ns(before),
        }
    }

    /// `q`, sent behind `tokens` more prefilling there that this gateway's
    /// queue does not hold (the fleet's other gateways' requests), the
    /// oldest of them under way for `head_ms`: less its progress, as for
    /// this gateway's own queue.
    pub fn behind_elsewhere(&self, mut q: Enqueued, tokens: u64, head_ms: u64) -> Enqueued {
        if tokens > 0 {
            let ns = self.own_ns_per_token.load(Ordering::Relaxed);
            let left = crate::affinity::queued_after(tokens, head_ms, 0, ns as f64 / 1000.0);
            q.behind = true;
            q.ahead += crate::affinity::queued_after(
                tokens,
                head_ms,
                0,
                self.learned_us_per_token().unwrap_or(0.0),
            );
            q.work_ahead_ns += left.saturating_mul(ns);
        }
        q
    }

    fn work_ahead_ns(&self, q: QueueView) -> u64 {
        let ns = self.own_ns_per_token.load(Ordering::Relaxed);
        if ns == 0 {
            return 0;
        }
        let tokens =
            crate::affinity::queued_after(q.tokens, q.head_ms, q.head_tokens, ns as f64 / 1000.0);
        tokens.saturating_mul(ns)
    }

    fn ahead(&self, q: QueueView) -> u64 {
        let us = self.learned_us_per_token().unwrap_or(0.0);
        crate::affinity::queued_after(q.tokens, q.head_ms, q.head_tokens, us)
    }

    /// Its first byte came back (its prefill is done): it leaves the queue,
    /// and if it was the head the next one starts now; every request sent
    /// before it and still waiting was overtaken. Returns whether the backend
    /// served it in the order it was sent:
    /// every request sent before it had answered, and none sent after it
    /// answered first. Only then does its time to first byte explain the
    /// queue it was sent behind (or its own prefill alone): requests sent
    /// within the same instant reach the engine in any order, and a batching
    /// engine finishes short prompts before long ones, so a short answer
    /// that overtook a long prefill would teach a cost many times too low.
    pub fn dequeue(&self, ticket: u64) -> bool {
        self.leave(ticket, true)
    }

    /// It ended without a first byte (an error, a client gone): it leaves
    /// the queue like an answered one, but overtook nobody.
    pub fn abandon(&self, ticket: u64) {
        self.leave(ticket, false);
    }

    fn leave(&self, ticket: u64, answered: bool) -> bool {
        if ticket == 0 {
            return false;
        }
        let mut queue = self.queue.lock();
        let Some(at) = queue.iter().position(|q| q.ticket == ticket) else {
            return false;
        };
        let Some(done) = queue.remove(at) else {
            return false;
        };
        if answered {
            for ahead in queue.iter_mut().take(at) {
                ahead.overtaken = true;
            }
        }
        self.queued_tokens.fetch_sub(done.tokens, Ordering::Relaxed);
        if at == 0 {
            let next = queue.front().map_or(0, |q| q.tokens);
            self.head
                .store(pack_head(crate::clock::now_ms(), next), Ordering::Relaxed);
        }
        at == 0 && !done.overtaken
    }

    /// The queued tokens as counted (each request's whole estimate until its
    /// first byte).
    pub fn queued_tokens(&self) -> u64 {
        self.queued_tokens.load(Ordering::Relaxed)
    }

    /// The queue at `now_ms`, read without the lock.
    pub fn queue_at(&self, now_ms: u64) -> QueueView {
        match self.queued_tokens() {
            0 => QueueView::default(),
            tokens => {
                let (since_ms, head_tokens) = unpack_head(self.head.load(Ordering::Relaxed));
                QueueView {
                    tokens,
                    head_ms: now_ms.saturating_sub(since_ms),
                    head_tokens,
                }
            }
        }
    }
}

const HEAD_TOKEN_BITS: u32 = 24;
const HEAD_TOKENS_MAX: u64 = (1 << HEAD_TOKEN_BITS) - 1;

/// A queue head as one word: its start (ms since the process started, 40
/// bits: 34 years) and its tokens (24 bits, saturating at 16.7M, beyond any
/// context window).
fn pack_head(since_ms: u64, tokens: u64) -> u64 {
    (since_ms << HEAD_TOKEN_BITS) | tokens.min(HEAD_TOKENS_MAX)
}

fn unpack_head(word: u64) -> (u64, u64) {
    (word >> HEAD_TOKEN_BITS, word & HEAD_TOKENS_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn a_json_answers_decode_is_not_its_prefill() {
        let c = CostEstimate::default();
        let ms = Duration::from_millis;
        // A stream's first byte is its first token.
        assert_eq!(c.prefill_part(ms(300), 100, true), Some(ms(300)));
        // Decode speed unknown: a short JSON answer teaches, a long one not.
        assert_eq!(
            c.prefill_part(ms(300), DECODE_NEGLIGIBLE_TOKENS, false),
            Some(ms(300))
        );
        assert_eq!(c.prefill_part(ms(300), 100, false), None);
        // Streams teach 2 ms a token (a short one teaches nothing)...
        c.observe_decode(ms(10), 4);
        assert_eq!(c.decode_us_per_token(), None);
        c.observe_decode(ms(200), 100);
        assert_eq!(c.decode_us_per_token(), Some(2000.0));
        // ...then a JSON answer's decode is taken off.
        assert_eq!(c.prefill_part(ms(300), 100, false), Some(ms(100)));
        assert_eq!(c.prefill_part(ms(100), 100, false), Some(ms(0)));
    }

    #[test]
    fn the_engines_own_count_of_decode_time_teaches_the_decode_speed() {
        let c = CostEstimate::default();
        let ms = Duration::from_millis;
        // Too few tokens to teach: they wait for the next scrape's.
        c.observe_engine_decode(0.3, 4.0);
        assert_eq!(c.decode_us_per_token(), None);
        // 16 tokens at 62.5 ms since the engine started.
        c.observe_engine_decode(1.0, 16.0);
        assert_eq!(c.decode_us_per_token(), Some(62_500.0));
        c.observe_engine_decode(2.0, 32.0);
        assert_eq!(c.decode_us_per_token(), Some(62_500.0));
        // A one-second JSON answer of 16 tokens is then no prefill at all.
        assert_eq!(c.prefill_part(ms(1_020), 16, false), Some(ms(20)));
        // The engine restarted: its counters start over, teaching nothing.
        c.observe_engine_decode(0.5, 8.0);
        assert_eq!(c.decode_us_per_token(), Some(62_500.0));
        c.observe_engine_decode(f64::NAN, 20.0);
        assert_eq!(c.decode_us_per_token(), Some(62_500.0));
        // An engine that decodes in no measurable time: known, negligible.
        let d = CostEstimate::default();
        d.observe_engine_decode(0.0, 100.0);
        assert_eq!(d.decode_us_per_token(), Some(0.001));
        let four_ns = Duration::from_nanos(4);
        assert_eq!(d.prefill_part(ms(30), 4, false), Some(ms(30) - four_ns));
    }

    #[test]
    fn a_queue_head_is_read_whole() {
        assert_eq!(
            unpack_head(pack_head(123_456_789, 4_000)),
            (123_456_789, 4_000)
        );
        assert_eq!(unpack_head(pack_head(1, u64::MAX)), (1, HEAD_TOKENS_MAX));
    }
    #[test]
    fn costs_are_learned_from_ttfb_and_usage() {
        let c = CostEstimate::default();
        assert_eq!(
            c.prefill_us_per_token(100.0, 1),
            100.0,
            "prior until a sample"
        );
        // 1,000 uncached tokens in 200 ms, nothing queued: 200 µs a token.
        c.observe(Duration::from_millis(200), 1_000, 0, true, None);
        assert_eq!(c.prefill_us_per_token(100.0, 1), 200.0);
        assert_eq!(c.queue_us(), 0);
        // A mostly cached turn that waited: 10 uncached tokens (2 ms) in 52 ms.
        c.observe(Duration::from_millis(52), 1_010, 1_000, false, None);
        assert_eq!(
            c.prefill_us_per_token(100.0, 1),
            200.0,
            "too few tokens to learn cost"
        );
        assert_eq!(c.queue_us(), 50_000);
        assert_eq!(
            c.prefill_us_per_token(100.0, 5),
            100.0,
            "prior until 5 samples"
        );
    }
    #[test]
    fn two_answers_a_step_away_move_the_cost_at_once_and_one_spike_does_not() {
        let c = CostEstimate::default();
        // 1,000 tokens alone at 50 µs a token, five times: learned 50.
        for _ in 0..5 {
            c.observe(Duration::from_millis(50), 1_000, 0, true, None);
        }
        assert_eq!(c.learned_us_per_token(), Some(50.0));
        // One answer at 150 µs (a busy host's spike): averaged, 50 + 0.3 × 100.
        c.observe(Duration::from_millis(150), 1_000, 0, true, None);
        assert_eq!(c.learned_us_per_token(), Some(80.0));
        // Back to 50: the spike decays, 80 - 0.3 × 30.
        c.observe(Duration::from_millis(50), 1_000, 0, true, None);
        assert_eq!(c.learned_us_per_token(), Some(71.0));
        // The backend slows 3×: its first slow answer is averaged (71 + 0.3
        // × 79 = 94.7), its second, still 1.5× above that, is taken as is.
        c.observe(Duration::from_millis(150), 1_000, 0, true, None);
        assert_eq!(c.learned_us_per_token(), Some(94.7));
        c.observe(Duration::from_millis(150), 1_000, 0, true, None);
        assert_eq!(c.learned_us_per_token(), Some(150.0));
        // And back down the same way once it recovers.
        c.observe(Duration::from_millis(50), 1_000, 0, true, None);
        c.observe(Duration::from_millis(50), 1_000, 0, true, None);
        assert_eq!(c.learned_us_per_token(), Some(50.0));
    }
    #[test]
    fn an_answer_behind_a_head_past_its_estimate_teaches_a_slowdown() {
        let learned = || {
            let c = CostEstimate::default();
            for _ in 0..5 {
                c.observe(Duration::from_millis(50), 1_000, 0, true, None);
            }
            c
        };
        // The backend slows 3×. Two requests, each sent while the one
        // before had no first byte yet but had run past its estimate (so
        // nothing was counted ahead), answer after 150 ms: slowness, and
        // two of them a step.
        let c = learned();
        for _ in 0..2 {
            c.observe(Duration::from_millis(150), 1_000, 0, false, Some(0));
        }
        assert_eq!(c.learned_us_per_token(), Some(150.0));
        // The same answers sent behind nothing of ours (other requests
        // decoding) explain nothing and teach nothing upwards.
        let d = learned();
        for _ in 0..2 {
            d.observe(Duration::from_millis(150), 1_000, 0, false, None);
        }
        assert_eq!(d.learned_us_per_token(), Some(50.0));
    }
    #[test]
    fn one_long_prefill_teaches_the_cost_before_five_short_ones() {
        let c = CostEstimate::default();
        // Four short prompts alone (2,000 tokens in all, 60 µs a token):
        // too few samples and too few tokens, the prior still holds.
        for _ in 0..4 {
            c.observe(Duration::from_millis(30), 500, 0, true, None);
        }
        assert_eq!(c.learned_us_per_token(), None);
        // A lone 7,000-token prefill in 350 ms (50 µs a token): learned now.
        let d = CostEstimate::default();
        d.observe(Duration::from_millis(350), 7_000, 0, true, None);
        assert_eq!(d.learned_us_per_token(), Some(50.0));
        // So do 5,000 tokens explained as a queue: 1,000 sent behind 4,000.
        let e = CostEstimate::default();
        e.observe(Duration::from_millis(250), 1_000, 0, false, Some(4_000));
        assert_eq!(e.learned_us_per_token(), Some(50.0));
        // A busy response the gateway cannot explain teaches no confidence.
        let f = CostEstimate::default();
        f.observe(Duration::from_millis(350), 7_000, 0, false, None);
        assert_eq!(f.learned_us_per_token(), None);
    }
    #[test]
    fn the_head_of_the_queue_is_timed_from_when_it_began() {
        let c = CostEstimate::default();
        assert_eq!(
            c.queue_at(crate::clock::now_ms() + 500),
            QueueView::default(),
            "nothing queued"
        );
        let before = crate::clock::now_ms();
        let first = c.enqueue(1_000);
        assert_eq!(first.ahead, 0);
        let after = crate::clock::now_ms();
        // The first request starts at once; the second waits behind it.
        let head = c.queue_at(after + 300).head_ms;
        assert!((300..=300 + after - before).contains(&head), "{head}");
        let second = c.enqueue(500);
        assert_eq!(
            c.queue_at(after + 300),
            QueueView {
                tokens: 1_500,
                head_ms: head,
                head_tokens: 1_000
            },
            "a request behind does not restart the head"
        );
        // The clock moves on (a tick is 1-4 ms), then the first answers: the
        // second is the head now, timed from then, not from the first's start.
        while crate::clock::now_ms() <= after + 1 {
            std::hint::spin_loop();
        }
        let answered = crate::clock::now_ms();
        c.dequeue(first.ticket);
        let later = crate::clock::now_ms();
        let q = c.queue_at(later + 50);
        assert!((50..=50 + later - answered).contains(&q.head_ms), "{q:?}");
        assert_eq!((q.tokens, q.head_tokens), (500, 500));
        c.dequeue(second.ticket);
        assert_eq!(c.queue_at(later + 50), QueueView::default(), "queue empty");
    }
    #[test]
    fn answers_in_the_order_sent_are_in_order_and_an_overtaking_pair_is_not() {
        let c = CostEstimate::default();
        let (a, b) = (c.enqueue(1_000), c.enqueue(1_000));
        assert!(c.dequeue(a.ticket), "the head answers first");
        assert!(c.dequeue(b.ticket), "then the one behind it");
        // A long prefill, then two short prompts behind it; the engine
        // answers the first short one before the long one.
        let long = c.enqueue(7_000);
        let short = c.enqueue(300);
        let last = c.enqueue(200);
        assert!(!c.dequeue(short.ticket), "it overtook the long prefill");
        assert!(!c.dequeue(long.ticket), "it was overtaken");
        assert!(c.dequeue(last.ticket), "all sent before it answered first");
        assert!(!c.dequeue(last.ticket), "a ticket already out");
    }
    #[test]
    fn a_first_prompt_counts_what_new_sessions_do_not_find_cached() {
        let c = CostEstimate::default();
        assert_eq!(c.body_estimate(1_264), 1_264, "nothing learned: the body");
        // New sessions' first prompts find the 752-token system prompt.
        for _ in 0..3 {
            c.observe_first_prompt(752);
        }
        assert_eq!(c.shared_prefix(), 752);
        assert_eq!(c.body_estimate(1_264), 512);
        assert_eq!(c.body_estimate(7_014), 6_262);
        // A prompt shorter than that prefix still counts a quarter of itself.
        assert_eq!(c.body_estimate(800), 200);
    }
    #[test]
    fn a_request_leaving_from_behind_the_head_leaves_the_head_as_it_was() {
        let c = CostEstimate::default();
        let head = c.enqueue(7_000);
        let behind = c.enqueue(300);
        let last = c.enqueue(200);
        let now = crate::clock::now_ms();
        let started = c.queue_at(now + 100);
        // The one in the middle ends first (its client left): the head is
        // still the 7,000-token prefill, still timed from its start.
        while crate::clock::now_ms() <= now + 1 {
            std::hint::spin_loop();
        }
        c.abandon(behind.ticket);
        assert_eq!(
            c.queue_at(now + 100),
            QueueView {
                tokens: 7_200,
                ..started
            }
        );
        // A ticket already out, or none, takes nothing.
        c.abandon(behind.ticket);
        c.dequeue(0);
        assert_eq!(c.queued_tokens(), 7_200);
        // The one that left without an answer overtook nobody.
        assert!(c.dequeue(head.ticket), "the head still answered in order");
        assert_eq!(c.queue_at(crate::clock::now_ms()).head_tokens, 200);
        c.dequeue(last.ticket);
        assert_eq!(c.queue_at(now), QueueView::default());
    }
    #[test]
    fn a_busy_backend_shows_its_queue_not_a_higher_cost_per_token() {
        let c = CostEstimate::default();
        // 100 µs a token, learned from a response served alone.
        c.observe(Duration::from_millis(100), 1_000, 0, true, None);
        // Then every response queues 300 ms behind others.
        for _ in 0..20 {
            c.observe(Duration::from_millis(400), 1_000, 0, false, None);
        }
        assert_eq!(
            c.prefill_us_per_token(0.0, 1),
            100.0,
            "queueing is not slowness"
        );
        let queue = c.queue_us();
        assert!(queue > 250_000, "the queue shows: {queue} µs");
        // A busy response faster than the estimate pulls it down...
        c.observe(Duration::from_millis(50), 1_000, 0, false, None);
        assert!(c.prefill_us_per_token(0.0, 1) < 100.0);
        // ...and a backend that slows down teaches it when served alone.
        for _ in 0..20 {
            c.observe(Duration::from_millis(300), 1_000, 0, true, None);
        }
        assert!(c.prefill_us_per_token(0.0, 1) > 290.0);
    }
    #[test]
    fn behind_queued_prefills_the_ttfb_teaches_the_cost_of_them_all() {
        let c = CostEstimate::default();
        // Two requests of 1,000 tokens are queued; the third goes in behind
        // them. (Sent before any cost is learned, so the head's progress,
        // which depends on the clock, takes nothing off.)
        let first = c.enqueue(1_000);
        let second = c.enqueue(1_000);
        assert_eq!((first.ahead, second.ahead), (0, 1_000));
        assert_eq!((first.behind(), second.behind()), (None, Some(1_000)));
        let third = c.enqueue(300);
        let ahead = third.ahead;
        assert_eq!(ahead, 2_000);
        assert_eq!(c.queued_tokens(), 2_300);
        // 50 µs a token, learned alone.
        for _ in 0..5 {
            c.observe(Duration::from_millis(50), 1_000, 0, true, None);
        }
        assert_eq!(c.prefill_us_per_token(0.0, 5), 50.0);
        // The backend slowed to 150 µs a token: the third's 2,300 tokens take
        // 345 ms. Served behind them, busy responses teach it (not only ones
        // served alone, which a loaded backend never sends).
        for _ in 0..10 {
            c.observe(Duration::from_millis(345), 1_300, 1_000, false, Some(ahead));
        }
        let learned = c.prefill_us_per_token(0.0, 5);
        assert!((140.0..=150.0).contains(&learned), "{learned} µs a token");
        c.dequeue(first.ticket);
        c.dequeue(second.ticket);
        c.dequeue(third.ticket);
        assert_eq!(c.queued_tokens(), 0);
    }

    #[test]
    fn an_answer_votes_whether_it_waited_for_the_prefill_ahead_of_it() {
        let c = CostEstimate::default();
        let ms = Duration::from_millis;
        // Nothing taught what one prefill costs on its own: no vote, and
        // nothing sent now knows the work ahead of it.
        assert_eq!(c.prefill_vote(ms(300), 1_000, ms(200)), None);
        let head = c.enqueue(2_000);
        assert_eq!(c.enqueue(1_000).work_ahead_ns, 0);
        assert!(c.observe_own(ms(100), 1_000)); // 100 µs a token
                                                // Now the 3,000 tokens queued are 300 ms ahead (less what the head did).
        let behind = c.enqueue(1_000);
        assert!(
            (250_000_000..=300_000_000).contains(&behind.work_ahead_ns),
            "{behind:?}"
        );
        c.dequeue(head.ticket);
        // Behind 200 ms with 1,000 tokens (100 ms) of its own: 300 ms waited
        // for them, 110 ms ran beside them.
        assert_eq!(c.prefill_vote(ms(300), 1_000, ms(200)), Some(true));
        assert_eq!(c.prefill_vote(ms(110), 1_000, ms(200)), Some(false));
        // 10 ms of work ahead is noise.
        assert_eq!(c.prefill_vote(ms(300), 1_000, ms(10)), None);
        // A short prompt behind a long prefill tells the most.
        assert_eq!(c.prefill_vote(ms(205), 50, ms(200)), Some(true));
        assert_eq!(c.prefill_vote(ms(8), 50, ms(200)), Some(false));
        // Behind another gateway's prefill, known roughly: only a wait of
        // three quarters of it or more, or a quarter or less, votes.
        assert_eq!(c.prefill_vote_rough(ms(260), 1_000, ms(200)), Some(true));
        assert_eq!(c.prefill_vote_rough(ms(140), 1_000, ms(200)), Some(false));
        assert_eq!(c.prefill_vote_rough(ms(200), 1_000, ms(200)), None);
        assert_eq!(c.prefill_vote(ms(200), 1_000, ms(200)), Some(true));
    }

    /// Sent behind another gateway's prefill (the fleet's queue said how
    /// much, and for how long it had run), a request counts it as work
    /// ahead, less its progress; with none, nothing changes.
    #[test]
    fn prefill_elsewhere_counts_as_work_ahead_less_its_progress() {
        let c = CostEstimate::default();
        assert!(c.observe_own(Duration::from_millis(100), 1_000)); // 100 µs a token
        let q = c.enqueue(500);
        assert_eq!(c.behind_elsewhere(q, 0, 0), q);
        let q = c.behind_elsewhere(q, 2_000, 50); // 500 of the 2,000 done
        assert!(q.behind);
        assert_eq!(q.work_ahead_ns, 1_500 * 100_000);
    }
}
