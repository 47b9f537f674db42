//! The admin API, on its own listener (default 127.0.0.1:9092), JSON in and
//! out, optionally behind a bearer token:
//!
//! - `GET    /admin/backends` — every backend: tier, health, draining, in-flight,
//!   bindings, the engine's own load when scraped (`null` when unknown or stale),
//!   what its answers taught: prefill cost per token, queueing delay; and,
//!   with `kv_events`, whether its holdings are exact and how many blocks
//! - `POST   /admin/backends/{id}/drain` — body `{"move_sessions": bool}` (optional)
//! - `POST   /admin/backends/{id}/undrain`
//! - `GET    /admin/sessions/{id}?tier=T&kind=session|group&tenant=X` — a binding
//! - `DELETE /admin/sessions/{id}?tier=T&kind=...&tenant=...` — forget it

use crate::affinity::hrw::KeyKind;
use crate::gateway::Gateway;
use async_trait::async_trait;
use pingora_core::apps::http_app::ServeHttp;
use pingora_core::protocols::http::ServerSession;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

pub struct AdminApp(pub Arc<Gateway>);

fn reply(status: u16, v: Value) -> http::Response<Vec<u8>> {
    let body = v.to_string().into_bytes();
    http::Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("content-length", body.len())
        .body(body)
        .expect("static response parts are valid")
}

fn error(status: u16, code: &str, message: String) -> http::Response<Vec<u8>> {
    reply(
        status,
        json!({"error": {"message": message, "type": "admin_error", "code": code}}),
    )
}

fn query(uri: &http::Uri) -> HashMap<String, String> {
    uri.query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (!k.is_empty()).then(|| (percent_decode(k), percent_decode(v)))
        })
        .collect()
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%' && i + 3 <= bytes.len())
            .then(|| std::str::from_utf8(&bytes[i + 1..i + 3]).ok())
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match (escaped, bytes[i]) {
            (Some(b), _) => {
                out.push(b);
                i += 3;
            }
            (None, b'+') => {
                out.push(b' ');
                i += 1;
            }
            (None, b) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl AdminApp {
    fn backends(&self) -> http::Response<Vec<u8>> {
        let routing = self.0.routing();
        let mut per_backend: HashMap<(u16, u32), u64> = HashMap::new();
        for (_, b) in self.0.affinity.bindings() {
            *per_backend.entry((b.tier, b.backend)).or_default() += 1;
        }
        let list: Vec<Value> = routing
            .all_backends()
            .map(|(t, b)| {
                let queue = b.stats.cost.queue_at(crate::clock::now_ms());
                let admission = self.0.admission.depth(b.slot);
                json!({
                    "tier": &*t.name,
                    "id": &*b.id,
                    "addr": b.addr.to_string(),
                    "weight": b.weight,
                    "healthy": t.healthy(b),
                    "health_checks_pass": t.checks_pass(b),
                    "ejected_ms_left": b.stats.outlier.remaining_ms(crate::clock::now_ms()),
                    "draining": b.draining(),
                    "move_sessions": b.stats.move_on_drain.load(Ordering::Relaxed),
                    "in_flight": b.in_flight(),
                    "awaiting_first_byte": b.stats.progress.awaiting(),
                    "bindings": per_backend.get(&(t.index, b.slot)).copied().unwrap_or(0),
                    "admission": {
                        "running": admission.1,
                        "waiting": admission.0,
                    },
                    "engine": b.stats.engine.snapshot().map(|(running, waiting, kv)| json!({
                        "running": running,
                        "waiting": waiting,
                        "kv_usage": kv,
                    })),
                    "kv_events": b.kv_events.as_ref().map(|_| {
                        let (exact, blocks, applied, replayed) = b.stats.kv.snapshot();
                        json!({
                            "exact": exact,
                            "blocks_held": blocks,
                            "events": applied,
                            "replayed_batches": replayed,
                            "connections_lost": b.stats.kv.lost(),
                        })
                    }),
                    "learned": {
                        "prefill_us_per_token": b.stats.cost.learned_us_per_token(),
                        "queue_ms": b.stats.cost.queue_us() as f64 / 1000.0,
                        "decode_us_per_token": b.stats.cost.decode_us_per_token(),
                        "responses": b.stats.cost.samples(),
                        "queued_prefill_tokens": queue.tokens,
                        "queue_head_ms": queue.head_ms,
                        "queue_head_tokens": queue.head_tokens,
                        "shared_prefix_tokens": b.stats.cost.shared_prefix(),
                    },
                })
            })
            .collect();
        reply(200, json!({ "backends": list }))
    }

    /// The admission queue: each backend's slots and waiters, and the keys
    /// in force (tenant names only).
    fn admission(&self) -> http::Response<Vec<u8>> {
        let routing = self.0.routing();
        let cfg = &routing.config;
        let slots: HashMap<u32, crate::admission::Slots> = self
            .0
            .admission
            .snapshot()
            .into_iter()
            .map(|s| (s.slot, s))
            .collect();
        let backends: Vec<Value> = routing
            .all_backends()
            .map(|(t, b)| {
                let s = slots.get(&b.slot).copied().unwrap_or_default();
                json!({
                    "tier": &*t.name,
                    "id": &*b.id,
                    // 0: none (or, learning, none learned yet).
                    "max_in_flight": s.limit,
                    "limit_source": s.source.as_str(),
                    // In force (0: none), and where it comes from
                    // (learned: 1 while the engine's answers show its
                    // prefills queue behind each other; 2 during a probe).
                    "max_prefilling": s.max_prefilling,
                    "prefill_source": s.prefill_source.as_str(),
                    "prefill_votes": s.prefill_votes,
                    "prefilling": s.prefilling,
                    // Their estimated prefill, tokens.
                    "prefill_tokens": s.prefill_tokens,
                    // What `prefill_queue_ms` allows there now, tokens (0: no limit).
                    "prefill_budget_tokens": s.prefill_budget,
                    "running": s.running,
                    "waiting": s.waiting,
                    // One of a fleet whose queue is in its store: the
                    // fleet's counts there (null otherwise).
                    "fleet": s.fleet.map(|f| json!({"running": f.running, "waiting": f.waiting})),
                })
            })
            .collect();
        let keys = self.0.auth.keys();
        reply(
            200,
            json!({
                "enabled": cfg.admission.enabled,
                "queued": self.0.admission.queued(),
                "max_queued": cfg.admission.max_queued,
                "max_wait_ms": cfg.admission.max_wait.as_millis() as u64,
                "backends": backends,
                "keys": keys.len(),
                "tenants": keys.tenants.iter().map(|t| &**t).collect::<Vec<&str>>(),
            }),
        )
    }

    fn drain(&self, id: &str, drain: bool, body: &[u8]) -> http::Response<Vec<u8>> {
        let move_sessions = if body.iter().all(u8::is_ascii_whitespace) {
            false
        } else {
            match serde_json::from_slice::<Value>(body) {
                Ok(v) => v["move_sessions"].as_bool().unwrap_or(false),
                Err(e) => return error(400, "invalid_body", format!("body is not JSON: {e}")),
            }
        };
        let routing = self.0.routing();
        let Some((_, b)) = routing.all_backends().find(|(_, b)| &*b.id == id) else {
            return error(404, "unknown_backend", format!("no backend `{}`", clip(id)));
        };
        b.stats.draining.store(drain, Ordering::Relaxed);
        if !drain {
            // Undrain is the operator's "put it back": ejection ends too.
            b.stats.outlier.reset();
        }
        b.stats
            .move_on_drain
            .store(drain && move_sessions, Ordering::Relaxed);
        log::info!("admin: backend {id} draining={drain} move_sessions={move_sessions}");
        reply(
            200,
            json!({"id": id, "draining": drain, "move_sessions": drain && move_sessions}),
        )
    }

    async fn session(
        &self,
        id: &str,
        q: &HashMap<String, String>,
        delete: bool,
    ) -> http::Response<Vec<u8>> {
        let routing = self.0.routing();
        let tier = match q.get("tier") {
            Some(t) => match routing.tier_by_name(t) {
                Some(t) => t,
                None => return error(404, "unknown_tier", format!("unknown tier `{}`", clip(t))),
            },
            None => routing.default_tier(),
        };
        let kind = match q.get("kind").map(String::as_str) {
            None | Some("session") => KeyKind::Session,
            Some("group") => KeyKind::Group,
            Some(other) => {
                return error(
                    400,
                    "invalid_kind",
                    format!("kind `{}` is not session or group", clip(other)),
                )
            }
        };
        let mut scope = tier.name.to_string();
        if let Some(t) = q.get("tenant") {
            let tid = routing.hasher.fingerprint(KeyKind::Session, "tenant", t);
            scope.push_str(&format!("\u{0}{tid:032x}"));
        }
        let key = routing.hasher.fingerprint(kind, &scope, id);
        let affinity = &self.0.affinity;
        let local = affinity.binding(key);
        // The fleet's binding, even if no turn of it reached this gateway —
        // read only: looking a session up takes nothing into this gateway's
        // table and refreshes nothing in the store.
        let stored = match (&local, &self.0.store) {
            (None, Some(store)) if store.healthy() => store.peek(key).await.ok().flatten(),
            _ => None,
        };
        let not_found = || {
            error(
                404,
                "unknown_session",
                format!("no live binding for `{}` in tier `{}`", clip(id), tier.name),
            )
        };
        if delete {
            if local.is_none() && stored.is_none() {
                return not_found();
            }
            let backend = match (&local, &stored) {
                (Some(b), _) => self.0.slots.backend_id(b.backend).unwrap_or_default(),
                (None, Some(s)) => s.backend.clone(),
                (None, None) => String::new(),
            };
            affinity.forget_everywhere(key).await;
            return reply(
                200,
                json!({"session": id, "tier": &*tier.name, "deleted": true, "backend": backend}),
            );
        }
        match (local, stored) {
            (Some(b), _) => {
                let backend = self.0.slots.backend_id(b.backend).unwrap_or_default();
                let expires_in_ms = (b.in_flight == 0)
                    .then(|| affinity.remaining(b.deadline_ms).as_millis() as u64);
                reply(
                    200,
                    json!({
                        "session": id, "tier": &*tier.name, "backend": backend, "version": b.version,
                        "in_flight": b.in_flight, "pending": b.pending, "expires_in_ms": expires_in_ms,
                        "moves": b.moves.count, "source": "local",
                    }),
                )
            }
            (None, Some(s)) => reply(
                200,
                json!({
                    "session": id, "tier": &*tier.name, "backend": s.backend, "version": s.version,
                    "in_flight": 0, "pending": false, "expires_in_ms": null,
                    "moves": s.moves.count, "source": "store",
                }),
            ),
            (None, None) => not_found(),
        }
    }
}

/// The token of an `Authorization: Bearer <token>` value. The scheme is
/// case-insensitive (RFC 9110 §11.1): `bearer` and `BEARER` are as good.
fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let space = value.iter().position(|&b| b == b' ')?;
    let (scheme, rest) = value.split_at(space);
    scheme
        .eq_ignore_ascii_case(b"bearer")
        .then(|| rest.trim_ascii_start())
}

/// `a == b` in time that does not depend on where they differ.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

#[async_trait]
impl ServeHttp for AdminApp {
    async fn response(&self, session: &mut ServerSession) -> http::Response<Vec<u8>> {
        let token = self.0.routing().config.admin.token.clone();
        if let Some(token) = token {
            let given = session
                .req_header()
                .headers
                .get("authorization")
                .and_then(|v| bearer_token(v.as_bytes()));
            if !given.is_some_and(|g| same_secret(g, token.as_bytes())) {
                return error(401, "unauthorized", "missing or wrong bearer token".into());
            }
        }
        let method = session.req_header().method.clone();
        let uri = session.req_header().uri.clone();
        let mut body = Vec::new();
        while let Ok(Some(chunk)) = session.read_request_body().await {
            body.extend_from_slice(&chunk);
            if body.len() > 64 * 1024 {
                return error(
                    413,
                    "request_too_large",
                    "admin bodies are at most 64 KiB".into(),
                );
            }
        }
        let path: Vec<String> = uri
            .path()
            .trim_matches('/')
            .split('/')
            .map(percent_decode)
            .collect();
        let parts: Vec<&str> = path.iter().map(String::as_str).collect();
        match (method.as_str(), parts.as_slice()) {
            ("GET", ["admin", "backends"]) => self.backends(),
            ("GET", ["admin", "admission"]) => self.admission(),
            ("POST", ["admin", "backends", id, "drain"]) => self.drain(id, true, &body),
            ("POST", ["admin", "backends", id, "undrain"]) => self.drain(id, false, &body),
            ("GET", ["admin", "sessions", id]) => self.session(id, &query(&uri), false).await,
            ("DELETE", ["admin", "sessions", id]) => self.session(id, &query(&uri), true).await,
            _ => error(
                404,
                "not_found",
                format!(
                    "no admin route {} {}",
                    clip(method.as_str()),
                    clip(uri.path())
                ),
            ),
        }
    }
}

/// Client input quoted in an error: at most 64 characters of it.
fn clip(s: &str) -> String {
    const MAX: usize = 64;
    match s.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_decoding() {
        assert_eq!(percent_decode("a%20b+c%2F"), "a b c/");
        assert_eq!(percent_decode("100%"), "100%");
        assert_eq!(percent_decode("%zz"), "%zz");
        let q = query(&"/x?tier=big&tenant=acme%20co".parse().unwrap());
        assert_eq!(q["tier"], "big");
        assert_eq!(q["tenant"], "acme co");
    }

    proptest::proptest! {
        /// Admin paths and queries: any text, never a panic; decoding never
        /// grows the input; errors quote a bounded amount of it.
        #[test]
        fn admin_parsing_survives_any_input(path in ".{0,300}", raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let decoded = percent_decode(&path);
            proptest::prop_assert!(decoded.len() <= path.len() * 3);
            let text = String::from_utf8_lossy(&raw);
            let _ = percent_decode(&text);
            if let Ok(uri) = format!("/admin/sessions/x?{}", text.escape_default()).parse::<http::Uri>() {
                let _ = query(&uri);
            }
            proptest::prop_assert!(clip(&path).chars().count() <= 65);
        }
    }
}
