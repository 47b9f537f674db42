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
#   ENGINE=vllm scripts/bench-kv-events.sh   # three real vLLM servers (CPU), started once:
#     VLLM_BLOCKS blocks of 32 tokens each (80); each run's conversations are its own text,
#     and the order of on and off alternates from one repeat to the next.
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
SYSTEM_BYTES="${SYSTEM_BYTES:-2000}"
MODE="${MODE:-soft}"
REPEATS="${REPEATS:-1}"
ENGINE="${ENGINE:-sim}"
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

. scripts/lib/ports.sh

VLLM=()  # (addr events replay) of each vLLM server, started once
if [ "$ENGINE" = vllm ]; then
  REPLICAS=3; SESSIONS="${SESSIONS_VLLM:-12}"; TURNS="${TURNS_VLLM:-5}"; C="${C_VLLM:-3}"
  CONTEXT_BYTES="${CONTEXT_BYTES_VLLM:-1200}"; SYSTEM_BYTES=800; VLLM_BLOCKS="${VLLM_BLOCKS:-80}"
  PY=$(scripts/engine/vllm-setup.sh)
  "$PY" scripts/engine/make_vllm_model.py --out "$WORK/model" >/dev/null 2>&1
  for i in 0 1 2; do
    hp=$(port); rp=$(port)
    # The longest prompt it takes is one block short of its whole cache (vLLM's rule).
    scripts/engine/vllm-serve.sh "$WORK/model" "$hp" "ipc://$WORK/kv-$i.sock" "$rp" "$VLLM_BLOCKS" 32 \
      $(((VLLM_BLOCKS - 1) * 32)) > "$WORK/vllm-$i.log" 2>&1 &
    PIDS+=($!)
    VLLM+=("127.0.0.1:$hp ipc://$WORK/kv-$i.sock tcp://127.0.0.1:$rp $!")
  done
  for v in "${VLLM[@]}"; do
    read -r addr _ _ pid <<< "$v"
    until curl -sf "http://$addr/health" >/dev/null; do
      kill -0 "$pid" 2>/dev/null || { echo "vLLM at $addr exited:" >&2; tail -5 "$WORK"/vllm-*.log >&2; exit 1; }
      sleep 0.5
    done
  done
fi

run() {  # events (on|off), repeat: prints one JSON line
  local events=$1 rep=$2 gp ap mp backends="" sims=()
  if [ "$ENGINE" = vllm ]; then
    for i in 0 1 2; do
      read -r addr ev rp _ <<< "${VLLM[$i]}"
      local kv=""
      [ "$events" = on ] && kv=", kv_events: { endpoint: \"$ev\", replay: \"$rp\" }"
      backends+="      - { id: vllm-$i, addr: \"$addr\"$kv }"$'\n'
    done
  fi
  for i in $(seq 0 $((REPLICAS - 1))); do
    [ "$ENGINE" = vllm ] && break
    local sp; sp=$(port)
    "$BIN" sim-backend --listen "127.0.0.1:$sp" --id "sim-$i" --block-size 16 \
      --cache-blocks "$CACHE_BLOCKS" --prefill-us-per-token 100 --decode-us-per-token 2000 \
      --max-batch 8 --kv-events 127.0.0.1:0 > "$WORK/sim-$i.out" 2> "$WORK/sim-$i.err" &
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
affinity: { hash_key: "06d222cdd8b8d48d7e9a9650be289e6879a8ea5af880fbb39236cba1ca66a41e", mode: $MODE }
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
  local model=qwen3-8b
  [ "$ENGINE" = vllm ] && model=tiny
  "$BIN" bench --url "http://127.0.0.1:$gp" --keyless --sessions "$SESSIONS" --turns "$TURNS" -c "$C" \
    --system-prompt-bytes "$SYSTEM_BYTES" --context-bytes "$CONTEXT_BYTES" --max-tokens 16 --model "$model" \
    --id-prefix "kv-$events-$rep" --json > "$WORK/report.json"
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
                  "mean_prompt": report["prompt_tokens"] / max(report["requests"], 1),
                  "hit": report["prefix_cache_hit_rate"], "ttft_p50": report["ttft"]["p50_ms"],
                  "ttft_p99": report["ttft"]["p99_ms"]}))
PY
  kill "$gw" ${sims[@]+"${sims[@]}"} 2>/dev/null || true
  wait "$gw" ${sims[@]+"${sims[@]}"} 2>/dev/null || true
}

if [ "$ENGINE" = vllm ]; then
  echo "kv-events bench: 3 vLLM servers x $VLLM_BLOCKS blocks of 32 tokens, $SESSIONS keyless conversations x $TURNS turns, c=$C, affinity $MODE"
else
  echo "kv-events bench: $REPLICAS replicas x $CACHE_BLOCKS blocks of 16 tokens, $SESSIONS keyless conversations x $TURNS turns, c=$C, affinity $MODE"
fi
for rep in $(seq 1 "$REPEATS"); do
  order="off on"; [ $((rep % 2)) = 0 ] && order="on off"
  for ev in $order; do run "$ev" "$rep"; done
done > "$WORK/results"
python3 - "$WORK/results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("\n| events | run | turns mispredicted (>0.1 off) | of them from events | prompt tokens cached | mean prompt, tokens | TTFT p50 ms | TTFT p99 ms | errors |")
print("|---|---|---|---|---|---|---|---|---|")
for r in rows:
    n = r["right"] + r["wrong"]
    print(f"| {r['events']} | {r['rep']} | {r['wrong']:.0f} of {n:.0f} ({r['wrong'] / max(n, 1):.1%}) | {r['from_events']:.0f} | {r['hit']:.3f} | {r['mean_prompt']:.0f} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['errors']} |")
off = [r for r in rows if r["events"] == "off"]; on = [r for r in rows if r["events"] == "on"]
if off and on:
    mean = lambda rs, k: sum(r[k] for r in rs) / len(rs)
    print(f"\non / off: mispredicted {mean(on, 'wrong') / max(mean(off, 'wrong'), 1):.2f}x, cached {mean(on, 'hit') / max(mean(off, 'hit'), 1e-9):.3f}x, TTFT p99 {mean(on, 'ttft_p99') / max(mean(off, 'ttft_p99'), 1e-9):.2f}x")
PY
