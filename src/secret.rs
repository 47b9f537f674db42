//! The fleet's secret (`affinity.hash_key`) and the keys derived from it.
//!
//! One operator string keys everything a gateway must agree on with its
//! fleet and keep from clients: where sessions are placed, the
//! fingerprints bindings are stored under, the cache salts of tenants, and
//! the response ids it issues. Each use gets its own subkey (HKDF-SHA256,
//! one `info` label per use), so what one use shows of its key says
//! nothing of another's. The secret itself must carry at least 128 bits of
//! randomness: an id issued to a client is a known plaintext, and a guessable
//! key is recovered from one offline (4,032 guesses took 0.26 s).
//!
//! Response ids are sealed, not only signed: ChaCha20-Poly1305 with a
//! synthetic nonce (an HMAC of the scope and the plaintext), so the same
//! response gets the same id every time it is announced, and an id shows
//! neither the engine's id nor the backend. Each id names its key by a
//! two-byte key id: ids issued under a retired key
//! (`affinity.retired_hash_keys`) still open while an operator rotates.

use ring::{aead, hkdf, hmac};

/// The placeholder older configurations shipped.
pub const PLACEHOLDER: &str = "change-me";
/// The shortest secret accepted where it protects tenants' data.
pub const MIN_CHARS: usize = 32;

/// A new secret: 32 random bytes as 64 hex digits (256 bits).
pub fn generate() -> String {
    let mut bytes = [0u8; 32];
    rand::RngCore::fill_bytes(&mut rand::rngs::OsRng, &mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Why `key` cannot be the fleet's secret, if it cannot: the placeholder,
/// fewer than [`MIN_CHARS`] characters, or too little variety to hold 128
/// bits (one character repeated, a short phrase repeated).
pub fn weakness(key: &str) -> Option<String> {
    let how = "make one with `agent-gateway keygen`";
    if key.is_empty() {
        return Some(format!("is not set; {how}"));
    }
    if key.contains(PLACEHOLDER) {
        return Some(format!("is the placeholder `{PLACEHOLDER}`; {how}"));
    }
    let chars: Vec<char> = key.chars().collect();
    if chars.len() < MIN_CHARS {
        return Some(format!(
            "is {} characters long; it must hold at least 128 bits of randomness \
             ({MIN_CHARS} characters or more): {how}",
            chars.len()
        ));
    }
    let mut distinct = chars.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let repeats = (1..=chars.len() / 2)
        .filter(|n| chars.len().is_multiple_of(*n))
        .any(|n| chars.chunks(n).all(|c| c == &chars[..n]));
    if distinct.len() < 10 || repeats {
        return Some(format!(
            "is not random enough (a short pattern repeated, or fewer than 10 different \
             characters); {how}"
        ));
    }
    None
}

/// The keys one secret gives each of its uses.
pub struct Derived {
    /// SipHash keys: placement scores, backend seeds, prompt block seeds.
    pub placement: [u64; 2],
    /// SipHash keys: binding and tenant fingerprints.
    pub fingerprint: [u64; 2],
    /// SipHash keys: tenants' cache salts.
    pub salt: [u64; 2],
    /// The response ids it issues and opens.
    pub ids: IdKey,
}

impl Derived {
    pub fn of(secret: &str) -> Derived {
        let prk = hkdf::Salt::new(hkdf::HKDF_SHA256, b"agent-gateway hash_key v1")
            .extract(secret.as_bytes());
        let pair = |info: &[u8]| {
            let mut k = [0u8; 16];
            expand(&prk, info, &mut k);
            [
                u64::from_le_bytes(k[..8].try_into().expect("8 bytes")),
                u64::from_le_bytes(k[8..].try_into().expect("8 bytes")),
            ]
        };
        Derived {
            placement: pair(b"placement"),
            fingerprint: pair(b"fingerprint"),
            salt: pair(b"cache-salt"),
            ids: IdKey::of(&prk),
        }
    }
}

fn expand(prk: &hkdf::Prk, info: &[u8], out: &mut [u8]) {
    struct Len(usize);
    impl hkdf::KeyType for Len {
        fn len(&self) -> usize {
            self.0
        }
    }
    let info = [info];
    // Only lengths over 255 hash lengths fail; ours are at most 32 bytes.
    prk.expand(&info, Len(out.len()))
        .and_then(|okm| okm.fill(out))
        .expect("HKDF output of at most 32 bytes");
}

/// Seals and opens the response ids of one secret.
#[derive(Clone)]
pub struct IdKey {
    /// Names the secret in what it sealed, without telling anything of it.
    pub id: [u8; 2],
    seal: aead::LessSafeKey,
    nonce: hmac::Key,
}

impl std::fmt::Debug for IdKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "IdKey({:02x}{:02x})", self.id[0], self.id[1])
    }
}

/// Bytes a sealed message adds to its plaintext: key id, nonce, tag.
pub const SEAL_OVERHEAD: usize = 2 + NONCE_BYTES + TAG_BYTES;
const NONCE_BYTES: usize = aead::NONCE_LEN;
const TAG_BYTES: usize = 16;

impl IdKey {
    fn of(prk: &hkdf::Prk) -> IdKey {
        let (mut id, mut seal, mut nonce) = ([0u8; 2], [0u8; 32], [0u8; 32]);
        expand(prk, b"response-id key id", &mut id);
        expand(prk, b"response-id seal", &mut seal);
        expand(prk, b"response-id nonce", &mut nonce);
        let unbound = aead::UnboundKey::new(&aead::CHACHA20_POLY1305, &seal)
            .expect("a 32-byte ChaCha20-Poly1305 key");
        IdKey {
            id,
            seal: aead::LessSafeKey::new(unbound),
            nonce: hmac::Key::new(hmac::HMAC_SHA256, &nonce),
        }
    }

    /// `plaintext` sealed for `scope` (which it opens in only), appended
    /// to `out` as key id, nonce, ciphertext, tag.
    pub fn seal(&self, scope: &[u8], plaintext: &[u8], out: &mut Vec<u8>) {
        let mut ctx = hmac::Context::with_key(&self.nonce);
        ctx.update(&(scope.len() as u64).to_le_bytes());
        ctx.update(scope);
        ctx.update(plaintext);
        let mut nonce = [0u8; NONCE_BYTES];
        nonce.copy_from_slice(&ctx.sign().as_ref()[..NONCE_BYTES]);
        out.extend_from_slice(&self.id);
        out.extend_from_slice(&nonce);
        let at = out.len();
        out.extend_from_slice(plaintext);
        let tag = self
            .seal
            .seal_in_place_separate_tag(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(scope),
                &mut out[at..],
            )
            .expect("ids are far below ChaCha20's length limit");
        out.extend_from_slice(tag.as_ref());
    }

    /// The plaintext of `sealed` (as [`IdKey::seal`] wrote it), if this key
    /// sealed it for `scope`.
    pub fn open(&self, scope: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
        if sealed.len() < SEAL_OVERHEAD || sealed[..2] != self.id {
            return None;
        }
        let nonce: [u8; NONCE_BYTES] = sealed[2..2 + NONCE_BYTES].try_into().ok()?;
        let mut buf = sealed[2 + NONCE_BYTES..].to_vec();
        let plain = self
            .seal
            .open_in_place(
                aead::Nonce::assume_unique_for_key(nonce),
                aead::Aad::from(scope),
                &mut buf,
            )
            .ok()?;
        let len = plain.len();
        buf.truncate(len);
        Some(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_secrets_pass_and_weak_ones_are_named() {
        let k = generate();
        assert_eq!(k.len(), 64);
        assert_eq!(weakness(&k), None);
        assert_ne!(generate(), k);
        for weak in [
            "",
            "change-me",
            "s3cret",
            "0123456789abcdef0123456789abcde",
            &"a".repeat(64),
            &"abcd".repeat(10),
            "change-me-change-me-change-me-plus-more",
            "abababababababababcbababababababababab",
        ] {
            assert!(weakness(weak).is_some(), "{weak:?} passed");
        }
        assert!(weakness("").unwrap().contains("keygen"));
    }

    #[test]
    fn each_use_has_its_own_key_and_ids_open_under_their_own_key_and_scope_only() {
        let d = Derived::of("fleet one's secret");
        assert_ne!(d.placement, d.fingerprint);
        assert_ne!(d.placement, d.salt);
        let other = Derived::of("fleet two's secret");
        assert_ne!(d.ids.id, other.ids.id);
        let mut sealed = Vec::new();
        d.ids
            .seal(b"tier\0tenant-a", b"engine id resp_123", &mut sealed);
        assert_eq!(sealed.len(), SEAL_OVERHEAD + 18);
        // Nothing of the plaintext shows.
        assert!(!sealed.windows(4).any(|w| w == b"resp"));
        // The same plaintext in the same scope: the same id.
        let mut again = Vec::new();
        d.ids
            .seal(b"tier\0tenant-a", b"engine id resp_123", &mut again);
        assert_eq!(sealed, again);
        assert_eq!(
            d.ids.open(b"tier\0tenant-a", &sealed).as_deref(),
            Some(&b"engine id resp_123"[..])
        );
        assert_eq!(d.ids.open(b"tier\0tenant-b", &sealed), None);
        assert_eq!(other.ids.open(b"tier\0tenant-a", &sealed), None);
        for at in 0..sealed.len() {
            let mut changed = sealed.clone();
            changed[at] ^= 1;
            assert_eq!(d.ids.open(b"tier\0tenant-a", &changed), None, "byte {at}");
        }
    }
}
