//! Prefix-aware routing (`affinity.prefix`): a conversation is routed
//! whether or not its client names it, and a new binding goes where its
//! prompt's prefix is already cached when that saves time.
//!
//! - [`prompt`]: the canonical prompt of a request body and its chained
//!   block hashes;
//! - [`conversation`]: which conversation a prompt without a session key
//!   belongs to, by how far its blocks agree with earlier prompts';
//! - [`index`]: which backends recently computed which prefixes, corrected
//!   by the cached tokens engines report.
//!
//! [`PromptRoute`] carries one request's prompt through the gateway — read,
//! named, looked up, routed, settled by the answer — so that the workflow
//! has one owner; placement reads what it found through
//! [`crate::affinity::Candidate::prefix_tokens`] and
//! [`crate::affinity::Candidate::probation`].

pub mod conversation;
pub mod index;
pub mod prompt;
mod xxh3;

use crate::affinity::candidate::Candidate;
use conversation::{Conversation, Conversations};
use index::{Held, PrefixIndex};
use prompt::{Chunker, Prompt};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

/// `affinity.prefix`, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixConfig {
    pub enabled: bool,
    /// Bytes of canonical prompt per index block (about a quarter as many tokens).
    pub block_bytes: usize,
    /// Memory the index and the conversations' ends may take.
    pub max_memory_bytes: usize,
    /// Bytes of a prompt hashed at most; the rest routes by what was read.
    pub max_read_bytes: usize,
    /// How long a backend is taken to hold a prefix it served.
    pub ttl: Duration,
    /// How long a new keyless conversation counts as a session of its
    /// backend before a second turn binds it.
    pub probation: Duration,
}

impl Default for PrefixConfig {
    fn default() -> Self {
        PrefixConfig {
            enabled: true,
            block_bytes: 1024,
            max_memory_bytes: 64 << 20,
            max_read_bytes: 1 << 20,
            ttl: Duration::from_secs(600),
            probation: Duration::from_secs(60),
        }
    }
}

/// The share of `max_memory_bytes` the conversations' ends take; the index
/// takes the rest.
const ENDS_SHARE: usize = 8;

pub struct Prefix {
    block_bytes: usize,
    seed: u64,
    enabled: AtomicBool,
    max_read_bytes: AtomicUsize,
    pub index: PrefixIndex,
    pub conversations: Conversations,
}

/// One request's prompt on its way through the gateway.
#[derive(Debug)]
pub struct PromptRoute {
    prompt: Prompt,
    /// The conversation it belongs to (requests without a session key).
    conversation: Option<Conversation>,
    /// The candidates of the last look-up, and what each held of it.
    slots: Vec<u32>,
    held: Vec<Held>,
    /// Where it went, and what the index said that backend held.
    routed: Option<(u32, Held)>,
    block_bytes: usize,
}

impl Prefix {
    /// `seed` derives from `affinity.hash_key` (every gateway of a fleet
    /// cuts and names prompts alike); ends live `ends_ttl` at most (the
    /// bindings' TTL: a bound conversation's next turn must find its end).
    pub fn new(cfg: &PrefixConfig, seed: u64, ends_ttl: Duration) -> Self {
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
            conversations: Conversations::new(
                ends_bytes / conversation::END_BYTES,
                cfg.probation.as_millis() as u64,
                ends_ttl.as_millis() as u64,
            ),
        }
    }

    /// Apply the settings a reload may change (`enabled`, `max_read_bytes`,
    /// `probation_seconds`, and the bindings' TTL the ends follow).
    pub fn configure(&self, cfg: &PrefixConfig, ends_ttl: Duration) {
        self.enabled.store(cfg.enabled, Ordering::Relaxed);
        self.max_read_bytes
            .store(cfg.max_read_bytes, Ordering::Relaxed);
        self.conversations.configure(
            cfg.probation.as_millis() as u64,
            ends_ttl.as_millis() as u64,
        );
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    /// The prompt of a body whose top-level members `field` gives, cached
    /// under `scope` (its tier and tenant) and `model`; `keyless`: its
    /// client named no session, and the conversation it belongs to is
    /// found; `markers`: it is an Anthropic Messages request, whose
    /// `cache_control` markers are left out. `None` when disabled or when
    /// the body has no prompt routing can read.
    pub fn read<'a>(
        &self,
        scope: &str,
        model: Option<&str>,
        keyless: bool,
        markers: bool,
        fields: impl prompt::Fields<'a>,
    ) -> Option<PromptRoute> {
        if !self.enabled() {
            return None;
        }
        let chunker = Chunker {
            block_bytes: self.block_bytes,
            max_read_bytes: self.max_read_bytes.load(Ordering::Relaxed),
            seed: self.seed,
        };
        let (prompt, canon) = chunker.prompt(scope, model, markers, fields)?;
        let conversation = keyless.then(|| {
            self.conversations
                .identify(&prompt, &canon, self.block_bytes, crate::clock::now_ms())
        });
        Some(PromptRoute {
            prompt,
            conversation,
            slots: Vec::new(),
            held: Vec::new(),
            routed: None,
            block_bytes: self.block_bytes,
        })
    }

    /// Fill in each candidate's [`Candidate::probation`]: the new keyless
    /// conversations that count as its sessions.
    pub fn fill_probation(&self, candidates: &mut [Candidate]) {
        for c in candidates {
            c.probation = self.conversations.probation(c.slot);
        }
    }

    /// Background upkeep: conversations whose probation ran out stop
    /// counting, ends past their TTL go.
    pub fn sweep(&self) -> usize {
        self.conversations.sweep(crate::clock::now_ms())
    }

    /// Forget what is known of `slot`: its backend left.
    pub fn forget_backend(&self, slot: u32) {
        self.index.forget_backend(slot);
        self.conversations.forget_backend(slot);
    }
}

impl PromptRoute {
    pub fn prompt(&self) -> &Prompt {
        &self.prompt
    }

    /// The conversation of a request without a session key.
    pub fn conversation(&self) -> Option<&Conversation> {
        self.conversation.as_ref()
    }

    /// Estimated tokens of the prompt.
    pub fn tokens(&self) -> u64 {
        self.prompt.tokens_of(self.prompt.full_bytes)
    }

    /// Fill in each candidate's [`Candidate::prefix_tokens`]: how much of
    /// the prompt the index says it holds.
    pub fn look_up(&mut self, prefix: &Prefix, candidates: &mut [Candidate]) {
        self.slots.clear();
        self.slots.extend(candidates.iter().map(|c| c.slot));
        self.held = prefix
            .index
            .lookup(&self.prompt.blocks, &self.slots, prefix.index.now());
        for (c, h) in candidates.iter_mut().zip(&self.held) {
            c.prefix_tokens = self
                .prompt
                .block_tokens(h.blocks as usize, prefix.block_bytes);
        }
    }

    /// The request goes to `slot`, bound or not (a keyless conversation on
    /// probation): from now on the index takes that backend to hold the
    /// whole prompt (pending until [`PromptRoute::settle`]), and the
    /// conversation's end names it. Returns the tokens of the prompt the
    /// index said were held there.
    pub fn routed(&mut self, prefix: &Prefix, slot: u32, bound: bool) -> u64 {
        let here = self
            .slots
            .iter()
            .position(|&s| s == slot)
            .map(|i| self.held[i])
            .unwrap_or_default();
        prefix
            .index
            .record(&self.prompt.blocks, slot, prefix.index.now(), false);
        if let Some(c) = &self.conversation {
            let most = self.held.iter().map(|h| h.blocks).max().unwrap_or(0);
            prefix
                .conversations
                .place(c, slot, bound, most as usize * prefix.block_bytes);
        }
        self.routed = Some((slot, here));
        self.prompt
            .block_tokens(here.blocks as usize, prefix.block_bytes)
    }

    /// A new conversation here that a fleet's other gateway may have seen:
    /// the keys its earlier turns were filed under, the latest first.
    pub fn fleet_lookups(&self) -> Option<&[u64]> {
        let c = self.conversation.as_ref()?;
        (c.n_earlier > 0).then(|| &c.earlier[..c.n_earlier as usize])
    }

    /// It continues conversation `id`, which a fleet's other gateway routed
    /// last to `slot` (`bound`: and bound there).
    pub fn continue_fleets(&mut self, prefix: &Prefix, id: u128, slot: u32, bound: bool) {
        if let Some(c) = self.conversation.as_mut() {
            prefix.conversations.continue_fleets(c, id, slot, bound);
        }
    }

    /// What a fleet's store files of its conversation once it is routed:
    /// where it ends exactly, its name, and the end it continued (which
    /// the store forgets).
    pub fn fleet_end(&self) -> Option<(u64, u128, Option<u64>)> {
        let c = self.conversation.as_ref()?;
        Some((c.exact?, c.id, c.continued_key))
    }

    /// Tokens of the prompt the index said its backend held, once routed.
    pub fn prefix_tokens(&self) -> Option<u64> {
        let (_, held) = self.routed?;
        Some(
            self.prompt
                .block_tokens(held.blocks as usize, self.block_bytes),
        )
    }

    /// Whether the last look-up found any candidate holding part of it.
    pub fn matched(&self) -> bool {
        self.held.iter().any(|h| h.blocks > 0)
    }

    /// The backend answered (`ok`), and its `usage` said `prompt_tokens`
    /// and, when the engine reports them, how many were cached: the backend
    /// holds the prompt now, and a report of far fewer cached tokens than
    /// the index promised corrects it (that backend evicted). An engine that
    /// reports none (vLLM without `--enable-prompt-tokens-details`, SGLang
    /// without `--enable-cache-report`) corrects nothing: no report is not
    /// a report of nothing cached. Returns whether the index was corrected.
    pub fn settle(&self, prefix: &Prefix, ok: bool, usage: Option<(u64, Option<u64>)>) -> bool {
        let Some((slot, held)) = self.routed else {
            return false;
        };
        if !ok {
            return false;
        }
        let corrected = match usage {
            Some((prompt_tokens, Some(cached))) if prompt_tokens > 0 => {
                // The engine's own count, in blocks of the canonical prompt.
                let share = cached.min(prompt_tokens) as f64 / prompt_tokens as f64;
                let full = self.prompt.full_bytes as f64;
                let blocks = (share * full / prefix.block_bytes as f64) as u64;
                prefix.index.observe(slot, held, blocks, prefix.index.now())
            }
            _ => false,
        };
        let from = (held.confirmed as usize).min(self.prompt.blocks.len());
        prefix
            .index
            .record(&self.prompt.blocks[from..], slot, prefix.index.now(), true);
        corrected
    }
}
