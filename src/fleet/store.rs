//! Bindings shared by a fleet of gateways through Redis (`affinity.store`).
//!
//! The local binding table stays the fast path; Redis holds the fleet's truth
//! and this module keeps the two in step:
//!
//! - a session with no live local binding (or one not checked against the
//!   store for `revalidate_ms`) is looked up in Redis first, and adopted;
//! - a first binding is written create-if-absent (a script: `GET`, else
//!   `SET … PX`), so gateways racing on one new session agree — the loser
//!   adopts the winner's backend and sends its request there;
//! - a rebind or move is a versioned compare-and-set (a script that refuses to
//!   overwrite a newer version) and is published on `<prefix>bindings`, which
//!   every gateway subscribes to and applies: other gateways learn of it within
//!   the publish latency, and within `revalidate_ms` if a message is lost;
//! - no write per request: a binding is checked against the store (`GET`
//!   and `PEXPIRE` in one round trip, so its TTL is refreshed too) when it is
//!   not live here or was last checked `revalidate_ms` ago (default: a
//!   quarter of the TTL, at most a minute); a long request whose Redis copy
//!   expired meanwhile finds none on its next turn and writes it back;
//! - every store operation has a deadline (`timeout_ms`): when Redis is slow or
//!   down, requests go on with local state (counted in
//!   `agentserve_store_errors_total`), bindings made meanwhile are remembered
//!   and written back create-if-absent when Redis answers again — a newer
//!   binding another gateway wrote wins, and this gateway adopts it.
//!
//! Values are `"<version> <backend id>"`; keys `<prefix><binding key hex>` (the
//! binding key already covers tier, tenant and session or group).

use crate::affinity::{BindingKey, Moves};
use crate::metrics::Metrics;
use parking_lot::Mutex;
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreKind {
    Local,
    Redis,
}

#[derive(Debug, Clone, PartialEq)]
pub struct StoreConfig {
    pub kind: StoreKind,
    pub url: String,
    pub key_prefix: String,
    pub timeout: Duration,
    pub revalidate: Duration,
    /// `rediss://` only: PEM files of the CA to trust instead of the
    /// system's, and of this gateway's certificate and key (mutual TLS).
    pub tls: StoreTls,
    /// `/healthz` fails while the store is unreachable (a balancer then
    /// sends this gateway nothing it would place alone).
    pub required: bool,
    /// How often this gateway publishes a heartbeat on the bindings channel;
    /// a subscription that hears nothing, not even its own, for three of
    /// these is taken as dead (a half-open connection) and made again.
    pub heartbeat: Duration,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreTls {
    pub ca_file: Option<String>,
    pub cert_file: Option<String>,
    pub key_file: Option<String>,
}

/// What the store says about one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub version: u32,
    pub backend: String,
    pub moves: StoredMoves,
}

/// A session's moves as the store keeps them: on the wall clock, which
/// every gateway reads alike (each table has its own clock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoredMoves {
    pub count: u8,
    /// Unix seconds of the last move.
    pub unix_s: u64,
}

impl StoredMoves {
    /// `m` (table seconds) on the wall clock, given both clocks now.
    pub fn from_table(m: Moves, table_now_ms: u64, unix_now_ms: u64) -> StoredMoves {
        if m.count == 0 {
            return StoredMoves::default();
        }
        let ago_ms = table_now_ms.saturating_sub(m.at_s as u64 * 1000);
        StoredMoves {
            count: m.count,
            unix_s: unix_now_ms.saturating_sub(ago_ms) / 1000,
        }
    }

    /// These moves on a table's clock (a move from before the table began
    /// reads as its first second).
    pub fn to_table(self, table_now_ms: u64, unix_now_ms: u64) -> Moves {
        if self.count == 0 {
            return Moves::default();
        }
        let ago_ms = unix_now_ms.saturating_sub(self.unix_s * 1000);
        Moves {
            count: self.count,
            at_s: (table_now_ms.saturating_sub(ago_ms) / 1000) as u32,
        }
    }
}

/// `<version> <backend>`, then `<moves> <unix s of the last>` once it moved.
/// (Backend ids have no spaces. A gateway built before the moves were kept
/// reads a moved binding's backend as unknown and serves it from its own
/// table until upgraded.)
pub(super) fn parse(v: &str) -> Option<Stored> {
    let mut it = v.split(' ');
    let version = it.next()?.parse().ok()?;
    let backend = it.next().filter(|b| !b.is_empty())?.to_string();
    let moves = match (it.next(), it.next()) {
        (Some(c), Some(t)) => StoredMoves {
            count: c.parse().ok()?,
            unix_s: t.parse().ok()?,
        },
        _ => StoredMoves::default(),
    };
    Some(Stored {
        version,
        backend,
        moves,
    })
}

fn value(s: &Stored) -> String {
    match s.moves.count {
        0 => format!("{} {}", s.version, s.backend),
        n => format!("{} {} {n} {}", s.version, s.backend, s.moves.unix_s),
    }
}

// Both scripts take the same arguments: ARGV = value (see `value`), TTL in
// ms, version, channel, this gateway's instance, tier.

/// Create-if-absent: returns the existing value, or nil after writing ours
/// and publishing it (every gateway learns the binding without asking).
const CREATE: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('PUBLISH', ARGV[4], ARGV[5] .. ' ' .. KEYS[1] .. ' ' .. ARGV[6] .. ' ' .. ARGV[1])
return false";

/// Versioned compare-and-set: writes ARGV[1] (version ARGV[3]) unless the
/// stored version is as new; then publishes it. Returns the newer value, or
/// nil when ours was written.
const REBIND: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur then
  local v = tonumber(string.match(cur, '^(%d+) '))
  if v and v >= tonumber(ARGV[3]) then return cur end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('PUBLISH', ARGV[4], ARGV[5] .. ' ' .. KEYS[1] .. ' ' .. ARGV[6] .. ' ' .. ARGV[1])
return false";

/// Versioned delete: removes KEYS[1] and publishes ARGV[3] on ARGV[2]
/// unless the stored binding is newer than version ARGV[1], or another
/// binding at that version (on another backend than ARGV[4], when that is
/// not empty: the session was bound anew, and new bindings start at one
/// again). Returns 1 when deleted.
const DELETE: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur then
  local v, b = string.match(cur, '^(%d+) (%S+)')
  v = tonumber(v)
  local mine = tonumber(ARGV[1])
  if v and (v > mine or (v == mine and ARGV[4] ~= '' and b ~= ARGV[4])) then return 0 end
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1";

/// The store's epoch: ARGV[1] written if it has none. A store that comes
/// back without it lost what it held (restarted empty, failed over to a
/// replica that had not caught up): its gateways write their bindings back.
const EPOCH: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur then return cur end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]";

/// A tenant's token bucket, shared by the fleet, on Redis's clock: refill
/// it at ARGV[1] a minute (up to ARGV[1]; full when new), then take ARGV[3]
/// if it holds at least ARGV[2] (always, when ARGV[2] is `-inf`: a charge
/// settled after the fact). Returns {0, the first bucket's level after}, or
/// {the first that refused (1-based), its level}.
const LIMIT: &str = r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local levels = {}
for i, k in ipairs(KEYS) do
  local rate = tonumber(ARGV[3 * i - 2])
  local v = redis.call('HMGET', k, 'l', 't')
  local level = tonumber(v[1]) or rate
  local at = tonumber(v[2]) or now
  level = math.min(rate, level + math.max(0, now - at) * rate / 60000)
  local need = ARGV[3 * i - 1]
  if need ~= '-inf' and level < tonumber(need) then
    return {i, tostring(level)}
  end
  levels[i] = level
end
for i, k in ipairs(KEYS) do
  redis.call('HSET', k, 'l', tostring(levels[i] - tonumber(ARGV[3 * i])), 't', now)
  redis.call('PEXPIRE', k, 120000)
end
return {0, tostring(levels[1] - tonumber(ARGV[3]))}";

/// The longest a connection attempt may take (at least `timeout_ms`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Bindings made while Redis could not be reached (bounded).
const MAX_PENDING_WRITES: usize = 100_000;

/// One of a tenant's per-minute buckets in the fleet's store.
pub struct Bucket<'a> {
    pub name: &'a str,
    /// Refilled at this many a minute, up to as many.
    pub per_minute: u64,
    /// Taken only if it holds this much (`None`: whatever it holds).
    pub need: Option<f64>,
    pub cost: f64,
}

pub struct SharedStore {
    cfg: StoreConfig,
    client: redis::Client,
    /// Made by [`SharedStore::connect`]; reconnects by itself after.
    conn: Mutex<Option<redis::aio::ConnectionManager>>,
    started: AtomicBool,
    create: redis::Script,
    rebind: redis::Script,
    delete: redis::Script,
    limit: redis::Script,
    epoch: redis::Script,
    /// The store's epoch when this gateway last looked.
    known_epoch: Mutex<Option<String>>,
    /// This gateway's name on the invalidation channel (its own messages
    /// are skipped).
    pub instance: String,
    metrics: Arc<Metrics>,
    healthy: AtomicBool,
    /// Keys bound locally while Redis was unreachable: written back later.
    unsynced: Mutex<HashSet<BindingKey>>,
    /// Local bindings checked before this (gateway clock, ms) are checked
    /// again: set when the subscription (re)starts, as messages may have
    /// been missed.
    resync_since: std::sync::atomic::AtomicU64,
}

#[derive(Debug)]
pub enum StoreError {
    Timeout,
    NotConnected,
    Redis(redis::RedisError),
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Timeout => write!(f, "timed out"),
            StoreError::NotConnected => write!(f, "not connected"),
            StoreError::Redis(e) => write!(f, "{e}"),
        }
    }
}

/// The client for `cfg` (no connection yet): the URL parsed, the TLS files
/// read. `check` calls it too, so a bad URL or an unreadable certificate is
/// reported before the gateway starts.
pub fn client(cfg: &StoreConfig) -> Result<redis::Client, String> {
    let url = cfg.url.as_str();
    let info = redis::IntoConnectionInfo::into_connection_info(url)
        .map_err(|e| format!("`{url}` is not a Redis URL: {e}"))?;
    let t = &cfg.tls;
    if t.ca_file.is_none() && t.cert_file.is_none() {
        return redis::Client::open(info).map_err(|e| e.to_string());
    }
    if !matches!(info.addr, redis::ConnectionAddr::TcpTls { .. }) {
        return Err(format!(
            "`{url}`: TLS files are set but the URL is not `rediss://`"
        ));
    }
    let read = |path: &str| std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"));
    let client_tls = match (&t.cert_file, &t.key_file) {
        (Some(cert), Some(key)) => {
            // Parsed here, so `check` refuses a file that is no PEM
            // certificate and key (the client would only fail to connect).
            match pingora_rustls::load_certs_and_key_files(cert, key) {
                Ok(Some(_)) => {}
                Ok(None) => {
                    return Err(format!(
                        "{cert} / {key}: no PEM certificate and private key in them"
                    ))
                }
                Err(e) => return Err(format!("{cert} / {key}: {e}")),
            }
            Some(redis::ClientTlsConfig {
                client_cert: read(cert)?,
                client_key: read(key)?,
            })
        }
        (None, None) => None,
        _ => return Err("tls_cert_file and tls_key_file go together".to_string()),
    };
    if let Some(ca) = &t.ca_file {
        let mut roots = pingora_rustls::RootCertStore::empty();
        if let Err(e) = pingora_rustls::load_ca_file_into_store(ca, &mut roots) {
            return Err(format!("{ca}: {e}"));
        }
        if roots.is_empty() {
            return Err(format!("{ca}: no PEM certificate in it"));
        }
    }
    let root_cert = t.ca_file.as_deref().map(read).transpose()?;
    pingora_rustls::install_default_crypto_provider();
    redis::Client::build_with_tls(
        info,
        redis::TlsCertificates {
            client_tls,
            root_cert,
        },
    )
    .map_err(|e| format!("TLS settings for `{url}`: {e}"))
}

/// Connect to the store `cfg` names and ask it to answer (`check
/// --connect`), within a few seconds. `Ok` for a local store.
pub fn try_connect(cfg: &StoreConfig) -> Result<(), String> {
    if cfg.kind != StoreKind::Redis {
        return Ok(());
    }
    let client = client(cfg)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async {
        let answer = tokio::time::timeout(CONNECT_TIMEOUT.max(cfg.timeout), async {
            let mut c = client.get_multiplexed_async_connection().await?;
            redis::cmd("PING").query_async::<String>(&mut c).await
        })
        .await;
        match answer {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(format!("{}: {e}", cfg.url)),
            Err(_) => Err(format!(
                "{}: no answer within {:?}",
                cfg.url, CONNECT_TIMEOUT
            )),
        }
    })
}

impl SharedStore {
    pub fn new(cfg: StoreConfig, metrics: Arc<Metrics>) -> Result<Arc<SharedStore>, String> {
        let client = client(&cfg)?;
        Ok(Arc::new(SharedStore {
            cfg,
            client,
            conn: Mutex::new(None),
            started: AtomicBool::new(false),
            create: redis::Script::new(CREATE),
            rebind: redis::Script::new(REBIND),
            delete: redis::Script::new(DELETE),
            limit: redis::Script::new(LIMIT),
            epoch: redis::Script::new(EPOCH),
            known_epoch: Mutex::new(None),
            instance: format!("{:016x}", rand::random::<u64>()),
            metrics,
            // Down until connected: requests go on with local state.
            healthy: AtomicBool::new(false),
            unsynced: Mutex::new(HashSet::new()),
            resync_since: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    pub(super) fn client(&self) -> &redis::Client {
        &self.client
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    pub(super) fn key(&self, key: BindingKey) -> String {
        format!("{}{key:032x}", self.cfg.key_prefix)
    }

    fn response_key(&self, key: u64) -> String {
        format!("{}response:{key:016x}", self.cfg.key_prefix)
    }

    /// Keep where a stored response lives (`value`: see
    /// [`crate::affinity::responses`]) for the fleet's other gateways.
    pub async fn put_response(
        &self,
        key: u64,
        value: String,
        ttl_ms: u64,
    ) -> Result<(), StoreError> {
        let k = self.response_key(key);
        self.run("response", |mut c| async move {
            redis::cmd("SET")
                .arg(&k)
                .arg(&value)
                .arg("PX")
                .arg(ttl_ms.max(1))
                .query_async::<()>(&mut c)
                .await
        })
        .await
    }

    /// Where another gateway saw a stored response answered, if any did.
    pub async fn get_response(&self, key: u64) -> Result<Option<String>, StoreError> {
        let k = self.response_key(key);
        self.run("response", |mut c| async move {
            redis::cmd("GET").arg(&k).query_async(&mut c).await
        })
        .await
    }

    /// Take each bucket's `cost` from the fleet's buckets, all or none, in
    /// one call on Redis's clock: all if each holds at least its `need`
    /// (the first bucket's level after); else `Err` with the first that
    /// does not, and its level.
    pub async fn limits(
        &self,
        buckets: &[Bucket<'_>],
    ) -> Result<Result<f64, (usize, f64)>, StoreError> {
        let keys: Vec<String> = buckets
            .iter()
            .map(|b| format!("{}limit:{}", self.cfg.key_prefix, b.name))
            .collect();
        let script = &self.limit;
        let (refused, level): (usize, String) = self
            .run("limit", |mut c| {
                let mut call = script.prepare_invoke();
                for (k, b) in keys.iter().zip(buckets) {
                    let need = b.need.map_or_else(|| "-inf".to_string(), |n| n.to_string());
                    call.key(k).arg(b.per_minute).arg(need).arg(b.cost);
                }
                async move { call.invoke_async(&mut c).await }
            })
            .await?;
        let level = level.parse().unwrap_or(0.0);
        Ok(match refused {
            0 => Ok(level),
            i => Err((i - 1, level)),
        })
    }

    /// Whether the store lost what it held since this gateway last looked:
    /// its epoch (set now if it has none) is not the one seen before.
    pub async fn lost_its_data(&self) -> Result<bool, StoreError> {
        let k = format!("{}epoch", self.cfg.key_prefix);
        let fresh = format!("{}-{:016x}", self.instance, rand::random::<u64>());
        let script = &self.epoch;
        let epoch: String = self
            .run("epoch", |mut c| async move {
                script.key(&k).arg(&fresh).invoke_async(&mut c).await
            })
            .await?;
        let mut known = self.known_epoch.lock();
        let lost = known.as_ref().is_some_and(|k| *k != epoch);
        *known = Some(epoch);
        Ok(lost)
    }

    /// This gateway wrote its bindings back to a store that lost them.
    pub fn reseeded(&self) {
        self.metrics.store_reseeds.inc();
    }

    pub fn channel(&self) -> String {
        format!("{}bindings", self.cfg.key_prefix)
    }

    /// Connect, if not connected yet. Only the store's background service
    /// calls this (a request never waits for a connection to be made), with
    /// a deadline of its own: a TLS handshake may take longer than a
    /// request's `timeout_ms` allows without harming anyone.
    pub async fn connect(&self) -> bool {
        if self.conn.lock().is_some() {
            return true;
        }
        let deadline = self.cfg.timeout.max(CONNECT_TIMEOUT);
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(deadline)
            .set_response_timeout(self.cfg.timeout)
            .set_number_of_retries(1);
        let made = tokio::time::timeout(
            deadline,
            self.client.get_connection_manager_with_config(config),
        )
        .await;
        let first = !self.started.swap(true, Ordering::Relaxed);
        let error = match made {
            Ok(Ok(c)) => {
                *self.conn.lock() = Some(c);
                log::info!("binding store connected ({})", self.cfg.url);
                return true;
            }
            Ok(Err(e)) => StoreError::Redis(e),
            Err(_) => StoreError::Timeout,
        };
        if first {
            log::warn!(
                "binding store unreachable at start ({error}); serving from local state until it answers"
            );
        }
        self.mark_down("connect", &error);
        false
    }

    /// Whether the first connection attempt is over (whatever its outcome):
    /// until then `/healthz` says the gateway is starting.
    pub fn started(&self) -> bool {
        self.started.load(Ordering::Relaxed)
    }

    fn mark_down(&self, op: &str, e: &StoreError) {
        if self.healthy.swap(false, Ordering::Relaxed) {
            log::warn!("binding store unreachable ({op}: {e}); serving from local state");
        }
    }

    /// Run one operation within the deadline; count it and its failure.
    pub(super) async fn run<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T, StoreError>
    where
        F: FnOnce(redis::aio::ConnectionManager) -> Fut,
        Fut: std::future::Future<Output = redis::RedisResult<T>>,
    {
        let started = Instant::now();
        let conn = self.conn.lock().clone();
        let result = match conn.ok_or(StoreError::NotConnected) {
            Ok(c) => match tokio::time::timeout(self.cfg.timeout, f(c)).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(StoreError::Redis(e)),
                Err(_) => Err(StoreError::Timeout),
            },
            Err(e) => Err(e),
        };
        self.metrics
            .store_latency
            .with_label_values(&[op])
            .observe(started.elapsed().as_secs_f64());
        self.metrics.store_ops.with_label_values(&[op]).inc();
        match &result {
            Ok(_) => self.healthy.store(true, Ordering::Relaxed),
            Err(e) => {
                self.metrics.store_errors.with_label_values(&[op]).inc();
                self.mark_down(op, e);
            }
        }
        result
    }

    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// The stored binding, its TTL refreshed in the same round trip.
    pub async fn sync(&self, key: BindingKey, ttl_ms: u64) -> Result<Option<Stored>, StoreError> {
        let k = self.key(key);
        let (v, _): (Option<String>, i64) = self
            .run("sync", |mut c| async move {
                redis::pipe()
                    .cmd("GET")
                    .arg(&k)
                    .cmd("PEXPIRE")
                    .arg(&k)
                    .arg(ttl_ms.max(1))
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(v.as_deref().and_then(parse))
    }

    /// The stored binding, read only (its TTL untouched): for the admin API.
    pub async fn peek(&self, key: BindingKey) -> Result<Option<Stored>, StoreError> {
        let k = self.key(key);
        let v: Option<String> = self
            .run("sync", |mut c| async move {
                redis::cmd("GET").arg(&k).query_async(&mut c).await
            })
            .await?;
        Ok(v.as_deref().and_then(parse))
    }

    /// Publish this gateway's heartbeat on the bindings channel (see
    /// [`StoreConfig::heartbeat`]); every subscriber hears it and skips it.
    pub async fn heartbeat(&self) -> Result<(), StoreError> {
        let (ch, msg) = (self.channel(), format!("{} heartbeat", self.instance));
        self.run("heartbeat", |mut c| async move {
            redis::cmd("PUBLISH")
                .arg(&ch)
                .arg(&msg)
                .query_async::<i64>(&mut c)
                .await
        })
        .await
        .map(|_| ())
    }

    /// Whether Redis answers (used while it is marked down).
    pub async fn ping(&self) -> bool {
        self.run("ping", |mut c| async move {
            redis::cmd("PING").query_async::<String>(&mut c).await
        })
        .await
        .is_ok()
    }

    /// Write a first binding unless one exists; `Some` is the existing one.
    pub async fn create(
        &self,
        key: BindingKey,
        tier: &str,
        ours: &Stored,
        ttl_ms: u64,
    ) -> Result<Option<Stored>, StoreError> {
        self.write("create", &self.create, key, tier, ours, ttl_ms)
            .await
    }

    /// Write a rebind unless the store has a binding as new; `Some` is that one.
    pub async fn rebind(
        &self,
        key: BindingKey,
        tier: &str,
        ours: &Stored,
        ttl_ms: u64,
    ) -> Result<Option<Stored>, StoreError> {
        self.write("rebind", &self.rebind, key, tier, ours, ttl_ms)
            .await
    }

    /// Run a writing script (`CREATE` or `REBIND`); `Some` is the binding it
    /// found instead of writing ours.
    async fn write(
        &self,
        op: &'static str,
        script: &redis::Script,
        key: BindingKey,
        tier: &str,
        ours: &Stored,
        ttl_ms: u64,
    ) -> Result<Option<Stored>, StoreError> {
        let version = ours.version;
        let (k, v, ch, me) = (
            self.key(key),
            value(ours),
            self.channel(),
            self.instance.clone(),
        );
        let cur: Option<String> = self
            .run(op, |mut c| async move {
                script
                    .key(&k)
                    .arg(&v)
                    .arg(ttl_ms.max(1))
                    .arg(version)
                    .arg(&ch)
                    .arg(&me)
                    .arg(tier)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        Ok(cur.as_deref().and_then(parse))
    }

    /// Delete `key`'s binding and tell every gateway, unless the store
    /// holds a newer one than `own`'s version, or another at that version on
    /// another backend than `own`'s (`None`: whatever it holds), as writes
    /// are versioned.
    pub async fn delete(
        &self,
        key: BindingKey,
        own: Option<(u32, &str)>,
    ) -> Result<(), StoreError> {
        let (k, ch, msg) = (
            self.key(key),
            self.channel(),
            format!("{} {} - 0 -", self.instance, self.key(key)),
        );
        // None: above any version a binding has, on any backend.
        let (version, backend) = own.map_or((u64::MAX, ""), |(v, b)| (u64::from(v), b));
        self.run("delete", |mut c| async move {
            self.delete
                .key(&k)
                .arg(version)
                .arg(&ch)
                .arg(&msg)
                .arg(backend)
                .invoke_async::<i64>(&mut c)
                .await
        })
        .await
        .map(|_| ())
    }

    /// Remember a binding made while the store was unreachable.
    /// Past [`MAX_PENDING_WRITES`] a key is dropped, and counted
    /// (`agentserve_store_unsynced_dropped_total`): its binding then reaches
    /// the store only at its next revalidation.
    pub fn remember_unsynced(&self, key: BindingKey) {
        let mut u = self.unsynced.lock();
        if u.len() < MAX_PENDING_WRITES || u.contains(&key) {
            u.insert(key);
        } else {
            self.metrics.store_unsynced_dropped.inc();
        }
    }

    pub fn take_unsynced(&self) -> Vec<BindingKey> {
        self.unsynced.lock().drain().collect()
    }

    pub fn has_unsynced(&self) -> bool {
        !self.unsynced.lock().is_empty()
    }

    pub fn resync_since(&self) -> u64 {
        self.resync_since.load(Ordering::Relaxed)
    }

    pub fn mark_resync(&self, now_ms: u64) {
        self.resync_since.store(now_ms, Ordering::Relaxed);
    }

    /// Subscribe to other gateways' new bindings, rebinds and deletes and
    /// hand each to `apply(key, tier, Some(stored) | None)`; resubscribes
    /// after a failure, and calls `resync` then (messages may have been
    /// missed).
    pub async fn run_subscriber(
        self: Arc<Self>,
        apply: impl Fn(BindingKey, &str, Option<Stored>) + Send + Sync,
        resync: impl Fn() + Send + Sync,
    ) {
        use futures_util::StreamExt;
        let mut backoff = Duration::from_millis(100);
        loop {
            let sub = async {
                let mut ps = self.client.get_async_pubsub().await?;
                ps.subscribe(self.channel()).await?;
                Ok::<_, redis::RedisError>(ps)
            };
            let subscribed =
                tokio::time::timeout(self.cfg.timeout.max(Duration::from_secs(1)), sub).await;
            if let Ok(Ok(mut ps)) = subscribed {
                backoff = Duration::from_millis(100);
                resync();
                let mut messages = ps.on_message();
                // Every gateway of the fleet, this one included, publishes a
                // heartbeat: silence means the connection died unnoticed.
                let silence = self.cfg.heartbeat * 3;
                loop {
                    let msg = match tokio::time::timeout(silence, messages.next()).await {
                        Ok(Some(msg)) => msg,
                        Ok(None) => break,
                        Err(_) => {
                            self.metrics
                                .store_errors
                                .with_label_values(&["subscription"])
                                .inc();
                            log::warn!(
                                "binding store: nothing heard on {} for {silence:?}, not even this gateway's heartbeat; subscribing again",
                                self.channel()
                            );
                            break;
                        }
                    };
                    let Ok(text) = msg.get_payload::<String>() else {
                        continue;
                    };
                    // "<instance> <redis key> <tier> <version> <backend>"
                    // (tier names and backend ids have no spaces).
                    let mut parts = text.splitn(5, ' ');
                    let (Some(from), Some(rkey), Some(tier), Some(version), Some(backend)) = (
                        parts.next(),
                        parts.next(),
                        parts.next(),
                        parts.next(),
                        parts.next(),
                    ) else {
                        continue;
                    };
                    if from == self.instance {
                        continue;
                    }
                    let Some(hex) = rkey.strip_prefix(self.cfg.key_prefix.as_str()) else {
                        continue;
                    };
                    let Ok(key) = u128::from_str_radix(hex, 16) else {
                        continue;
                    };
                    // The rest is the stored value, version first.
                    match version.parse::<u32>() {
                        Ok(0) | Err(_) => apply(key, tier, None),
                        Ok(_) => {
                            if let Some(s) = parse(&format!("{version} {backend}")) {
                                apply(key, tier, Some(s));
                            }
                        }
                    }
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip() {
        let plain = Stored {
            version: 7,
            backend: "vllm-0".into(),
            moves: StoredMoves::default(),
        };
        assert_eq!(
            value(&plain),
            "7 vllm-0",
            "as a build before moves wrote it"
        );
        assert_eq!(parse(&value(&plain)), Some(plain.clone()));
        let moved = Stored {
            moves: StoredMoves {
                count: 2,
                unix_s: 1_790_000_000,
            },
            ..plain
        };
        assert_eq!(parse(&value(&moved)), Some(moved));
        assert_eq!(parse("x vllm"), None);
        assert_eq!(parse("3"), None);
        assert_eq!(parse("3 "), None);
        assert_eq!(parse("3 vllm-0 x 5"), None);
    }

    #[test]
    fn moves_cross_from_one_table_clock_to_another_by_the_wall_clock() {
        // Gateway A's table is 100 s old, its session moved 5 s ago.
        let unix_now_ms = 1_790_000_000_000;
        let at_a = Moves { count: 2, at_s: 95 };
        let stored = StoredMoves::from_table(at_a, 100_000, unix_now_ms);
        assert_eq!(stored.unix_s, 1_789_999_995);
        // Gateway B's table is 3,600 s old: the move was 5 s ago there too.
        let at_b = stored.to_table(3_600_000, unix_now_ms);
        assert_eq!(
            at_b,
            Moves {
                count: 2,
                at_s: 3_595
            }
        );
        // A table younger than the move reads it as its first second.
        assert_eq!(stored.to_table(2_000, unix_now_ms).at_s, 0);
        assert_eq!(
            StoredMoves::from_table(Moves::default(), 1, 1),
            StoredMoves::default()
        );
    }
}
