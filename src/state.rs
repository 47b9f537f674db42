//! Bindings that survive a restart or an upgrade: saved to `server.state_file`
//! periodically and at shutdown (written to a temporary file, then renamed),
//! and merged back at start. A forgotten binding costs a full prefill on a GPU.
//!
//! Format: JSON lines. The first line is a header with the format version, a
//! keyed fingerprint of `affinity.hash_key` (bindings are keyed with it, so a
//! file from another key is ignored) and the wall-clock save time. Each other
//! line is one binding: key, tier name, backend id, version and the idle time
//! it had left (a binding in flight at save time gets a full TTL).

use crate::affinity::hrw::KeyKind;
use crate::affinity::Binding;
use crate::gateway::Gateway;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

const FORMAT: u32 = 1;

#[derive(Serialize, Deserialize)]
struct Header {
    format: u32,
    key_id: String,
    saved_at_ms: u64,
}

#[derive(Serialize, Deserialize)]
struct Line {
    k: String,
    tier: String,
    backend: String,
    v: u32,
    ttl_ms: u64,
}

fn key_id(gw: &Gateway) -> String {
    let routing = gw.routing();
    format!(
        "{:032x}",
        routing
            .hasher
            .fingerprint(KeyKind::Session, "state-file", "key-id")
    )
}

/// Write every live binding to `path` atomically; returns how many.
pub fn save(gw: &Gateway, path: &Path) -> std::io::Result<usize> {
    let routing = gw.routing();
    let affinity = &gw.affinity;
    let now = affinity.now_ms();
    let ttl_ms = affinity.ttl().map_or(0, |d| d.as_millis() as u64);
    let tier_names: std::collections::HashMap<u16, &str> =
        routing.tiers.iter().map(|t| (t.index, &*t.name)).collect();
    let mut out = Vec::with_capacity(64 * 1024);
    serde_json::to_writer(
        &mut out,
        &Header {
            format: FORMAT,
            key_id: key_id(gw),
            saved_at_ms: crate::clock::unix_ms(),
        },
    )?;
    out.push(b'\n');
    let mut n = 0;
    for (key, b) in affinity.bindings() {
        let (Some(tier), Some(backend)) = (tier_names.get(&b.tier), gw.slots.backend_id(b.backend))
        else {
            continue;
        };
        if b.pending {
            continue;
        }
        let remaining = if b.in_flight > 0 {
            ttl_ms
        } else {
            b.deadline_ms.saturating_sub(now)
        };
        serde_json::to_writer(
            &mut out,
            &Line {
                k: format!("{key:032x}"),
                tier: tier.to_string(),
                backend,
                v: b.version,
                ttl_ms: remaining,
            },
        )?;
        out.push(b'\n');
        n += 1;
    }
    // A unique temporary name: during an upgrade two instances save at once.
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&out)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    Ok(n)
}

/// Merge the bindings saved in `path` into the table (a binding already
/// present with an equal or newer version wins). Returns how many were restored.
pub fn load(gw: &Gateway, path: &Path) -> std::io::Result<usize> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(e) => return Err(e),
    };
    let mut lines = text.lines();
    let Some(header) = lines
        .next()
        .and_then(|l| serde_json::from_str::<Header>(l).ok())
    else {
        log::warn!("state file {} has no valid header; ignored", path.display());
        return Ok(0);
    };
    if header.format != FORMAT || header.key_id != key_id(gw) {
        log::warn!(
            "state file {} was written with another format or hash_key; ignored",
            path.display()
        );
        return Ok(0);
    }
    let elapsed = crate::clock::unix_ms().saturating_sub(header.saved_at_ms);
    let routing = gw.routing();
    let affinity = &gw.affinity;
    let now = affinity.now_ms();
    let mut saved = Vec::new();
    for line in lines {
        let Ok(l) = serde_json::from_str::<Line>(line) else {
            continue;
        };
        let Ok(key) = u128::from_str_radix(&l.k, 16) else {
            continue;
        };
        let Some(tier) = routing.tier_by_name(&l.tier) else {
            continue;
        };
        let Some(backend) = tier.backend_by_id(&l.backend) else {
            continue; // the backend left the tier while we were down
        };
        let ttl = l.ttl_ms.saturating_sub(elapsed);
        if ttl == 0 {
            continue;
        }
        saved.push((
            key,
            Binding {
                backend: backend.slot,
                version: l.v,
                tier: tier.index,
                in_flight: 0,
                deadline_ms: now + ttl,
                pending: false,
                moves: Default::default(),
            },
        ));
    }
    // The table keeps idle bindings in expiry order (its sweep stops at the
    // first live one) and restores each as the next to expire: insert
    // latest-expiring first.
    saved.sort_by_key(|(_, b)| std::cmp::Reverse(b.deadline_ms));
    let restored = saved.len();
    for (key, b) in saved {
        affinity.restore(key, b);
    }
    Ok(restored)
}
