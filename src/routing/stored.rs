//! Stored responses (`previous_response_id`): where each response this
//! fleet answered is kept, so that a follow-up goes to the backend that
//! holds it (SPEC §3.7).

use super::request::{RouteRequest, StoredRef};
use super::tables::Tables;
use crate::affinity::hrw::KeyKind;
use crate::affinity::response_id::{self, Issued, Presented};
use crate::affinity::responses::{parse_stored, response_key, stored_value, ResponseRoute};
use crate::affinity::SessionRef;
use crate::upstream::{Backend, Routing, Tier};

/// The stored response `id` a request in `scope` (its tier and tenant)
/// follows: an id this fleet issued leads to its holder by itself (no
/// table, no store); one issued for another scope, or forged, is refused;
/// an engine's own id is looked up where it was learned. `None`: an id no
/// gateway saw answered (it routes as any request does), where the fleet
/// has no tenants to keep apart.
pub(super) async fn presented(
    t: Tables<'_>,
    routing: &Routing,
    tier: &Tier,
    scope: &str,
    id: String,
) -> Option<StoredRef> {
    let stored = |route, engine, refused| StoredRef {
        route,
        id: id.clone(),
        engine,
        refused,
    };
    let nowhere = ResponseRoute {
        slot: u32::MAX,
        key: 0,
        hash: 0,
    };
    match response_id::read(&routing.hasher, scope, &id) {
        Presented::Ours(i) => {
            let route = ResponseRoute {
                // A backend not in this tier here: a slot no candidate has,
                // and the follow-up is told its holder is gone.
                slot: tier.backend_by_id(&i.backend).map_or(u32::MAX, |b| b.slot),
                key: i.key,
                hash: i.hash,
            };
            Some(stored(route, Some(i.engine), false))
        }
        Presented::NotForThisScope => Some(stored(nowhere, None, true)),
        Presented::Foreign => {
            match find(t, response_key(&routing.hasher, scope, &id), tier).await {
                Some(route) => Some(stored(route, None, false)),
                // Between tenants a stored response is reached only through an
                // id issued or learned in the caller's scope: an engine's id
                // read off another tenant's, or guessed, asks no replica (sent
                // on, a few tries found its holder).
                None if routing.config.separates_tenants() => Some(stored(nowhere, None, true)),
                None => None,
            }
        }
    }
}

/// The id the client is given for `engine`, a response `backend` stored
/// for `req` (in its scope, as a turn of its session).
pub(super) fn issue(req: &RouteRequest, backend: &Backend, engine: &str) -> Option<String> {
    let scope = req.responses_scope.as_deref()?;
    let session = session_of(req, scope, engine);
    let issued = Issued {
        backend: backend.id.to_string(),
        key: session.key,
        hash: session.hash,
        engine: engine.to_string(),
    };
    Some(response_id::issue(&req.routing.hasher, scope, &issued))
}

/// The session a response `id` continues: the request's own, else (a
/// request without one) a session named by its response.
fn session_of(req: &RouteRequest, scope: &str, id: &str) -> SessionRef {
    req.key.clone().unwrap_or_else(|| {
        SessionRef::new(
            &req.routing.hasher,
            KeyKind::Session,
            scope,
            &format!("response\u{1f}{id}"),
        )
    })
}

/// Where the response kept under `key` lives: this gateway's own routes,
/// else the fleet's store (another gateway saw it answered). A backend the
/// store names that is not in `tier` here gets a slot no candidate has:
/// the follow-up is told its backend is gone.
pub(super) async fn find(t: Tables<'_>, key: u64, tier: &Tier) -> Option<ResponseRoute> {
    let now = crate::clock::now_ms();
    if let Some(route) = t.responses.find(key, now) {
        return Some(route);
    }
    let store = t.store.filter(|s| s.healthy())?;
    let value = store.get_response(key).await.ok()??;
    let (backend, session, hash) = parse_stored(&value)?;
    let route = ResponseRoute {
        slot: tier.backend_by_id(backend).map_or(u32::MAX, |b| b.slot),
        key: session,
        hash,
    };
    if route.slot != u32::MAX {
        t.responses.learn(key, route, now);
    }
    Some(route)
}

/// `backend` answered `req` and stored the response `id`: its follow-ups
/// go there, as turns of this request's session (a request without one
/// starts a session named by its response).
pub(super) fn learn(t: Tables<'_>, req: &RouteRequest, backend: &Backend, id: &str) {
    let Some(scope) = &req.responses_scope else {
        return;
    };
    let hasher = &req.routing.hasher;
    let session = session_of(req, scope, id);
    let key = response_key(hasher, scope, id);
    let route = ResponseRoute {
        slot: backend.slot,
        key: session.key,
        hash: session.hash,
    };
    t.responses.learn(key, route, crate::clock::now_ms());
    if let Some(store) = t.store.cloned().filter(|s| s.healthy()) {
        // The fleet's other gateways route its follow-ups too. Not
        // awaited: the answer streams on meanwhile.
        let value = stored_value(&backend.id, &route);
        let ttl_ms = t.responses.ttl_ms();
        tokio::spawn(async move {
            let _ = store.put_response(key, value, ttl_ms).await;
        });
    }
}
