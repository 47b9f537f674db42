#!/usr/bin/env bash
# Admission benchmark (issue 29): 3 simulated replicas that run 4 requests
# at a time each (the rest wait in the engine's own queue, as vLLM's
# num_requests_waiting) with serial prefill and a scarce prefix cache, behind
# one gateway with admission off (every request straight on: the baseline),
# on (max_in_flight 4 per backend, the engines' batch) and gated (also
# max_prefilling 1: one request at a time awaits its first byte per backend):
#
#   tenants   a quiet tenant (4 conversations, 2 at a time, its own key)
#             alone, then beside a noisy one (60 conversations at once,
#             another key: 5x the fleet's 12 slots)
#   classes   one tenant's interactive turns (4 conversations, 2 at a time)
#             alone, then beside a batch of its own subagent-like requests
#             (60 at once, x-agent-serve-priority: batch)
#
# The contended runs start the heavy load first and the light one a second
# later; the heavy one runs on past the light one's end. While they run,
# each engine's waiting queue is sampled every 100 ms. Replicas and the
# gateway are restarted before each run. Prints one table per scenario and
# the ratios the issue asks for.
#
#   scripts/bench-admission.sh
#   BIN=target/debug/agent-gateway scripts/bench-admission.sh   # skip the build
#   SIM_FLAGS="" scripts/bench-admission.sh   # engines that prefill side by side (default --serial-prefill)
#
#   KEEP=dir GW_LOG=info scripts/bench-admission.sh   # keep each gateway's log (gwN.log)
#   REPEATS=5 MODES="learned learned-x2" SCENARIOS=tenants scripts/bench-admission.sh   # pooled tails
#
# Everything listens on 127.0.0.1 and is stopped (by PID) when the script exits.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --profile demo --quiet
  BIN=target/demo/agent-gateway
fi
HEAVY_TURNS="${HEAVY_TURNS:-10}"
CONTEXT_BYTES="${CONTEXT_BYTES:-8000}"
# off: admission off (the baseline); learned: admission on and nothing else (limits
# learned from the engines' gauges, the cap on prefills from their answers);
# learned-gated: and max_prefilling 1 configured; learned-budget: and prefill_queue_ms: 250 (at
# most 250 ms of prefill sent to a backend and not answered, beyond one request);
# learned-fast: learned, the gauges read every 250 ms;
# on: max_in_flight 4; gated: and max_prefilling 1.
# A mode ending in -x2 (learned-x2) runs two gateways of that mode in front of
# the same engines, each client's requests round robin over them (as an L4
# balancer spreads them), sharing bindings through a script-owned Redis, each
# gateway learning the engines' limits alone.
MODES="${MODES:-off learned on gated}"
# REPEATS: run the modes this many times, interleaved, and pool the light
# load's TTFTs per mode (a run's p99 of 24 light turns is its slowest one).
REPEATS="${REPEATS:-1}"
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; [ -n "${KEEP:-}" ] && cp -r "$WORK"/. "$KEEP"/; rm -rf "$WORK"; }
trap cleanup EXIT

. scripts/lib/ports.sh

QUIET_KEY=sk-bench-quiet
NOISY_KEY=sk-bench-noisy
cat > "$WORK/keys.yaml" <<YAML
keys:
  - { key_sha256: $(printf %s "$QUIET_KEY" | "$BIN" hash-key), tenant: quiet }
  - { key_sha256: $(printf %s "$NOISY_KEY" | "$BIN" hash-key), tenant: noisy }
YAML

SIM_PORTS=($(port) $(port) $(port))
RUN_PIDS=()
start() {  # mode: fresh replicas and gateway(s); sets GW (their URLs, comma-separated)
  local on=$1 n=1 gp ap mp
  case "$on" in *-x2) n=2; on=${on%-x2} ;; esac
  for p in "${RUN_PIDS[@]}"; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  RUN_PIDS=()
  for i in 0 1 2; do
    "$BIN" sim-backend --listen "127.0.0.1:${SIM_PORTS[$i]}" --id "vllm-$i" --max-batch 4 \
      ${SIM_FLAGS---serial-prefill} --cache-blocks 4096 >/dev/null &
    RUN_PIDS+=($!); PIDS+=($!)
  done
  local section=""
  case "$on" in
    on) section="admission: { enabled: true, max_in_flight: 4, max_wait_ms: 60000 }
auth: { keys_file: \"$WORK/keys.yaml\" }" ;;
    gated) section="admission: { enabled: true, max_in_flight: 4, max_prefilling: 1, max_wait_ms: 60000 }
auth: { keys_file: \"$WORK/keys.yaml\" }" ;;
    learned-fast) section="admission: { enabled: true }
load: { interval_ms: 250 }
auth: { keys_file: \"$WORK/keys.yaml\" }" ;;
    learned) section="admission: { enabled: true }
auth: { keys_file: \"$WORK/keys.yaml\" }" ;;
    learned-gated) section="admission: { enabled: true, max_prefilling: 1 }
auth: { keys_file: \"$WORK/keys.yaml\" }" ;;
    learned-budget) section="admission: { enabled: true, prefill_queue_ms: 250 }
auth: { keys_file: \"$WORK/keys.yaml\" }" ;;
  esac
  for i in 0 1 2; do wait_port "${SIM_PORTS[$i]}"; done
  local store=""
  STORE_PORT=""
  if [ "$n" -gt 1 ]; then
    # A fleet shares its bindings (and tenants' limits) through Redis.
    local rp; rp=$(port)
    STORE_PORT=$rp
    redis-server --port "$rp" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
    RUN_PIDS+=($!); PIDS+=($!)
    wait_port "$rp"
    store=", store: { kind: redis, url: \"redis://127.0.0.1:$rp\" }"
  fi
  GW=""
  for g in $(seq 1 "$n"); do
    gp=$(port); mp=$(port); ap=$(port)
    cat > "$WORK/gw$g.yaml" <<YAML
server:
  listen: ["127.0.0.1:$gp"]
  pid_file: "$WORK/gw$g.pid"
  upgrade_sock: "$WORK/gw$g.sock"
tiers:
  default:
    default: true
    backends:
      - { id: vllm-0, addr: "127.0.0.1:${SIM_PORTS[0]}" }
      - { id: vllm-1, addr: "127.0.0.1:${SIM_PORTS[1]}" }
      - { id: vllm-2, addr: "127.0.0.1:${SIM_PORTS[2]}" }
affinity: { hash_key: "57316d41c82821d491f43229c8cfd2ae94b40fa5ae4971a5a4c75b7cc28846d1"$store }
health: { interval_ms: 500 }
metrics: { listen: "127.0.0.1:$mp" }
admin: { listen: "127.0.0.1:$ap" }
$section
YAML
    RUST_LOG="${GW_LOG:-error}" "$BIN" run --config "$WORK/gw$g.yaml" >>"$WORK/gw$g.log" 2>&1 &
    RUN_PIDS+=($!); PIDS+=($!)
    wait_port "$gp"
    GW="${GW:+$GW,}http://127.0.0.1:$gp"
  done
}

light() {  # label, key, extra header...: the light load's report (JSON) on stdout
  local label=$1 key=$2; shift 2
  local extra=()
  for h in "$@"; do extra+=(--header "$h"); done
  "$BIN" bench --url "$GW" --sessions 4 --turns 6 -c 2 --context-bytes "$CONTEXT_BYTES" \
    --id-prefix "light-$label" --label "$label" --header "Authorization: Bearer $key" "${extra[@]}" --json
}

heavy() {  # label, key, extra header...: runs in the background, report to $WORK/heavy.json
  local label=$1 key=$2; shift 2
  local extra=()
  for h in "$@"; do extra+=(--header "$h"); done
  "$BIN" bench --url "$GW" --sessions 60 --turns "$HEAVY_TURNS" -c 60 --context-bytes "$CONTEXT_BYTES" \
    --id-prefix "heavy-$label" --label "$label" --header "Authorization: Bearer $key" "${extra[@]}" \
    --json > "$WORK/heavy.json" &
  HEAVY=$!
}

# The fleet store's counts that are not zero: each gateway's requests running,
# prefilling, their prefill tokens, slots handed over and not taken, waiters.
STORE_COUNTS="local o = {}
for _, k in ipairs(redis.call('KEYS', 'agentserve:adm:*')) do
  if k:match(':run\$') or k:match(':pre\$') or k:match(':w\$') or k:match(':g\$') then
    local h = redis.call('HGETALL', k)
    for i = 1, #h, 2 do
      if h[i + 1] ~= '0' then o[#o + 1] = k .. ' ' .. h[i] .. ' ' .. h[i + 1] end
    end
  elseif k:match(':q\$') then
    o[#o + 1] = k .. ' ' .. redis.call('ZCARD', k) .. ' waiting'
  end
end
return o"
leftover() {  # file: what the fleet store still counts once every request has answered (nothing, unless a count leaked)
  [ -n "$STORE_PORT" ] || return 0
  local i left=""
  # The last answers' slots are given back just after them: allow 3 s.
  for i in $(seq 30); do
    left=$(redis-cli -p "$STORE_PORT" EVAL "$STORE_COUNTS" 0)
    [ -z "$left" ] && break
    sleep 0.1
  done
  echo -n "$left" > "$1"
  [ -z "$left" ] || echo "the fleet store still counts, with every request answered ($1): $left" >&2
}

sample_queues() {  # until $1 exits: each engine's num_requests_waiting, every 100 ms
  : > "$WORK/waiting"
  while kill -0 "$1" 2>/dev/null; do
    for p in "${SIM_PORTS[@]}"; do
      curl -s "http://127.0.0.1:$p/metrics" | awk '/^vllm:num_requests_waiting/ {print $NF}' >> "$WORK/waiting"
    done
    sleep 0.1
  done
}

# scenario NAME LIGHT_KEY HEAVY_KEY LIGHT_HEADER HEAVY_HEADER
scenario() {
  local name=$1 lkey=$2 hkey=$3 lh=$4 hh=$5
  local r mode
  for r in $(seq 1 "$REPEATS"); do
    for mode in $MODES; do
      local run="$name-$mode-r$r"
      start "$mode"
      light "alone" "$lkey" $lh > "$WORK/$run-alone.json"
      leftover "$WORK/$run-alone-store"
      start "$mode"
      heavy "heavy" "$hkey" $hh
      sleep 1   # the heavy load is on (the behaviour under test, not synchronisation)
      sample_queues "$HEAVY" &
      local sampler=$!
      light "beside" "$lkey" $lh > "$WORK/$run-beside.json"
      wait "$HEAVY"
      wait "$sampler"
      leftover "$WORK/$run-heavy-store"
      cp "$WORK/heavy.json" "$WORK/$run-heavy.json"
      cp "$WORK/waiting" "$WORK/$run-waiting"
    done
  done
  for r in $(seq 1 "$REPEATS"); do
    report "$name" "$r"
  done
  [ "$REPEATS" -gt 1 ] && pooled "$name"
  return 0
}

report() {  # scenario name, repeat: its table
  python3 - "$WORK" "$1" "$MODES" "$2" "$REPEATS" <<'PY'
import json, sys
work, name, rep, reps = sys.argv[1], sys.argv[2], sys.argv[4], int(sys.argv[5])
def load(mode, part):
    return json.load(open(f"{work}/{name}-{mode}-r{rep}-{part}.json"))
def waiting(mode):
    v = [float(x) for x in open(f"{work}/{name}-{mode}-r{rep}-waiting").read().split()]
    return (sum(v) / len(v) if v else 0.0, max(v) if v else 0.0)
print(f"\n### {name}" + (f" (repeat {rep} of {reps})" if reps > 1 else "") + "\n")
print("| admission | light TTFT p50 / p99 alone | light TTFT p50 / p99 beside heavy | p99 beside ÷ alone (same mode) | p99 beside ÷ alone with admission off | light E2E p99 beside | heavy req/s | heavy prefix-cache hit | errors (light, heavy) | engines' waiting queue, mean / peak per backend |")
print("|---|---|---|---|---|---|---|---|---|---|")
modes = sys.argv[3].split()
off_alone = load("off", "alone")["ttft"]["p99_ms"] if "off" in modes else None
res = {}
for mode in modes:
    a, b, h = load(mode, "alone"), load(mode, "beside"), load(mode, "heavy")
    mean, peak = waiting(mode)
    ratio = b["ttft"]["p99_ms"] / max(a["ttft"]["p99_ms"], 1e-9)
    vs_off = "-" if off_alone is None else "**%.2f×**" % (b["ttft"]["p99_ms"] / max(off_alone, 1e-9))
    res[mode] = (ratio, h["requests_per_s"], h["prefix_cache_hit_rate"], b["prefix_cache_hit_rate"])
    print(f"| {mode} | {a['ttft']['p50_ms']:.0f} / {a['ttft']['p99_ms']:.0f} ms | {b['ttft']['p50_ms']:.0f} / {b['ttft']['p99_ms']:.0f} ms | {ratio:.2f}× | {vs_off} | {b['e2e']['p99_ms']:.0f} ms | {h['requests_per_s']:.1f} | {100*h['prefix_cache_hit_rate']:.1f}% | {b['errors']}, {h['errors']} | {mean:.2f} / {peak:.0f} |")
print()
for mode in [m for m in res if m != "off" and "off" in res]:
    print(f"- {mode} ÷ off: heavy throughput **{res[mode][1] / max(res['off'][1], 1e-9):.2f}×**; prefix-cache hit heavy **{res[mode][2] / max(res['off'][2], 1e-9):.3f}×**, light {res[mode][3] / max(res['off'][3], 1e-9):.3f}×")
PY
}

pooled() {  # scenario name: the light load's TTFT beside the heavy one, pooled over the repeats
  python3 - "$WORK" "$1" "$MODES" "$REPEATS" <<'PY'
import json, math, sys
work, name, modes, reps = sys.argv[1], sys.argv[2], sys.argv[3].split(), int(sys.argv[4])
def p99(v):
    v = sorted(v)
    return v[min(len(v), max(1, math.ceil(0.99 * len(v)))) - 1]
def runs(mode, part):
    return [json.load(open(f"{work}/{name}-{mode}-r{r}-{part}.json")) for r in range(1, reps + 1)]
print(f"\n### {name}: pooled over {reps} repeats (modes interleaved)\n")
print("| admission | light TTFT p99 alone, pooled | light TTFT p99 beside heavy, pooled | each repeat's p99 beside | heavy req/s, mean |")
print("|---|---|---|---|---|")
pool = {}
for mode in modes:
    alone = [t for j in runs(mode, "alone") for t in j["ttfts_ms"]]
    beside = runs(mode, "beside")
    pool[mode] = (p99(alone), p99([t for j in beside for t in j["ttfts_ms"]]), [j["ttft"]["p99_ms"] for j in beside])
    heavy = sum(j["requests_per_s"] for j in runs(mode, "heavy")) / reps
    print(f"| {mode} | {pool[mode][0]:.0f} ms | {pool[mode][1]:.0f} ms | {', '.join(f'{x:.0f}' for x in pool[mode][2])} | {heavy:.1f} |")
print()
for mode in modes:
    one = mode[:-3] if mode.endswith("-x2") else None
    if one in pool:
        each = [a / max(b, 1e-9) for a, b in zip(pool[mode][2], pool[one][2])]
        print(f"- {mode} ÷ {one}: light TTFT p99 beside heavy, pooled **{pool[mode][1] / max(pool[one][1], 1e-9):.2f}×**; each repeat {', '.join(f'{x:.2f}×' for x in each)}")
PY
}

flags="${SIM_FLAGS---serial-prefill}"
echo "admission bench: 3 replicas x 4 running (sim-backend ${flags:-with no flags: prefill side by side}), light 4x6 turns at 2, heavy 60x$HEAVY_TURNS turns at 60"
# SCENARIOS: which to run (tenants, classes; both by default)
for s in ${SCENARIOS:-tenants classes}; do
  case "$s" in
    tenants) scenario "tenants: quiet beside noisy" "$QUIET_KEY" "$NOISY_KEY" "" "" ;;
    classes) scenario "classes: interactive beside batch (one tenant)" "$QUIET_KEY" "$QUIET_KEY" \
      "x-agent-serve-priority:interactive" "x-agent-serve-priority:batch" ;;
  esac
done
