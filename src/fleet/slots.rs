//! The fleet's one queue for each backend's slots, in Redis (admission's
//! [`FleetSlots`]; see `crate::admission::fleet` for what it does).
//!
//! Per backend, under `<prefix>adm:<backend id>:`: `run` and `pre` (each
//! gateway's requests running there, and prefilling), `q` (the waiters, a
//! sorted set of `<gateway>:<seat>` scored class, then their tenant's count,
//! then arrival), `m` (each waiter's `<gateway> <tenant> <counted>
//! <tokens>`), `g` (waiters handed a slot and not taken yet, with the other
//! gateways' prefill then and whether as a probe), `t` (each gateway's
//! tenant's requests running or waiting there), `n` (arrivals), `w` and
//! `s` (each gateway's prefill tokens under way, and since when), `v` (the
//! last voted cap on prefills), `p` (when the last probe went), `po` (the
//! gateway whose probe has not ended yet), `c` and `cs` (placement's
//! claims: a seat's expiry, its score), `vt` (the fleet's tally of votes
//! on how prefills run there). A gateway is alive
//! while `<prefix>adm:live:<gateway>` is (refreshed every second, kept
//! ten): a dead one's counts and waiters are dropped by the next call. A
//! slot handed over is published on `<prefix>adm:gw:<gateway>`.
//!
//! Scripts only, each one atomic; they name keys from their arguments, so
//! the store is one Redis server (or a primary), not a cluster, as for the
//! bindings.

use super::store::SharedStore;
use crate::admission::fleet::{
    Ahead, Asker, Caps, Ended, FleetSlots, Handed, Held, Placed, Placing, Seat, Seen,
};
use crate::admission::reserve::Unreachable;
use crate::admission::Admission;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// What every script begins with: Redis's clock now (ms), a waiter's place
/// in a backend's queue (the slot scripts queue by it, placement counts
/// what comes before a request by it), and what other gateways are
/// prefilling at a backend: the prefill tokens gateways other
/// than `g` have under way at the backend whose keys start with `base`
/// (those alive, and `me`, the gateway calling), and how long the oldest of
/// them has been under way (ms): its progress is taken off.
const SHARED: &str = r"
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)

-- A waiter's place in a backend's queue (`q`): its class, then its
-- tenant's share there when it came (`n` requests running or waiting, per
-- weight), then its arrival (added by the caller, under 2^28).
local function share_of(n, weight)
  return math.min(math.floor(n * 64 / math.max(1, weight)), 65535)
end

local function queue_score(class, share)
  return class * 17592186044416 + share * 268435456
end

local function work_elsewhere(prefix, base, g, me)
  local n, since = 0, now
  local w = redis.call('HGETALL', base..'w')
  for i = 1, #w, 2 do
    local o = w[i]
    if o ~= g and (o == me or redis.call('EXISTS', prefix..'adm:live:'..o) == 1) then
      n = n + tonumber(w[i + 1])
      since = math.min(since, tonumber(redis.call('HGET', base..'s', o)) or now)
    end
  end
  return n, now - since
end
";

/// What every slot script starts with, after [`SHARED`]. ARGV: 1 the
/// backend's key base, 2 the store's prefix, 3 this gateway, 4 the limit,
/// 5 the cap on prefills (0: none), 6 how that cap is known (0 configured,
/// 1 learned from this gateway's votes, 2 learned and not voted on here
/// yet), then the script's own.
///
/// A learned cap is the fleet's: a gateway whose answers voted writes its
/// cap (`v`), and one with no vote of its own takes the last written, so
/// that every vote counts for the whole fleet. Under a learned cap of one,
/// one request every ten seconds over the fleet (every second while no
/// gateway has voted) may start as a second prefill (`p`: when the last
/// did), and is told so: its answer votes on the cap, as a lone gateway's
/// probe does. As a lone gateway's, one probe is out at a time (`po`: its
/// gateway, until the probe's request ends, or the gateway is gone): before
/// the fleet's first vote, a probe a second while the first probes'
/// answers were still coming sent a burst's requests in two at a time
/// over the fleet, where one gateway sent one probe and waited for its
/// vote.
const PRELUDE: &str = r"
local base, prefix, gw = ARGV[1], ARGV[2], ARGV[3]
local limit, learned = tonumber(ARGV[4]), ARGV[6] ~= '0'
local cap = tonumber(ARGV[5])
local RUN, PRE, Q, META, GRANTED, TEN = base..'run', base..'pre', base..'q', base..'m', base..'g', base..'t'
local VOTED, PROBED, WORK, SINCE = base..'v', base..'p', base..'w', base..'s'
local PROBE_OUT = base..'po'

local function live(g)
  return g == gw or redis.call('EXISTS', prefix..'adm:live:'..g) == 1
end

-- The prefill other gateways than g have under way here (see SHARED;
-- a dead gateway's work is gone with its counts, `totals`).
local function others_work(g)
  return work_elsewhere(prefix, base, g, gw)
end

local function work_more(g, tokens)
  if redis.call('HINCRBY', WORK, g, tokens) == tonumber(tokens) then
    redis.call('HSET', SINCE, g, now)
  end
end

local function work_less(g, tokens)
  if redis.call('HINCRBY', WORK, g, -tonumber(tokens)) <= 0 then
    redis.call('HDEL', WORK, g)
    redis.call('HDEL', SINCE, g)
  end
end

local every = 10000
if ARGV[6] == '1' then
  redis.call('SET', VOTED, cap, 'PX', 600000)
elseif ARGV[6] == '2' then
  local voted = redis.call('GET', VOTED)
  if voted then cap = tonumber(voted) else every = 1000 end
end
-- The fleet's tally of votes (VOTE), where there is one, is the cap.
local tally = learned and redis.call('GET', base..'vt')
if tally then
  if tonumber(tally) >= SERIAL then cap = 1 else cap = 0 end
  every = 10000
end
local probe_due = learned and cap == 1 and now >= (tonumber(redis.call('GET', PROBED)) or 0) + every
if probe_due then
  local out = redis.call('GET', PROBE_OUT)
  probe_due = not (out and live(out))
end

-- The fleet's counts; a dead gateway's are dropped (it runs nothing now).
local function totals()
  local run, pre = 0, 0
  local r = redis.call('HGETALL', RUN)
  for i = 1, #r, 2 do
    local g = r[i]
    if live(g) then
      run = run + tonumber(r[i + 1])
      pre = pre + (tonumber(redis.call('HGET', PRE, g)) or 0)
    else
      redis.call('HDEL', RUN, g)
      redis.call('HDEL', PRE, g)
      redis.call('HDEL', WORK, g)
      redis.call('HDEL', SINCE, g)
      for _, f in ipairs(redis.call('HKEYS', TEN)) do
        if string.sub(f, 1, #g + 1) == g..' ' then redis.call('HDEL', TEN, f) end
      end
    end
  end
  return run, pre
end

-- Whether a request may start: false, true, or 'probe' (as the second
-- prefill under a learned cap of one).
local function room(run, pre, counted)
  if limit > 0 and run >= limit then return false end
  if cap == 0 or counted ~= '1' or pre < cap then return true end
  if probe_due and pre == 1 then return 'probe' end
  return false
end

local function probed(g)
  redis.call('SET', PROBED, now, 'PX', 60000)
  redis.call('SET', PROBE_OUT, g, 'PX', 60000)
  probe_due = false
end

-- g's probe ended (or was given back): another may go.
local function probe_over(g)
  if redis.call('GET', PROBE_OUT) == g then redis.call('DEL', PROBE_OUT) end
end

local function tenant_less(g, t)
  local f = g..' '..t
  if redis.call('HINCRBY', TEN, f, -1) <= 0 then redis.call('HDEL', TEN, f) end
end

local function less(h, g)
  if (tonumber(redis.call('HGET', h, g)) or 0) > 0 then redis.call('HINCRBY', h, g, -1) end
end

-- Hand the room there is to the best waiters, in order.
local function fill(run, pre)
  while true do
    local best = redis.call('ZRANGE', Q, 0, 0)
    if #best == 0 then return run, pre end
    local id = best[1]
    local meta = redis.call('HGET', META, id) or ''
    local g, t, c, w = string.match(meta, '^(%S+) (%S+) (%S+) (%S+)$')
    if g and live(g) then
      local r = room(run, pre, c)
      if not r then return run, pre end
      redis.call('HINCRBY', RUN, g, 1)
      run = run + 1
      if c == '1' then
        redis.call('HINCRBY', PRE, g, 1)
        pre = pre + 1
      end
      local probe = '0'
      if r == 'probe' then
        probed(g)
        probe = '1'
      end
      local ahead, ahead_ms = others_work(g)
      if c == '1' then work_more(g, w) end
      redis.call('HSET', GRANTED, id, meta..' '..ahead..' '..ahead_ms..' '..probe)
      redis.call('PUBLISH', prefix..'adm:gw:'..g, id..' '..base)
    end
    redis.call('ZREM', Q, id)
    redis.call('HDEL', META, id)
  end
end

-- `refused`: 1 raced (ACQUIRE), 2 the seat is unknown here (TAKE).
local function answer(granted, run, probe, ahead, ahead_ms, refused)
  return {granted, run, redis.call('ZCARD', Q), probe or 0, ahead or 0, ahead_ms or 0, refused or 0}
end
";

/// A slot now, or a place in the queue (the seat's claim there, if it
/// made one when it was placed, taken back). ARGV 7: the seat, 8 its tenant,
/// 9 its weight, 10 its class, 11 whether it counts as prefilling, 12 how
/// long this gateway is alive without a word (ms), 13 its prefill tokens,
/// 14 on: where its placement read found no other gateway's prefill here,
/// the backends it found idle besides. If one has started here since
/// (another gateway placed a conversation here between that read and this
/// call) and one of those is still idle (nothing running or waiting), it
/// takes neither slot nor place; the answer says so (raced), for it to be
/// placed again. Returns {handed a slot, the fleet's running, its waiting,
/// let by as a probe, the prefill tokens other gateways had prefilling
/// there, how long the oldest of them had been, 1 when raced}.
const ACQUIRE: &str = r"
redis.call('SET', prefix..'adm:live:'..gw, '1', 'PX', ARGV[12])
if redis.call('ZREM', base..'c', ARGV[7]) == 1 then redis.call('HDEL', base..'cs', ARGV[7]) end
redis.call('HSETNX', RUN, gw, 0)
local seat, tenant, counted, tokens = ARGV[7], ARGV[8], ARGV[11], ARGV[13]
local run, pre = totals()
if #ARGV >= 14 and counted == '1' then
  local n, ms = others_work(gw)
  if n > 0 then
    for i = 14, #ARGV do
      local other = prefix..'adm:'..ARGV[i]..':'
      local busy = redis.call('ZCARD', other..'q') > 0
      for _, r in ipairs(redis.call('HVALS', other..'run')) do
        busy = busy or tonumber(r) > 0
      end
      if not busy then return answer(0, run, 0, n, ms, 1) end
    end
  end
end
local r = redis.call('ZCARD', Q) == 0 and room(run, pre, counted)
if r then
  redis.call('HINCRBY', RUN, gw, 1)
  local ahead, ahead_ms = others_work(gw)
  if counted == '1' then
    redis.call('HINCRBY', PRE, gw, 1)
    work_more(gw, tokens)
  end
  redis.call('HINCRBY', TEN, gw..' '..tenant, 1)
  if r == 'probe' then
    probed(gw)
    return answer(1, run + 1, 1, ahead, ahead_ms)
  end
  return answer(1, run + 1, 0, ahead, ahead_ms)
end
local n = 0
for _, g in ipairs(redis.call('HKEYS', RUN)) do
  n = n + (tonumber(redis.call('HGET', TEN, g..' '..tenant)) or 0)
end
redis.call('HINCRBY', TEN, gw..' '..tenant, 1)
local seq = redis.call('INCR', base..'n') % 268435456
local share = share_of(n, tonumber(ARGV[9]))
redis.call('ZADD', Q, queue_score(tonumber(ARGV[10]), share) + seq, seat)
redis.call('HSET', META, seat, gw..' '..tenant..' '..counted..' '..tokens)
run, pre = fill(run, pre)
local granted = redis.call('HGET', GRANTED, seat)
if granted then
  redis.call('HDEL', GRANTED, seat)
  local ahead, ahead_ms, probe = string.match(granted, '(%S+) (%S+) (%S+)$')
  return answer(1, run, tonumber(probe), tonumber(ahead), tonumber(ahead_ms))
end
return answer(0, run)
";

/// The slot handed to a seat, taken (room a dead gateway left is handed
/// out first). ARGV 7: the seat. Returns {1 when one was, the fleet's
/// running, its waiting, let by as a probe, ..., 2 when the seat is
/// neither waiting nor handed a slot: the store lost it (restarted empty,
/// failed over, evicted), and its waiter would wait for nothing}.
const TAKE: &str = r"
local run, pre = totals()
run, pre = fill(run, pre)
local granted = redis.call('HGET', GRANTED, ARGV[7])
if not granted then
  if redis.call('HEXISTS', META, ARGV[7]) == 1 then return answer(0, run) end
  return answer(0, run, 0, 0, 0, 2)
end
redis.call('HDEL', GRANTED, ARGV[7])
local ahead, ahead_ms, probe = string.match(granted, '(%S+) (%S+) (%S+)$')
return answer(1, run, tonumber(probe), tonumber(ahead), tonumber(ahead_ms))
";

/// A seat leaves the queue; one handed a slot meanwhile gives it back.
/// ARGV 7: the seat. Returns 1 when it had been handed one.
const LEAVE: &str = r"
local seat = ARGV[7]
local had = 0
local meta = redis.call('HGET', META, seat)
if meta then
  redis.call('ZREM', Q, seat)
  redis.call('HDEL', META, seat)
  local g, t = string.match(meta, '^(%S+) (%S+)')
  tenant_less(g, t)
else
  meta = redis.call('HGET', GRANTED, seat)
  if meta then
    had = 1
    redis.call('HDEL', GRANTED, seat)
    local g, t, c, w = string.match(meta, '^(%S+) (%S+) (%S+) (%S+)')
    less(RUN, g)
    if c == '1' then
      less(PRE, g)
      work_less(g, w)
    end
    tenant_less(g, t)
    if string.sub(meta, -2) == ' 1' then probe_over(g) end
  end
end
local run, pre = totals()
run, pre = fill(run, pre)
return answer(had, run)
";

/// A request ended, or its prefill did. ARGV 7: its tenant, 8 whether it
/// ran (its slot is given back), 9 whether it still counted as prefilling,
/// 10 its prefill tokens, 11 whether it went as a probe.
const RELEASE: &str = r"
if ARGV[8] == '1' then
  less(RUN, gw)
  tenant_less(gw, ARGV[7])
  if ARGV[11] == '1' then probe_over(gw) end
end
if ARGV[9] == '1' then
  less(PRE, gw)
  work_less(gw, ARGV[10])
end
local run, pre = totals()
run, pre = fill(run, pre)
return answer(0, run)
";

/// This gateway's counts set to what it holds (after the store missed a
/// call). ARGV 7: its requests running, 8 prefilling, 9 how long it is
/// alive without a word, 10 its prefill tokens, 11 on: its seats still
/// waiting.
const SYNC: &str = r"
redis.call('SET', prefix..'adm:live:'..gw, '1', 'PX', ARGV[9])
local keep = {}
for i = 11, #ARGV do keep[ARGV[i]] = true end
local run_here, pre_here, work_here = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[10])
local mine = gw..':'
for _, s in ipairs(redis.call('HKEYS', META)) do
  if string.sub(s, 1, #mine) == mine and not keep[s] then
    local g, t = string.match(redis.call('HGET', META, s), '^(%S+) (%S+)')
    redis.call('ZREM', Q, s)
    redis.call('HDEL', META, s)
    tenant_less(g, t)
  end
end
for _, s in ipairs(redis.call('HKEYS', GRANTED)) do
  if string.sub(s, 1, #mine) == mine then
    local meta = redis.call('HGET', GRANTED, s)
    local g, t, c, w = string.match(meta, '^(%S+) (%S+) (%S+) (%S+)')
    if keep[s] then
      run_here = run_here + 1
      if c == '1' then
        pre_here = pre_here + 1
        work_here = work_here + tonumber(w)
      end
    else
      redis.call('HDEL', GRANTED, s)
      tenant_less(g, t)
      if string.sub(meta, -2) == ' 1' then probe_over(g) end
    end
  end
end
redis.call('HSET', RUN, gw, run_here)
redis.call('HSET', PRE, gw, pre_here)
if work_here > 0 then
  if redis.call('HEXISTS', SINCE, gw) == 0 then redis.call('HSET', SINCE, gw, now) end
  redis.call('HSET', WORK, gw, work_here)
else
  redis.call('HDEL', WORK, gw)
  redis.call('HDEL', SINCE, gw)
end
local run, pre = totals()
run, pre = fill(run, pre)
return answer(0, run)
";

/// An answer's vote on how prefills run at a backend, into the fleet's
/// tally. ARGV: 1 the backend's key base, 2 +1 (they queued) or -1 (side by
/// side). The tally starts one vote above where one gateway's first vote
/// starts (SERIAL + 1, then the vote), so that no single vote takes the
/// cap off: a first turn whose wait came out just under half the work
/// estimated ahead of it did, on a serial engine, and several prefills went
/// in at once. It stays within +-MAX; kept ten minutes past the last vote.
/// Returns it.
const VOTE: &str = r"
local T = ARGV[1]..'vt'
local t = tonumber(redis.call('GET', T)) or SERIAL + 1
t = math.max(-MAX, math.min(MAX, t + tonumber(ARGV[2])))
redis.call('SET', T, t, 'PX', 600000)
return t
";

/// Each backend named as a request placed now would find it (admission's
/// [`Placing`]), and a claim on the one it will go to when that is
/// already decided. ARGV: 1 the store's prefix, 2 this gateway, 3 the
/// asker's tenant, 4 its weight, 5 its class, 6 the seat to claim with (''
/// for none), then each backend's id and this gateway's limit there (0:
/// none), in the order ties are broken in. Returns, a backend after
/// another, {the prefill tokens other live gateways have under way there,
/// ms since the oldest of them began, the fleet's running there, its
/// waiting, those of its waiters and claims the queue's order puts before
/// the asker, its claims, 1 when it has no room}, then the claimed
/// backend's place in the list (0: none). A waiter's score is its class,
/// then its tenant's share when it came (see ACQUIRE), then its arrival,
/// and the asker's would be its class and its tenant's share now, after
/// every waiter's arrival.
///
/// A claim (`c`: seat to expiry, `cs`: seat to its score) stands for a
/// request placed and not yet queued: the next request placed counts it as
/// a waiter, so a burst of new conversations read one after another does
/// not all take the same least-queued backend. It is made only where the
/// choice is the script's to see: when one backend has room, or none has
/// (then the one with the fewest ahead, ties in the order given); the seat
/// takes it back when it asks for its slot (ACQUIRE), or it expires.
const PLACING: &str = r"
local prefix, gw, tenant = ARGV[1], ARGV[2], ARGV[3]
local weight, class, claim = tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[6]
local out, rows = {}, {}
for i = 7, #ARGV, 2 do
  local base, limit = prefix..'adm:'..ARGV[i]..':', tonumber(ARGV[i + 1])
  local n, ms = work_elsewhere(prefix, base, gw, gw)
  local run, mine = 0, 0
  local r = redis.call('HGETALL', base..'run')
  for j = 1, #r, 2 do
    local g = r[j]
    if g == gw or redis.call('EXISTS', prefix..'adm:live:'..g) == 1 then
      run = run + tonumber(r[j + 1])
    end
    mine = mine + (tonumber(redis.call('HGET', base..'t', g..' '..tenant)) or 0)
  end
  local share = share_of(mine, weight)
  local last = queue_score(class, share + 1) - 1
  local C, CS = base..'c', base..'cs'
  for _, old in ipairs(redis.call('ZRANGEBYSCORE', C, '-inf', now)) do
    redis.call('ZREM', C, old)
    redis.call('HDEL', CS, old)
  end
  local claims, before = redis.call('ZCARD', C), 0
  for _, score in ipairs(redis.call('HVALS', CS)) do
    if tonumber(score) <= last then before = before + 1 end
  end
  local waiting = redis.call('ZCARD', base..'q')
  local ahead = redis.call('ZCOUNT', base..'q', '-inf', last) + before
  local full = 0
  if waiting > 0 or (limit > 0 and run + claims >= limit) then full = 1 end
  rows[#rows + 1] = {base = base, ahead = ahead, full = full, score = queue_score(class, share)}
  for _, v in ipairs({n, ms, run, waiting, ahead, claims, full}) do out[#out + 1] = v end
end
local chosen, open = 0, 0
for i, row in ipairs(rows) do
  if row.full == 0 then open, chosen = open + 1, i end
end
if open == 0 then
  for i, row in ipairs(rows) do
    if chosen == 0 or row.ahead < rows[chosen].ahead then chosen = i end
  end
elseif open > 1 then
  chosen = 0
end
if claim == '' then chosen = 0 end
if chosen > 0 then
  local row = rows[chosen]
  redis.call('ZADD', row.base..'c', now + 2000, claim)
  redis.call('HSET', row.base..'cs', claim, row.score)
  redis.call('PEXPIRE', row.base..'c', 60000)
  redis.call('PEXPIRE', row.base..'cs', 60000)
end
out[#out + 1] = chosen
return out
";

struct Scripts {
    vote: redis::Script,
    placing: redis::Script,
    acquire: redis::Script,
    take: redis::Script,
    leave: redis::Script,
    release: redis::Script,
    sync: redis::Script,
}

/// The bounds of one gateway's tally, for the fleet's (`VOTE`, `PRELUDE`).
static VOTES: LazyLock<String> = LazyLock::new(|| {
    use crate::admission::learn::{SERIAL_VOTES, VOTES_MAX};
    format!("local SERIAL, MAX = {SERIAL_VOTES}, {VOTES_MAX}\n")
});

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    vote: redis::Script::new(&format!("{}{VOTE}", *VOTES)),
    placing: redis::Script::new(&format!("{SHARED}{PLACING}")),
    acquire: redis::Script::new(&format!("{}{SHARED}{PRELUDE}{ACQUIRE}", *VOTES)),
    take: redis::Script::new(&format!("{}{SHARED}{PRELUDE}{TAKE}", *VOTES)),
    leave: redis::Script::new(&format!("{}{SHARED}{PRELUDE}{LEAVE}", *VOTES)),
    release: redis::Script::new(&format!("{}{SHARED}{PRELUDE}{RELEASE}", *VOTES)),
    sync: redis::Script::new(&format!("{}{SHARED}{PRELUDE}{SYNC}", *VOTES)),
});

/// How long a gateway counts as alive without a word from it, and how
/// often it says one.
const ALIVE: Duration = Duration::from_secs(10);
const REFRESH: Duration = Duration::from_secs(1);

impl SharedStore {
    fn slot_base(&self, backend: &str) -> String {
        format!("{}adm:{backend}:", self.config().key_prefix)
    }

    fn seat_name(&self, id: u64) -> String {
        format!("{}:{id}", self.instance)
    }

    /// The grants channel of this gateway.
    fn grants(&self) -> String {
        format!("{}adm:gw:{}", self.config().key_prefix, self.instance)
    }

    /// Run one of the scripts for `backend` with the prelude's arguments,
    /// then `rest`: `(handed a slot, the fleet's counts)`.
    async fn slots_call(
        &self,
        op: &'static str,
        script: &'static redis::Script,
        backend: &str,
        caps: Caps,
        rest: Vec<String>,
    ) -> Result<(Handed, Seen), Unreachable> {
        let base = self.slot_base(backend);
        let prefix = self.config().key_prefix.clone();
        let gw = self.instance.clone();
        type Answer = (u32, u32, u32, u32, u64, u64, u32);
        let (granted, running, waiting, probe, tokens, ms, refused): Answer = self
            .run(op, |mut c| {
                let mut call = script.prepare_invoke();
                call.arg(base).arg(prefix).arg(gw);
                call.arg(caps.limit).arg(caps.prefilling);
                call.arg(caps.cap_source as u8);
                for a in rest {
                    call.arg(a);
                }
                async move { call.invoke_async(&mut c).await }
            })
            .await
            .map_err(|_| Unreachable)?;
        let ahead = Ahead { tokens, ms };
        let handed = match (granted, probe, refused) {
            (0, _, 1) => Handed::Raced { ahead },
            (0, _, 2) => Handed::Lost,
            (0, _, _) => Handed::None,
            (_, 0, _) => Handed::Slot { ahead },
            _ => Handed::Probe { ahead },
        };
        Ok((handed, Seen { running, waiting }))
    }

    /// This gateway's counts at `backend` set to what it holds: `running`
    /// and `prefilling` slots, seats `waiting`.
    async fn sync_slots(
        &self,
        backend: &str,
        held: Held,
        waiting: &[u64],
        caps: Caps,
    ) -> Result<Seen, Unreachable> {
        let mut rest = vec![
            held.running.to_string(),
            held.prefilling.to_string(),
            ALIVE.as_millis().to_string(),
            held.prefill_tokens.to_string(),
        ];
        rest.extend(waiting.iter().map(|id| self.seat_name(*id)));
        let s = &SCRIPTS.sync;
        Ok(self.slots_call("slots", s, backend, caps, rest).await?.1)
    }

    /// Say this gateway is alive.
    async fn alive(&self) -> Result<(), Unreachable> {
        let k = format!("{}adm:live:{}", self.config().key_prefix, self.instance);
        self.run("slots", |mut c| async move {
            redis::cmd("SET")
                .arg(k)
                .arg("1")
                .arg("PX")
                .arg(ALIVE.as_millis() as u64)
                .query_async::<()>(&mut c)
                .await
        })
        .await
        .map_err(|_| Unreachable)
    }

    /// The fleet queue's background work for `admission`: this gateway's
    /// word that it is alive, the grants published to it, and its counts
    /// set again after the store missed a call.
    pub async fn run_slots(self: Arc<Self>, admission: Arc<Admission>) {
        tokio::spawn(Arc::clone(&self).run_grants(Arc::clone(&admission)));
        let mut tick = tokio::time::interval(REFRESH);
        loop {
            tick.tick().await;
            if !self.healthy() || self.alive().await.is_err() {
                admission.fleet_dirty();
                continue;
            }
            if let Some(since) = admission.fleet_reconcile_due() {
                let mut clean = true;
                for (slot, id, held) in admission.fleet_backends() {
                    let waiting = admission.fleet_waiting(slot);
                    let caps = admission.fleet_caps(slot);
                    match self.sync_slots(&id, held, &waiting, caps).await {
                        Ok(seen) => admission.fleet_seen(slot, seen),
                        Err(_) => clean = false,
                    }
                }
                admission.fleet_reconciled(since, clean);
            }
        }
    }

    /// A grant published to this gateway: `<gateway>:<seat> <key base>`.
    fn grant(&self, text: &str, mine: &str) -> Option<(u64, String)> {
        let (seat, base) = text.split_once(' ')?;
        let id = seat.strip_prefix(mine)?.parse().ok()?;
        let backend = base
            .strip_prefix(&format!("{}adm:", self.config().key_prefix))?
            .strip_suffix(':')?
            .to_string();
        Some((id, backend))
    }

    /// The slot handed to seat `id` at `backend`, whose waiter went, given
    /// back.
    async fn give_back(&self, admission: &Admission, backend: &str, id: u64) {
        let slot = admission
            .fleet_backends()
            .into_iter()
            .find(|(_, b, _)| **b == *backend)
            .map(|(slot, _, _)| slot);
        let Some(slot) = slot else {
            return admission.fleet_dirty();
        };
        let rest = vec![self.seat_name(id)];
        let caps = admission.fleet_caps(slot);
        match self
            .slots_call("slots", &SCRIPTS.leave, backend, caps, rest)
            .await
        {
            Ok((_, seen)) => admission.fleet_seen(slot, seen),
            Err(Unreachable) => admission.fleet_dirty(),
        }
    }

    /// Hand the grants published to this gateway to its waiters; after a
    /// new subscription every waiter asks (grants may have been missed).
    async fn run_grants(self: Arc<Self>, admission: Arc<Admission>) {
        use futures_util::StreamExt;
        let channel = self.grants();
        let mine = format!("{}:", self.instance);
        loop {
            let sub = async {
                let mut ps = self.client().get_async_pubsub().await?;
                ps.subscribe(&channel).await?;
                Ok::<_, redis::RedisError>(ps)
            };
            let timeout = self.config().timeout.max(Duration::from_secs(1));
            if let Ok(Ok(mut ps)) = tokio::time::timeout(timeout, sub).await {
                admission.fleet_wake_all();
                let mut messages = ps.on_message();
                while let Some(msg) = messages.next().await {
                    let Ok(text) = msg.get_payload::<String>() else {
                        continue;
                    };
                    let Some((id, backend)) = self.grant(&text, &mine) else {
                        continue;
                    };
                    if !admission.fleet_woken(id) {
                        // Its waiter went meanwhile: the slot goes back.
                        let (store, admission) = (Arc::clone(&self), Arc::clone(&admission));
                        tokio::spawn(
                            async move { store.give_back(&admission, &backend, id).await },
                        );
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

#[async_trait::async_trait]
impl FleetSlots for SharedStore {
    fn healthy(&self) -> bool {
        SharedStore::healthy(self)
    }

    async fn acquire(&self, seat: &Seat, caps: Caps) -> Result<(Handed, Seen), Unreachable> {
        let mut rest = vec![
            self.seat_name(seat.id),
            format!("{:x}", seat.tenant),
            seat.weight.to_string(),
            seat.class.index().to_string(),
            (seat.counted as u8).to_string(),
            ALIVE.as_millis().to_string(),
            seat.tokens.to_string(),
        ];
        rest.extend(seat.idle_elsewhere.iter().map(|b| b.to_string()));
        let s = &SCRIPTS.acquire;
        self.slots_call("slots", s, &seat.backend, caps, rest).await
    }

    async fn take(&self, seat: &Seat, caps: Caps) -> Result<(Handed, Seen), Unreachable> {
        let rest = vec![self.seat_name(seat.id)];
        let s = &SCRIPTS.take;
        self.slots_call("slots", s, &seat.backend, caps, rest).await
    }

    async fn leave(&self, seat: &Seat, caps: Caps) -> Result<Seen, Unreachable> {
        let rest = vec![self.seat_name(seat.id)];
        let s = &SCRIPTS.leave;
        Ok(self
            .slots_call("slots", s, &seat.backend, caps, rest)
            .await?
            .1)
    }

    async fn placing(
        &self,
        backends: &[(&str, u32)],
        asker: &Asker,
        claim: Option<u64>,
    ) -> Result<Placed, Unreachable> {
        let prefix = self.config().key_prefix.clone();
        let gw = self.instance.clone();
        let who = (
            format!("{:x}", asker.tenant),
            asker.weight,
            asker.class.index(),
            claim.map_or(String::new(), |id| self.seat_name(id)),
        );
        let mut each: Vec<String> = Vec::with_capacity(backends.len() * 2);
        for (id, limit) in backends {
            each.push(id.to_string());
            each.push(limit.to_string());
        }
        let flat: Vec<u64> = self
            .run("slots", |mut c| {
                let mut call = SCRIPTS.placing.prepare_invoke();
                call.arg(prefix).arg(gw).arg(who.0).arg(who.1).arg(who.2);
                call.arg(who.3).arg(each);
                async move { call.invoke_async(&mut c).await }
            })
            .await
            .map_err(|_| Unreachable)?;
        let count = |n: u64| n.min(u32::MAX as u64) as u32;
        let (rows, chosen) = flat.split_at(flat.len().saturating_sub(1));
        let backends: Vec<Placing> = rows
            .chunks_exact(7)
            .map(|p| Placing {
                prefill: Ahead {
                    tokens: p[0],
                    ms: p[1],
                },
                seen: Seen {
                    running: count(p[2]),
                    waiting: count(p[3]),
                },
                ahead: count(p[4]),
                claims: count(p[5]),
                full: p[6] == 1,
            })
            .collect();
        let claimed = match chosen.first() {
            Some(&i) if i >= 1 && (i as usize) <= backends.len() => Some(i as usize - 1),
            _ => None,
        };
        Ok(Placed { backends, claimed })
    }

    async fn vote(&self, backend: &str, queued: bool) -> Result<i8, Unreachable> {
        let base = self.slot_base(backend);
        let delta: i8 = if queued { 1 } else { -1 };
        let tally: i64 = self
            .run("slots", |mut c| {
                let mut call = SCRIPTS.vote.prepare_invoke();
                call.arg(base).arg(delta);
                async move { call.invoke_async(&mut c).await }
            })
            .await
            .map_err(|_| Unreachable)?;
        Ok(tally.clamp(i8::MIN as i64, i8::MAX as i64) as i8)
    }

    async fn release(
        &self,
        backend: &str,
        tenant: u64,
        ended: Ended,
        caps: Caps,
    ) -> Result<Seen, Unreachable> {
        let rest = vec![
            format!("{tenant:x}"),
            (ended.ran as u8).to_string(),
            (ended.prefilling as u8).to_string(),
            ended.tokens.to_string(),
            (ended.probe as u8).to_string(),
        ];
        let s = &SCRIPTS.release;
        Ok(self.slots_call("slots", s, backend, caps, rest).await?.1)
    }
}
