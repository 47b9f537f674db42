//! TLS termination: certificates chosen by SNI (exact names, then `*.suffix`
//! wildcards, then the first certificate as the default), held behind a swap
//! so `SIGHUP` replaces them without touching listeners.

use arc_swap::ArcSwap;
use pingora_rustls::sign::CertifiedKey;
use pingora_rustls::{ClientHello, CryptoProvider, ResolvesServerCert};
use serde::Deserialize;
use std::collections::HashMap;
use std::sync::Arc;

/// One certificate: PEM chain, PEM key, the SNI names it serves (`*.x` wildcards).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsCertConfig {
    pub cert: String,
    pub key: String,
    #[serde(default)]
    pub server_names: Vec<String>,
}

struct CertSet {
    exact: HashMap<String, Arc<CertifiedKey>>,
    wildcard: HashMap<String, Arc<CertifiedKey>>,
    default: Arc<CertifiedKey>,
}

impl CertSet {
    fn lookup(&self, name: &str) -> Arc<CertifiedKey> {
        let name = name.to_ascii_lowercase();
        if let Some(c) = self.exact.get(&name) {
            return Arc::clone(c);
        }
        if let Some((_, parent)) = name.split_once('.') {
            if let Some(c) = self.wildcard.get(parent) {
                return Arc::clone(c);
            }
        }
        Arc::clone(&self.default)
    }
}

/// Load one certificate chain and key, for `key` (the config path) in errors.
pub fn load_cert(c: &TlsCertConfig) -> Result<Arc<CertifiedKey>, String> {
    pingora_rustls::install_default_crypto_provider();
    let (certs, key) = match pingora_rustls::load_certs_and_key_files(&c.cert, &c.key) {
        Ok(Some(pair)) => pair,
        Ok(None) => return Err(format!("no certificate or key in {} / {}", c.cert, c.key)),
        Err(e) => return Err(format!("cannot load {} / {}: {e}", c.cert, c.key)),
    };
    if certs.is_empty() {
        return Err(format!("{} holds no certificate", c.cert));
    }
    let provider = CryptoProvider::get_default()
        .ok_or_else(|| "no TLS crypto provider installed".to_string())?;
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| format!("unusable private key {}: {e}", c.key))?;
    Ok(Arc::new(CertifiedKey::new(certs, signing)))
}

fn load_set(certs: &[TlsCertConfig]) -> Result<CertSet, String> {
    let mut exact = HashMap::new();
    let mut wildcard = HashMap::new();
    let mut default = None;
    for c in certs {
        let key = load_cert(c)?;
        default.get_or_insert_with(|| Arc::clone(&key));
        for name in &c.server_names {
            let name = name.to_ascii_lowercase();
            match name.strip_prefix("*.") {
                Some(suffix) => wildcard.insert(suffix.to_string(), Arc::clone(&key)),
                None => exact.insert(name, Arc::clone(&key)),
            };
        }
    }
    Ok(CertSet {
        exact,
        wildcard,
        default: default.ok_or_else(|| "no certificates configured".to_string())?,
    })
}

/// The SNI certificate resolver shared by every TLS listener.
pub struct SniResolver {
    certs: ArcSwap<CertSet>,
}

impl std::fmt::Debug for SniResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = self.certs.load();
        f.debug_struct("SniResolver")
            .field("names", &set.exact.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl SniResolver {
    pub fn new(certs: &[TlsCertConfig]) -> Result<Arc<SniResolver>, String> {
        Ok(Arc::new(SniResolver {
            certs: ArcSwap::from_pointee(load_set(certs)?),
        }))
    }

    /// Re-read the certificate files; on error the current ones stay.
    pub fn reload(&self, certs: &[TlsCertConfig]) -> Result<(), String> {
        self.certs.store(Arc::new(load_set(certs)?));
        Ok(())
    }
}

impl ResolvesServerCert for SniResolver {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let set = self.certs.load();
        Some(match hello.server_name() {
            Some(name) => set.lookup(name),
            None => Arc::clone(&set.default),
        })
    }
}
