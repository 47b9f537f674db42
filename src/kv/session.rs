//! How a session is named to an engine: the `X-Session-ID` its requests
//! carry upstream, and what a view files the engine's name for it under.

/// The header an engine reads a request's session from (vLLM: it names the
/// session in the blocks' `BlockStored` events).
pub const SESSION_HEADER: http::HeaderName = http::HeaderName::from_static("x-session-id");

/// The `X-Session-ID` a session's requests carry upstream: its binding key,
/// never the client's own id (which may name another tenant's, or say more
/// than an engine's logs should).
pub fn upstream_session_id(key: u128) -> http::HeaderValue {
    let mut buf = [0u8; 32];
    const HEX: &[u8; 16] = b"0123456789abcdef";
    for (i, b) in buf.iter_mut().enumerate() {
        *b = HEX[((key >> (124 - 4 * i)) & 0xf) as usize];
    }
    http::HeaderValue::from_bytes(&buf).expect("hex is a header value")
}

/// What a view files a session under: its `X-Session-ID`, hashed.
pub fn session_of(id: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(id)
}

/// What a view files the session of binding key `key` under.
pub fn session_of_key(key: u128) -> u64 {
    session_of(upstream_session_id(key).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_upstream_session_id_is_the_key_in_hex() {
        let v = upstream_session_id(0x0123_4567_89ab_cdef_0011_2233_4455_6677);
        assert_eq!(v.to_str().unwrap(), "0123456789abcdef0011223344556677");
        assert_eq!(
            session_of_key(7),
            session_of(b"00000000000000000000000000000007")
        );
    }
}
