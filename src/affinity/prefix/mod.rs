//! Prefix-aware routing (`affinity.prefix`): a conversation is bound whether
//! or not its client names it, and a new binding goes where its prompt's
//! prefix is already cached when that saves time.
//!
//! - [`prompt`]: the canonical prompt of a request body, its chained block
//!   hashes, and the conversation's anchor (its implicit session key);
//! - [`ends`]: the conversation of a prompt without messages, found through
//!   the earlier prompt it extends;
//! - [`index`]: which backends recently computed which prefixes, corrected
//!   by the cached tokens engines report.
//!
//! Placement reads the index through [`crate::affinity::Candidate::prefix_tokens`].

pub mod ends;
pub mod index;
pub mod prompt;

use super::Candidate;
use index::PrefixIndex;
use prompt::{Chunker, Prompt};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// `affinity.prefix`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixConfig {
    pub enabled: bool,
    /// Bytes of canonical prompt per index block (about a quarter as many tokens).
    pub block_bytes: usize,
    /// Memory the index and the conversation ends may take.
    pub max_memory_bytes: usize,
    /// Bytes of a prompt hashed at most; the rest routes by what was read.
    pub max_read_bytes: usize,
    /// How long a backend is taken to hold a prefix it served.
    pub ttl: Duration,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            enabled: true,
            block_bytes: 1024,
            max_memory_bytes: 64 << 20,
            max_read_bytes: 1 << 20,
            ttl: Duration::from_secs(600),
        }
    }
}

/// The share of `max_memory_bytes` the conversation ends take; the index
/// takes the rest.
const ENDS_SHARE: usize = 8;

pub struct Prefix {
    block_bytes: usize,
    seed: u64,
    enabled: AtomicBool,
    max_read_bytes: AtomicUsize,
    pub index: PrefixIndex,
    pub ends: ends::Ends,
}

/// How much of the prompt a request routed with its chosen backend held.
#[derive(Clone, Debug)]
pub struct Routed {
    pub slot: u32,
    pub held: index::Held,
    pub block_bytes: usize,
}

impl Routed {
    /// Estimated tokens of `p` held there.
    pub fn tokens(&self, p: &Prompt) -> u64 {
        p.block_tokens(self.held.blocks as usize, self.block_bytes)
    }
}

impl Prefix {
    /// `seed` derives from `affinity.hash_key` (every gateway of a fleet
    /// cuts and names prompts alike).
    pub fn new(cfg: &PrefixConfig, seed: u64) -> Self {
        let ends_bytes = cfg.max_memory_bytes / ENDS_SHARE;
        Prefix {
            block_bytes: cfg.block_bytes,
            seed,
            enabled: AtomicBool::new(cfg.enabled),
            max_read_bytes: AtomicUsize::new(cfg.max_read_bytes),
            index: PrefixIndex::new(
                cfg.max_memory_bytes - ends_bytes,
                cfg.ttl.as_millis() as u64,
            ),
            ends: ends::Ends::new(ends_bytes / ends::END_BYTES),
        }
    }

    /// Apply the settings a reload may change (`enabled`, `max_read_bytes`).
    pub fn configure(&self, cfg: &PrefixConfig) {
        self.enabled.store(cfg.enabled, Ordering::Relaxed);
        self.max_read_bytes
            .store(cfg.max_read_bytes, Ordering::Relaxed);
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The prompt of a body whose top-level members `field` gives, scoped
    /// to the tier it is cached in; `None` when disabled or when the body
    /// has no prompt routing can read.
    pub fn read<'a>(
        &self,
        tier: &str,
        model: Option<&str>,
        field: impl Fn(&str) -> Option<&'a [u8]>,
    ) -> Option<Prompt> {
        if !self.enabled() {
            return None;
        }
        let chunker = Chunker {
            block_bytes: self.block_bytes,
            max_read_bytes: self.max_read_bytes.load(Ordering::Relaxed),
            seed: self.seed,
        };
        chunker.prompt(tier, model, field)
    }

    /// The conversation `p` belongs to: its anchor, or for a prompt without
    /// messages the conversation whose earlier prompt it extends.
    pub fn conversation(&self, p: &Prompt) -> u128 {
        p.anchor
            .unwrap_or_else(|| self.ends.conversation(p, self.block_bytes))
    }

    /// Fill in each candidate's [`Candidate::prefix_tokens`] for `p`.
    /// Returns what each holds.
    pub fn look_up(&self, p: &Prompt, candidates: &mut [Candidate]) -> Vec<index::Held> {
        let slots: Vec<u32> = candidates.iter().map(|c| c.slot).collect();
        let held = self.index.lookup(&p.blocks, &slots, self.index.now());
        for (c, h) in candidates.iter_mut().zip(&held) {
            c.prefix_tokens = p.block_tokens(h.blocks as usize, self.block_bytes);
        }
        held
    }

    /// The request with prompt `p` goes to `slot`, which held `held` of it:
    /// from now on the index takes it to hold the whole prompt (pending
    /// until [`Prefix::answered`]).
    pub fn routed(&self, p: &Prompt, slot: u32, held: index::Held) -> Routed {
        self.index.record(&p.blocks, slot, self.index.now(), false);
        Routed {
            slot,
            held,
            block_bytes: self.block_bytes,
        }
    }

    /// The backend answered the routed request: it holds the prompt now.
    pub fn answered(&self, p: &Prompt, routed: &Routed) {
        let from = (routed.held.confirmed as usize).min(p.blocks.len());
        self.index
            .record(&p.blocks[from..], routed.slot, self.index.now(), true);
    }

    /// What a routed request's answer showed: `cached` of its `prompt_tokens`
    /// were cached at the backend it went to. Returns whether the index was
    /// corrected (the backend had evicted).
    pub fn observe(&self, p: &Prompt, routed: &Routed, prompt_tokens: u64, cached: u64) -> bool {
        if prompt_tokens == 0 {
            return false;
        }
        // The engine's own count, in blocks of the canonical prompt.
        let share = cached.min(prompt_tokens) as f64 / prompt_tokens as f64;
        let blocks = (share * p.full_bytes as f64 / self.block_bytes as f64) as u64;
        self.index
            .observe(routed.slot, routed.held, blocks, self.index.now())
    }
}
