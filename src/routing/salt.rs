//! `auth.cache_salt: tenant`: every prompt carries its tenant's
//! `cache_salt`, which vLLM (0.9 and later) and SGLang hash into its first
//! KV block, so no request of another tenant can find its cached blocks,
//! nor tell from a cached-token count or a fast first token that the same
//! prefix was sent before.
//!
//! The salt is a tag of the tenant (and of any salt the client sent, so a
//! tenant can still keep its own users apart) under the fleet's
//! `affinity.hash_key`: every gateway of the fleet gives a tenant the same
//! salt, and no client can make another tenant's. A `cache_salt` the
//! client wrote is replaced (every one, when repeated); else the gateway's
//! is added as the object's last member. A key that spells the field with
//! escapes (`"cache\u005fsalt"`) is refused: a parser that keeps the last
//! of repeated members would take the client's.

use super::edits::Edits;
use crate::affinity::hrw::HrwHasher;
use crate::affinity::session::BodyProbe;
use crate::errors::GatewayError;

/// The member the gateway writes.
const FIELD: &str = "cache_salt";

/// The salt of `tenant_scope`'s requests, given the raw JSON value of the
/// salt the client sent, if any.
pub fn of_tenant(hasher: &HrwHasher, tenant_scope: &str, client: Option<&[u8]>) -> String {
    let mut message = Vec::with_capacity(FIELD.len() + 2 + client.map_or(0, <[u8]>::len));
    message.extend_from_slice(FIELD.as_bytes());
    match client {
        Some(raw) => {
            message.push(1);
            message.extend_from_slice(raw);
        }
        None => message.push(0),
    }
    format!("ag-{:032x}", hasher.salt_tag(tenant_scope, &message))
}

/// The edits that give `body` (read as `probe`) its tenant's salt.
pub fn write(
    hasher: &HrwHasher,
    tenant_scope: &str,
    body: &[u8],
    probe: &BodyProbe<'_>,
    edits: &mut Edits,
) -> Result<(), GatewayError> {
    let mut theirs = Vec::new();
    for (key, value) in probe.members() {
        if key == FIELD.as_bytes() {
            theirs.push(value);
        } else if key.contains(&b'\\') && unescaped(key).as_deref() == Some(FIELD) {
            return Err(GatewayError::bad_body(
                "`cache_salt` spelled with escapes: write it plainly (auth.cache_salt)".into(),
            ));
        }
    }
    let salt = of_tenant(hasher, tenant_scope, theirs.last().copied());
    if theirs.is_empty() {
        let mut member = Vec::with_capacity(salt.len() + FIELD.len() + 6);
        if !probe.is_empty() {
            member.push(b',');
        }
        member.push(b'"');
        member.extend_from_slice(FIELD.as_bytes());
        member.extend_from_slice(b"\":\"");
        // The salt is ASCII hex behind a fixed prefix: nothing to escape.
        member.extend_from_slice(salt.as_bytes());
        member.push(b'"');
        edits.insert(probe.close(), member);
    }
    for value in theirs {
        edits.string_at(body, value, &salt);
    }
    Ok(())
}

/// A key as written (between its quotes), its escapes resolved.
fn unescaped(key: &[u8]) -> Option<String> {
    let mut quoted = Vec::with_capacity(key.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(key);
    quoted.push(b'"');
    serde_json::from_slice(&quoted).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn salted(body: &str, tenant: &str) -> Result<serde_json::Value, GatewayError> {
        let hasher = HrwHasher::new("k");
        let probe = BodyProbe::parse(body.as_bytes()).expect("a JSON object");
        let mut edits = Edits::default();
        write(&hasher, tenant, body.as_bytes(), &probe, &mut edits)?;
        let out = edits.apply(body.as_bytes()).expect("edited");
        // Strict: a repeated member would fail here.
        #[derive(serde::Deserialize)]
        #[allow(dead_code)]
        struct Strict {
            cache_salt: String,
            #[serde(flatten)]
            rest: serde_json::Map<String, serde_json::Value>,
        }
        let _: Strict = serde_json::from_slice(&out).expect("no repeated member");
        Ok(serde_json::from_slice(&out).expect("still JSON"))
    }

    #[test]
    fn each_tenant_has_its_own_salt_and_a_client_cannot_name_anothers() {
        let a = salted(r#"{"model":"m","messages":[]}"#, "\0ka").unwrap();
        let b = salted(r#"{"model":"m","messages":[]}"#, "\0kb").unwrap();
        assert_eq!(a["model"], "m", "the rest of the body is kept");
        let (sa, sb) = (
            a["cache_salt"].as_str().unwrap(),
            b["cache_salt"].as_str().unwrap(),
        );
        assert_ne!(sa, sb);
        assert_eq!(
            sa,
            salted(r#"{ }"#, "\0ka").unwrap()["cache_salt"],
            "the same on every request"
        );
        // Tenant b sending a's salt as its own gets a salt of b's.
        let lying = format!(r#"{{"model":"m","cache_salt":"{sa}"}}"#);
        let got = salted(&lying, "\0kb").unwrap();
        assert_ne!(got["cache_salt"], sa);
        assert_ne!(got["cache_salt"], sb);
        // A client's own salt still keeps its users apart, within its tenant.
        let u1 = salted(r#"{"cache_salt":"user-1"}"#, "\0ka").unwrap();
        let u2 = salted(r#"{"cache_salt":"user-2"}"#, "\0ka").unwrap();
        assert_ne!(u1["cache_salt"], u2["cache_salt"]);
        assert_ne!(u1["cache_salt"], sa);
    }

    #[test]
    fn the_clients_salt_is_replaced_wherever_and_however_often_it_is_written() {
        let twice = r#"{"cache_salt":"x","model":"m","cache_salt":{"a":1}}"#;
        let hasher = HrwHasher::new("k");
        let probe = BodyProbe::parse(twice.as_bytes()).unwrap();
        let mut edits = Edits::default();
        write(&hasher, "\0ka", twice.as_bytes(), &probe, &mut edits).unwrap();
        let out = String::from_utf8(edits.apply(twice.as_bytes()).unwrap()).unwrap();
        assert_eq!(out.matches("\"ag-").count(), 2, "{out}");
        assert!(!out.contains("\"x\"") && !out.contains("\"a\""), "{out}");
        let escaped = salted(r#"{"cache\u005fsalt":"mine","model":"m"}"#, "\0ka");
        assert_eq!(escaped.unwrap_err().status, 400);
        let empty = salted("{}", "\0ka").unwrap();
        assert_eq!(empty.as_object().unwrap().len(), 1);
        let spaced = salted("{ \"model\" : \"m\" }  ", "\0ka").unwrap();
        assert_eq!(spaced["model"], "m");
    }

    #[test]
    fn another_fleet_key_gives_other_salts() {
        let one = of_tenant(&HrwHasher::new("k"), "\0ka", None);
        assert_eq!(one, of_tenant(&HrwHasher::new("k"), "\0ka", None));
        assert_ne!(one, of_tenant(&HrwHasher::new("other"), "\0ka", None));
    }
}
