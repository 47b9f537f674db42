#!/usr/bin/env bash
# Engines' KV events on against off (issue 47), under eviction pressure: REPLICAS
# simulated replicas that publish their KV-cache events as vLLM does, each cache
# CACHE_BLOCKS blocks of 16 tokens, so that the conversations' working set is
# 2-3x the fleet's cache; SESSIONS keyless agent conversations (distinct
# contexts) of TURNS turns at concurrency C, through one gateway in soft mode
# (MODE=hard for the default). "off": the gateway infers each replica's cache
# (prefix index, corrected by the cached tokens answers report); "on": each
# backend's `kv_events` is followed. Same replicas' settings, same workload, a
# fresh fleet per run. Prints, per run: turns whose cached share the gateway
# predicted more than 0.1 off what the engine then reported, prompt tokens
# cached, TTFT p50/p99.
#
#   scripts/bench-kv-events.sh
#   REPLICAS=4 SESSIONS=48 CACHE_BLOCKS=600 REPEATS=2 scripts/bench-kv-events.sh
#
# Everything listens on 127.0.0.1 and is stopped (by PID) when the script exits.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --profile demo --quiet
  BIN=target/demo/agent-gateway
fi
REPLICAS="${REPLICAS:-4}"
SESSIONS="${SESSIONS:-48}"
TURNS="${TURNS:-6}"
C="${C:-8}"
CACHE_BLOCKS="${CACHE_BLOCKS:-600}"
CONTEXT_BYTES="${CONTEXT_BYTES:-6000}"
MODE="${MODE:-soft}"
REPEATS="${REPEATS:-1}"
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

. scripts/lib/ports.sh

run() {  # events (on|off), repeat: prints one JSON line
  local events=$1 rep=$2 gp ap mp backends="" sims=()
  for i in $(seq 0 $((REPLICAS - 1))); do
    local sp; sp=$(port)
    "$BIN" sim-backend --listen "127.0.0.1:$sp" --id "sim-$i" --block-size 16 \
      --cache-blocks "$CACHE_BLOCKS" --prefill-us-per-token 100 --decode-us-per-token 2000 \
      --max-batch 8 --kv-events 127.0.0.1:0 > "$WORK/sim-$i.out" &
    sims+=($!); PIDS+=($!)
    for _ in $(seq 1 200); do [ "$(wc -l < "$WORK/sim-$i.out")" -ge 2 ] && break; sleep 0.05; done
    local ev rp
    ev=$(sed -n 's/^kv events on \(.*\) replay .*/\1/p' "$WORK/sim-$i.out")
    rp=$(sed -n 's/^kv events on .* replay \(.*\)/\1/p' "$WORK/sim-$i.out")
    local kv=""
    [ "$events" = on ] && kv=", kv_events: { endpoint: \"$ev\", replay: \"$rp\" }"
    backends+="      - { id: sim-$i, addr: \"127.0.0.1:$sp\"$kv }"$'\n'
  done
  gp=$(port); ap=$(port); mp=$(port)
  cat > "$WORK/gw.yaml" <<YAML
server:
  listen: ["127.0.0.1:$gp"]
  pid_file: "$WORK/gw.pid"
  upgrade_sock: "$WORK/gw.sock"
tiers:
  default:
    default: true
    backends:
$backends
affinity: { hash_key: "kv-bench", mode: $MODE }
health: { interval_ms: 500 }
metrics: { listen: "127.0.0.1:$mp" }
admin: { listen: "127.0.0.1:$ap" }
YAML
  RUST_LOG=error "$BIN" run --config "$WORK/gw.yaml" >/dev/null 2>&1 &
  local gw=$!; PIDS+=($gw)
  wait_port "$gp"
  if [ "$events" = on ]; then  # every replica's events followed before the run
    for _ in $(seq 1 200); do
      curl -s "http://127.0.0.1:$ap/admin/backends" | python3 -c 'import json,sys; b=json.load(sys.stdin)["backends"]; sys.exit(0 if all(x["kv_events"]["exact"] for x in b) else 1)' && break
      sleep 0.05
    done
  fi
  "$BIN" bench --url "http://127.0.0.1:$gp" --keyless --sessions "$SESSIONS" --turns "$TURNS" -c "$C" \
    --system-prompt-bytes 2000 --context-bytes "$CONTEXT_BYTES" --max-tokens 16 --json > "$WORK/report.json"
  curl -s "http://127.0.0.1:$mp/metrics" > "$WORK/metrics.txt"
  python3 - "$events" "$rep" "$WORK/report.json" "$WORK/metrics.txt" <<'PY'
import json, sys, re
events, rep, report, metrics = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3])), open(sys.argv[4]).read()
pred = {}
for m in re.finditer(r'agentserve_kv_predictions_total\{outcome="(\w+)",source="(\w+)",tier="default"\} (\S+)', metrics):
    pred[(m.group(2), m.group(1))] = float(m.group(3))
right = sum(v for (s, o), v in pred.items() if o == "right")
wrong = sum(v for (s, o), v in pred.items() if o == "wrong")
print(json.dumps({"events": events, "rep": int(rep), "right": right, "wrong": wrong,
                  "from_events": pred.get(("events", "right"), 0) + pred.get(("events", "wrong"), 0),
                  "errors": report["errors"], "requests": report["requests"],
                  "hit": report["prefix_cache_hit_rate"], "ttft_p50": report["ttft"]["p50_ms"],
                  "ttft_p99": report["ttft"]["p99_ms"]}))
PY
  kill "$gw" "${sims[@]}" 2>/dev/null || true
  wait "$gw" "${sims[@]}" 2>/dev/null || true
}

echo "kv-events bench: $REPLICAS replicas x $CACHE_BLOCKS blocks of 16 tokens, $SESSIONS keyless conversations x $TURNS turns, c=$C, affinity $MODE"
for rep in $(seq 1 "$REPEATS"); do for ev in off on; do run "$ev" "$rep"; done; done > "$WORK/results"
python3 - "$WORK/results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("\n| events | run | turns mispredicted (>0.1 off) | of them from events | prompt tokens cached | TTFT p50 ms | TTFT p99 ms | errors |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    n = r["right"] + r["wrong"]
    print(f"| {r['events']} | {r['rep']} | {r['wrong']:.0f} of {n:.0f} ({r['wrong'] / max(n, 1):.1%}) | {r['from_events']:.0f} | {r['hit']:.3f} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['errors']} |")
off = [r for r in rows if r["events"] == "off"]; on = [r for r in rows if r["events"] == "on"]
if off and on:
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
    print(f"\non / off: mispredicted {mean(on, 'wrong') / max(mean(off, 'wrong'), 1):.2f}x, cached {mean(on, 'hit') / max(mean(off, 'hit'), 1e-9):.3f}x, TTFT p99 {mean(on, 'ttft_p99') / max(mean(off, 'ttft_p99'), 1e-9):.2f}x")
PY
