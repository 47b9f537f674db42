//! Conversations without a session id, one conversation on every gateway
//! of a fleet.
//!
//! Each gateway finds a keyless conversation by the ends its own earlier
//! turns left (`affinity::prefix::conversation`); a turn that reaches a
//! gateway that has not seen the conversation would start a new one there,
//! bound wherever that gateway places it. So every routed keyless turn
//! with messages files its end in the store too — `<prefix>c:<exact key>`
//! holding its conversation's name and backend, kept the bindings' TTL —
//! and forgets the end it continued. A gateway that finds no end of its own
//! asks the store once, for the latest of the prompt's earlier message ends
//! any gateway filed, and for that conversation's binding in the same call:
//! it continues the conversation where it lives, its binding taken in.
//!
//! Two conversations whose turns end alike (identical openings) leave an
//! end marked ambiguous (`=`), which continues neither: each goes on as a
//! conversation of its own, as on one gateway.

use super::bindings::adopt_stored;
use super::store::{parse, SharedStore};
use crate::affinity::shared::{LocalBindings, TierBackends};

/// The latest of `KEYS` (ends, the latest first) that names one
/// conversation, and that conversation's binding (`ARGV[1]`: the bindings'
/// key prefix): `{end, binding or ''}`, or nil.
static FIND: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
for _, k in ipairs(KEYS) do
  local v = redis.call('GET', k)
  if v and v ~= '=' then
    local conv = string.match(v, '^(%x+) ')
    if conv then
      return {v, redis.call('GET', ARGV[1] .. conv) or ''}
    end
  end
end
return false",
    )
});

/// File an end (`KEYS[1]`, `ARGV[2]` its value, kept `ARGV[3]` ms), unless
/// another conversation ended there too (then it is ambiguous: `=`), and
/// forget the end it continued (`KEYS[2]`, when given). `ARGV[1]`: its
/// conversation's name and a space, as its value starts.
static FILE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
local cur = redis.call('GET', KEYS[1])
if cur and string.sub(cur, 1, #ARGV[1]) ~= ARGV[1] then
  redis.call('SET', KEYS[1], '=', 'PX', ARGV[3])
else
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
end
if KEYS[2] then redis.call('DEL', KEYS[2]) end
return 1",
    )
});

fn end_key(store: &SharedStore, exact: u64) -> String {
    format!("{}c:{exact:016x}", store.config().key_prefix)
}

/// A conversation another gateway routed.
pub struct Found {
    pub id: u128,
    /// Where its last turn went, here.
    pub slot: u32,
    /// It is bound (its binding is taken into this gateway's table).
    pub bound: bool,
}

/// The conversation that the latest of `ends` (a prompt's earlier message
/// ends) was filed for by any gateway, with its binding taken into
/// `affinity`: one round trip. `None` when none was, the backend is not in
/// `tier` here, or the store cannot answer.
pub async fn find(
    store: &SharedStore,
    ends: &[u64],
    tier: &dyn TierBackends,
    affinity: &dyn LocalBindings,
) -> Option<Found> {
    if !store.healthy() || ends.is_empty() {
        return None;
    }
    let keys: Vec<String> = ends.iter().map(|&e| end_key(store, e)).collect();
    let prefix = store.config().key_prefix.clone();
    let checked = affinity.now_ms();
    let found: Option<(String, String)> = store
        .run("conversation", |mut c| async move {
            let mut call = FIND.prepare_invoke();
            for k in &keys {
                call.key(k);
            }
            call.arg(&prefix).invoke_async(&mut c).await
        })
        .await
        .ok()?;
    let (end, binding) = found?;
    let (id, backend) = end.split_once(' ')?;
    let id = u128::from_str_radix(id, 16).ok()?;
    let mut slot = tier.backend_slot(backend)?;
    let stored = (!binding.is_empty()).then(|| parse(&binding)).flatten();
    if let Some(s) = &stored {
        if let Some(bound) = tier.backend_slot(&s.backend) {
            adopt_stored(affinity, id, s, bound, tier, checked);
            slot = bound;
        }
    }
    Some(Found {
        id,
        slot,
        bound: stored.is_some(),
    })
}

/// File a routed turn's end (`exact`) for conversation `id` at `backend`,
/// forgetting the end it continued; in the background (the request does
/// not wait on it).
pub fn file(
    store: &std::sync::Arc<SharedStore>,
    exact: u64,
    id: u128,
    backend: &str,
    continued: Option<u64>,
    ttl_ms: u64,
) {
    if !store.healthy() || ttl_ms == 0 {
        return;
    }
    let store = std::sync::Arc::clone(store);
    let name = format!("{id:032x} ");
    let value = format!("{name}{backend}");
    let mut keys = vec![end_key(&store, exact)];
    keys.extend(
        continued
            .filter(|&c| c != exact)
            .map(|c| end_key(&store, c)),
    );
    tokio::spawn(async move {
        let _ = store
            .run("conversation", |mut c| async move {
                let mut call = FILE.prepare_invoke();
                for k in &keys {
                    call.key(k);
                }
                call.arg(&name)
                    .arg(&value)
                    .arg(ttl_ms)
                    .invoke_async::<i64>(&mut c)
                    .await
            })
            .await;
    });
}
