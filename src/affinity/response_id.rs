//! Response ids the gateway issues: a stored response's route, carried in
//! its id, so that no table, store or race stands between a follow-up and
//! the replica that holds what it continues.
//!
//! An engine's Responses API keeps each response in the memory of the
//! replica that answered it; a follow-up naming it by `previous_response_id`
//! anywhere else gets 404. So the gateway gives the client, instead of the
//! engine's id, one that says where the response lives: `resp_`, then in
//! URL-safe base64 a marker, and sealed under the fleet's response-id key
//! for the request's scope (tier and tenant) the backend's id, the session
//! the request was a turn of and the engine's own id ([`crate::secret`]).
//! Any gateway of the fleet reads it without asking anyone (Redis down, a
//! follow-up racing its answer to another gateway, a flood of other
//! responses: none matters); no one without the key can make one or read
//! what it holds (an engine id in clear would let another tenant ask the
//! engine for it directly); and a tenant presenting another tenant's id is
//! told no such response exists, never sent to its holder.

use super::hrw::HrwHasher;
use super::table::BindingKey;

/// What a gateway id leads to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issued {
    /// The id of the backend that stored the response.
    pub backend: String,
    /// The session its request was a turn of (binding key and hash).
    pub key: BindingKey,
    pub hash: u64,
    /// The id the engine gave it.
    pub engine: String,
}

/// What an id a client presents is.
#[derive(Debug, PartialEq, Eq)]
pub enum Presented {
    /// One this fleet issued for this scope.
    Ours(Issued),
    /// One shaped like ours that this fleet did not issue for this scope:
    /// another tenant's, another tier's, under a key this gateway does not
    /// hold, or forged.
    NotForThisScope,
    /// Not one of ours (an engine's own id, issued before the gateway did).
    Foreign,
}

const PREFIX: &str = "resp_";
/// What our ids' bytes start with: `ag` and the layout's version (2:
/// sealed). As base64 `YWcC`, which no engine's hex or UUID id starts with.
const MARKER: [u8; 3] = [b'a', b'g', 2];

/// The id the client is given for the engine's `engine` id, of a response
/// stored at `backend` for a request of session (`key`, `hash`) in `scope`.
pub fn issue(hasher: &HrwHasher, scope: &str, i: &Issued) -> String {
    let backend = &i.backend.as_bytes()[..i.backend.len().min(255)];
    let mut plain = Vec::with_capacity(1 + backend.len() + 24 + i.engine.len());
    plain.push(backend.len() as u8);
    plain.extend_from_slice(backend);
    plain.extend_from_slice(&i.key.to_le_bytes());
    plain.extend_from_slice(&i.hash.to_le_bytes());
    plain.extend_from_slice(i.engine.as_bytes());
    let mut raw = Vec::with_capacity(MARKER.len() + plain.len() + crate::secret::SEAL_OVERHEAD);
    raw.extend_from_slice(&MARKER);
    hasher.id_keys()[0].seal(scope.as_bytes(), &plain, &mut raw);
    let mut id = String::with_capacity(PREFIX.len() + raw.len() * 4 / 3 + 2);
    id.push_str(PREFIX);
    base64url(&raw, &mut id);
    id
}

/// What `id`, presented in `scope`, is.
pub fn read(hasher: &HrwHasher, scope: &str, id: &str) -> Presented {
    let Some(raw) = id.strip_prefix(PREFIX).and_then(unbase64url) else {
        return Presented::Foreign;
    };
    let Some(sealed) = raw.strip_prefix(&MARKER[..]) else {
        return Presented::Foreign;
    };
    // Opened under the key its key id names, current or retired; the tag
    // is checked before a byte of it is read.
    let opened = hasher
        .id_keys()
        .iter()
        .find_map(|k| k.open(scope.as_bytes(), sealed));
    match opened.as_deref().and_then(layout) {
        Some(issued) => Presented::Ours(issued),
        None => Presented::NotForThisScope,
    }
}

/// The fields of an id's plaintext, when it is laid out as [`issue`] lays it.
fn layout(body: &[u8]) -> Option<Issued> {
    let (&len, rest) = body.split_first()?;
    if rest.len() < len as usize + 24 {
        return None;
    }
    let (backend, rest) = rest.split_at(len as usize);
    let (key, rest) = rest.split_at(16);
    let (hash, engine) = rest.split_at(8);
    Some(Issued {
        backend: std::str::from_utf8(backend).ok()?.to_string(),
        key: BindingKey::from_le_bytes(key.try_into().ok()?),
        hash: u64::from_le_bytes(hash.try_into().ok()?),
        engine: std::str::from_utf8(engine)
            .ok()
            .filter(|e| !e.is_empty())?
            .to_string(),
    })
}

const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// URL-safe base64 without padding (RFC 4648 §5): ids travel in JSON and
/// in paths.
fn base64url(bytes: &[u8], out: &mut String) {
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
}

fn unbase64url(text: &str) -> Option<Vec<u8>> {
    let value = |c: u8| ALPHABET.iter().position(|&a| a == c).map(|v| v as u32);
    let text = text.as_bytes();
    if text.len() % 4 == 1 {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    for chunk in text.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c)? << (18 - 6 * i);
        }
        let bytes = chunk.len() - 1;
        // One spelling per id: the bits past the last byte are zero.
        if n & (0xff_ffff >> (8 * bytes)) != 0 {
            return None;
        }
        for i in 0..bytes {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn issued() -> Issued {
        Issued {
            backend: "vllm-2".into(),
            key: 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
            hash: 42,
            engine: "resp_0a1b2c3d4e5f60718293a4b5c6d7e8f9".into(),
        }
    }

    #[test]
    fn an_issued_id_leads_back_to_its_holder_in_its_own_scope_only() {
        let h = HrwHasher::new("fleet-key");
        let id = issue(&h, "default\u{0}kacme", &issued());
        assert!(id.starts_with("resp_"), "{id}");
        assert!(id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-'));
        assert_eq!(
            read(&h, "default\u{0}kacme", &id),
            Presented::Ours(issued())
        );
        // Another tenant, another tier, another fleet: not theirs.
        assert_eq!(
            read(&h, "default\u{0}kglobex", &id),
            Presented::NotForThisScope
        );
        assert_eq!(read(&h, "batch\u{0}kacme", &id), Presented::NotForThisScope);
        let other = HrwHasher::new("another-fleet");
        assert_eq!(
            read(&other, "default\u{0}kacme", &id),
            Presented::NotForThisScope
        );
    }

    #[test]
    fn a_changed_id_is_refused_and_an_engines_own_id_is_foreign() {
        let h = HrwHasher::new("fleet-key");
        let id = issue(&h, "t", &issued());
        // Every single-character change of the id's body is caught.
        for at in PREFIX.len()..id.len() {
            let mut forged = id.clone().into_bytes();
            forged[at] = if forged[at] == b'A' { b'B' } else { b'A' };
            let forged = String::from_utf8(forged).unwrap();
            assert_ne!(
                read(&h, "t", &forged),
                Presented::Ours(issued()),
                "changed at {at}"
            );
        }
        // vLLM's and SGLang's own ids, and garbage, are no ids of ours.
        for foreign in [
            "resp_0a1b2c3d4e5f60718293a4b5c6d7e8f9",
            "resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452",
            "resp_",
            "msg_1",
            "resp_!!!",
        ] {
            assert_eq!(read(&h, "t", foreign), Presented::Foreign, "{foreign}");
        }
    }

    #[test]
    fn an_id_shows_neither_the_engines_id_nor_the_backend() {
        let h = HrwHasher::new("fleet-key");
        let id = issue(&h, "t", &issued());
        let raw = unbase64url(id.strip_prefix(PREFIX).unwrap()).unwrap();
        for clear in [&b"vllm-2"[..], b"0a1b2c3d", b"resp_"] {
            assert!(!raw.windows(clear.len()).any(|w| w == clear), "{id}");
        }
        assert!(!id.contains("0a1b2c3d"), "{id}");
        // Announced twice (a stream's events, its JSON): the same id.
        assert_eq!(issue(&h, "t", &issued()), id);
    }

    #[test]
    fn ids_of_a_retired_key_still_lead_home_and_of_an_unknown_key_nowhere() {
        let (k1, k2) = ("first-secret", "second-secret");
        let id = issue(&HrwHasher::new(k1), "t", &issued());
        let rotated = HrwHasher::with_retired(k2, &[k1.to_string()]);
        assert_eq!(read(&rotated, "t", &id), Presented::Ours(issued()));
        // New ids go out under the new key alone.
        let new_id = issue(&rotated, "t", &issued());
        assert_eq!(
            read(&HrwHasher::new(k2), "t", &new_id),
            Presented::Ours(issued())
        );
        assert_eq!(
            read(&HrwHasher::new(k1), "t", &new_id),
            Presented::NotForThisScope
        );
        // The old key no longer listed: no longer ours.
        assert_eq!(
            read(&HrwHasher::new(k2), "t", &id),
            Presented::NotForThisScope
        );
    }

    #[test]
    fn base64url_round_trips_every_length() {
        for n in 0..40u8 {
            let bytes: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37).wrapping_add(n)).collect();
            let mut text = String::new();
            base64url(&bytes, &mut text);
            assert_eq!(text.len(), (bytes.len() * 4).div_ceil(3));
            assert_eq!(unbase64url(&text), Some(bytes));
        }
    }
}
