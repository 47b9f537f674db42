//! Client keys (`auth.keys_file`): who a request is (its tenant), its
//! default priority class and fair-share weight, and the tenant's limits
//! (what they allow is [`crate::admission::tenant`]'s).
//!
//! The file holds only SHA-256 digests of the keys (`agent-gateway hash-key`
//! prints one); a presented key is hashed and its digest looked up, then
//! compared in constant time. Keys never reach logs, traces or metric labels:
//! tenants are named by the file. The file is re-read on SIGHUP; a tenant's
//! counters (in flight, its rate buckets) outlive a reload.
//!
//! ```yaml
//! keys:
//!   - key_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//!     tenant: acme
//!     priority: interactive      # its requests' class unless they name one
//!     weight: 2                  # fair share against other tenants
//!     max_in_flight: 16          # 0: no limit (the same for the two below)
//!     requests_per_minute: 600
//!     tokens_per_minute: 200000  # prompt + completion: estimated up front, settled from usage
//! ```

use crate::admission::tenant::{Client, Limits, Tenant};
use crate::admission::Class;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// The most keys a file may hold (it is read into memory whole).
pub const MAX_KEYS: usize = 100_000;
const MAX_FILE_BYTES: u64 = 64 << 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileKeys {
    #[serde(default)]
    keys: Vec<FileKey>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileKey {
    key_sha256: String,
    tenant: String,
    #[serde(default)]
    priority: Option<String>,
    #[serde(default = "one")]
    weight: u32,
    #[serde(default)]
    max_in_flight: u32,
    #[serde(default)]
    requests_per_minute: u32,
    #[serde(default)]
    tokens_per_minute: u64,
}

fn one() -> u32 {
    1
}

/// The hex SHA-256 of a key, as the keys file holds it.
pub fn hash_key(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.is_ascii() {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

/// Keys recognised before, by a SipHash-1-3 (128 bits, a random key per
/// key set) of the key, at most this many: a known key costs one keyed hash
/// instead of a SHA-256 (which was most of what keys cost a request). Only
/// keys that matched are remembered, so unknown keys cannot fill it.
const MAX_RECOGNISED: usize = 10_000;

/// The keys in force and the tenants they name.
#[derive(Default)]
pub struct Keys {
    by_digest: HashMap<[u8; 32], Arc<Client>>,
    /// Tenant names, sorted (the only tenant labels metrics use).
    pub tenants: Vec<Arc<str>>,
    recognised: parking_lot::RwLock<HashMap<u128, Arc<Client>>>,
    sip_key: [u8; 16],
}

impl Keys {
    pub fn len(&self) -> usize {
        self.by_digest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_digest.is_empty()
    }

    /// Parse a keys file's text; `tenants` supplies (and keeps) each
    /// tenant's live counters. Every problem is reported, by key index.
    fn parse(text: &str, tenants: &mut HashMap<String, Arc<Tenant>>) -> Result<Keys, String> {
        let file: FileKeys = serde_yaml::from_str(text).map_err(|e| format!("keys file: {e}"))?;
        if file.keys.len() > MAX_KEYS {
            return Err(format!("keys file: more than {MAX_KEYS} keys"));
        }
        let mut errors = Vec::new();
        let mut keys = Keys {
            sip_key: rand::random(),
            ..Keys::default()
        };
        for (i, k) in file.keys.iter().enumerate() {
            let at = format!("keys[{i}]");
            let Some(digest) = parse_digest(&k.key_sha256) else {
                errors.push(format!(
                    "{at}.key_sha256: must be 64 hex digits (agent-gateway hash-key prints it)"
                ));
                continue;
            };
            let valid_name = !k.tenant.is_empty()
                && k.tenant.len() <= 64
                && k.tenant
                    .bytes()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'));
            if !valid_name || k.tenant == "other" {
                errors.push(format!(
                    "{at}.tenant: 1-64 letters, digits, `-`, `_`, `.` (and not `other`, which names the keyless)"
                ));
                continue;
            }
            let class = match k.priority.as_deref().map(Class::parse) {
                None => None,
                Some(Some(c)) => Some(c),
                Some(None) => {
                    errors.push(format!("{at}.priority: interactive | normal | batch"));
                    continue;
                }
            };
            if k.weight == 0 || k.weight > 1000 {
                errors.push(format!("{at}.weight: must be 1-1000"));
                continue;
            }
            let tenant = Arc::clone(
                tenants
                    .entry(k.tenant.clone())
                    .or_insert_with(|| Arc::new(Tenant::new(&k.tenant))),
            );
            let client = Client {
                tenant,
                class,
                weight: k.weight,
                limits: Limits {
                    max_in_flight: k.max_in_flight,
                    requests_per_minute: k.requests_per_minute,
                    tokens_per_minute: k.tokens_per_minute,
                },
            };
            if keys.by_digest.insert(digest, Arc::new(client)).is_some() {
                errors.push(format!("{at}.key_sha256: the same key is listed twice"));
            }
        }
        if !errors.is_empty() {
            return Err(format!("keys file: {}", errors.join("; ")));
        }
        let mut names: Vec<Arc<str>> = keys
            .by_digest
            .values()
            .map(|c| Arc::clone(&c.tenant.name))
            .collect();
        names.sort();
        names.dedup();
        keys.tenants = names;
        Ok(keys)
    }

    /// What `key` grants, if it is one of these.
    pub fn look_up(&self, key: &[u8]) -> Option<Arc<Client>> {
        use std::hash::Hasher;
        let mut sip = siphasher::sip128::SipHasher13::new_with_key(&self.sip_key);
        sip.write(key);
        let tag = siphasher::sip128::Hasher128::finish128(&sip).as_u128();
        if let Some(c) = self.recognised.read().get(&tag) {
            return Some(Arc::clone(c));
        }
        let digest: [u8; 32] = Sha256::digest(key).into();
        let (stored, client) = self.by_digest.get_key_value(&digest)?;
        // The map found it by the digest's hash; the digest itself is
        // compared without an early exit.
        if !bool::from(stored.ct_eq(&digest)) {
            return None;
        }
        let mut recognised = self.recognised.write();
        if recognised.len() < MAX_RECOGNISED {
            recognised.insert(tag, Arc::clone(client));
        }
        Some(Arc::clone(client))
    }
}

/// The keys in force, swapped whole on reload.
#[derive(Default)]
pub struct Auth {
    keys: ArcSwap<Keys>,
    /// Every tenant a keys file has named, with its live counters.
    tenants: Mutex<HashMap<String, Arc<Tenant>>>,
}

impl Auth {
    /// Read `path` and put its keys in force; the old ones stay on error.
    pub fn load(&self, path: &Path) -> Result<usize, String> {
        let len = std::fs::metadata(path)
            .map_err(|e| format!("keys file {}: {e}", path.display()))?
            .len();
        if len > MAX_FILE_BYTES {
            return Err(format!("keys file {}: over 64 MiB", path.display()));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("keys file {}: {e}", path.display()))?;
        self.load_text(&text)
    }

    pub fn load_text(&self, text: &str) -> Result<usize, String> {
        let mut tenants = self.tenants.lock();
        let keys = Keys::parse(text, &mut tenants)?;
        // Forget tenants no key names any more (their counters with them).
        tenants.retain(|name, _| keys.tenants.iter().any(|t| &**t == name));
        let n = keys.len();
        self.keys.store(Arc::new(keys));
        Ok(n)
    }

    pub fn keys(&self) -> arc_swap::Guard<Arc<Keys>> {
        self.keys.load()
    }
}

/// The client key a request presents: `Authorization: Bearer <key>`, else
/// `x-api-key: <key>`.
pub fn presented_key(headers: &http::HeaderMap) -> Option<&[u8]> {
    if let Some(v) = headers.get(http::header::AUTHORIZATION) {
        let v = v.as_bytes();
        if v.len() > 7 && v[..7].eq_ignore_ascii_case(b"bearer ") {
            return Some(v[7..].trim_ascii());
        }
    }
    headers.get("x-api-key").map(|v| v.as_bytes().trim_ascii())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(entries: &[(&str, &str, &str)]) -> String {
        let mut s = String::from("keys:\n");
        for (key, tenant, extra) in entries {
            s += &format!(
                "  - key_sha256: {}\n    tenant: \"{tenant}\"\n{extra}",
                hash_key(key)
            );
        }
        s
    }

    #[test]
    fn a_key_finds_its_tenant_and_nothing_else_does() {
        let auth = Auth::default();
        let n = auth
            .load_text(&file(&[
                (
                    "sk-quiet",
                    "quiet",
                    "    priority: interactive\n    weight: 3\n",
                ),
                ("sk-noisy", "noisy", ""),
            ]))
            .unwrap();
        assert_eq!(n, 2);
        let keys = auth.keys();
        let q = keys.look_up(b"sk-quiet").unwrap();
        assert_eq!(&*q.tenant.name, "quiet");
        assert_eq!((q.class, q.weight), (Some(Class::Interactive), 3));
        assert!(keys.look_up(b"sk-quie").is_none());
        assert!(keys.look_up(b"").is_none());
        assert_eq!(keys.tenants, vec![Arc::from("noisy"), Arc::from("quiet")]);
    }

    #[test]
    fn a_bad_file_is_refused_whole_and_the_old_keys_stay() {
        let auth = Auth::default();
        auth.load_text(&file(&[("sk-a", "a", "")])).unwrap();
        for bad in [
            "keys:\n  - key_sha256: nothex\n    tenant: a\n".to_string(),
            file(&[("sk-b", "b c", "")]),
            file(&[("sk-b", "other", "")]),
            file(&[("sk-b", "b", "    priority: urgent\n")]),
            file(&[("sk-b", "b", "    weight: 0\n")]),
            file(&[("sk-b", "b", ""), ("sk-b", "c", "")]),
            file(&[("sk-b", "b", "    colour: red\n")]),
            "keys: [".to_string(),
        ] {
            assert!(auth.load_text(&bad).is_err(), "accepted {bad:?}");
            assert!(auth.keys().look_up(b"sk-a").is_some());
        }
    }

    #[test]
    fn a_tenants_counters_outlive_a_reload_that_keeps_it() {
        let auth = Auth::default();
        let f = file(&[("sk-a", "a", "    max_in_flight: 1\n")]);
        auth.load_text(&f).unwrap();
        let held = auth.keys().look_up(b"sk-a").unwrap().take().unwrap();
        auth.load_text(&f).unwrap();
        let again = auth.keys().look_up(b"sk-a").unwrap();
        assert_eq!(again.take().err().map(|e| e.limit), Some("max_in_flight"));
        drop(held);
        assert!(again.take().is_ok());
    }

    #[test]
    fn limits_refuse_with_an_honest_retry_after() {
        let auth = Auth::default();
        auth.load_text(&file(&[(
            "k",
            "t",
            "    requests_per_minute: 2\n    tokens_per_minute: 600\n",
        )]))
        .unwrap();
        let c = auth.keys().look_up(b"k").unwrap();
        // The buckets start full.
        let _a = c.take().unwrap();
        let _b = c.take().unwrap();
        let e = c.take().err().unwrap();
        assert_eq!(e.limit, "requests_per_minute");
        // One request refills in 30 s at 2 a minute.
        assert!((29..=30).contains(&e.retry_after_s), "{e:?}");
        // 900 tokens used of 600 a minute: 300 over, 30 s to pay back.
        let auth = Auth::default();
        auth.load_text(&file(&[("k", "t", "    tokens_per_minute: 600\n")]))
            .unwrap();
        let c = auth.keys().look_up(b"k").unwrap();
        drop(c.take().unwrap());
        c.charge_tokens(900);
        let e = c.take().err().unwrap();
        assert_eq!(e.limit, "tokens_per_minute");
        assert!((29..=30).contains(&e.retry_after_s), "{e:?}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]

        /// Any text at all: loaded or refused, never a panic, and a refused
        /// file leaves the keys in force as they were.
        #[test]
        fn any_keys_file_is_loaded_or_refused(text in ".{0,400}") {
            let auth = Auth::default();
            auth.load_text(&file(&[("sk-kept", "kept", "")])).unwrap();
            if auth.load_text(&text).is_err() {
                proptest::prop_assert!(auth.keys().look_up(b"sk-kept").is_some());
            }
        }

        /// Every key of a well-formed file finds its own tenant, and a key
        /// that is not in it finds none.
        #[test]
        fn every_key_finds_its_tenant(
            entries in proptest::collection::btree_map("[ -~]{1,40}", "[a-z0-9_.-]{1,12}", 1..20),
            stranger in "[ -~]{1,40}",
        ) {
            let list: Vec<(&str, &str, &str)> = entries
                .iter()
                .filter(|(_, t)| t.as_str() != "other")
                .map(|(k, t)| (k.as_str(), t.as_str(), ""))
                .collect();
            let auth = Auth::default();
            auth.load_text(&file(&list)).unwrap();
            let keys = auth.keys();
            for (k, t, _) in &list {
                let c = keys.look_up(k.as_bytes()).expect("its key");
                proptest::prop_assert_eq!(&*c.tenant.name, *t);
                // The second time it is remembered: the same answer.
                let again = keys.look_up(k.as_bytes()).expect("its key");
                proptest::prop_assert_eq!(&*again.tenant.name, *t);
            }
            if !entries.contains_key(&stranger) {
                proptest::prop_assert!(keys.look_up(stranger.as_bytes()).is_none());
            }
        }
    }

    #[test]
    fn keys_come_from_bearer_or_x_api_key() {
        let mut h = http::HeaderMap::new();
        assert_eq!(presented_key(&h), None);
        h.insert("x-api-key", " sk-1 ".parse().unwrap());
        assert_eq!(presented_key(&h), Some(&b"sk-1"[..]));
        h.insert("authorization", "Bearer sk-2".parse().unwrap());
        assert_eq!(presented_key(&h), Some(&b"sk-2"[..]));
    }
}
