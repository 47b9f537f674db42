#!/usr/bin/env bash
# Gateway fleet benchmark (issue 10), the seed-002 shape at this machine's
# scale: 4 gateways in front of 3 simulated replicas, agent sessions whose
# turns are spread round-robin over the gateways (as an L4 balancer would),
# bounded-load first placement (the default) on every gateway:
#
#   one    one gateway (the reference)
#   local  4 gateways, each with its own bindings (affinity.store: local)
#   redis  4 gateways sharing bindings through a script-owned redis-server
#
# Replicas (prefix caches unbounded, so only placement decides hits) are
# restarted empty before each run. Prints the bench
# table (prefix-cache hit rate, latency) and the store operations per request.
#
#   scripts/bench-fleet.sh [sessions=200] [turns=6] [concurrency=32]
#   BIN=target/debug/agent-gateway scripts/bench-fleet.sh   # skip the release build
#   GATEWAYS=3 scripts/bench-fleet.sh 64 8 16                # the fleet's size (default 4)
#   KEYLESS=1 scripts/bench-fleet.sh 64 8 16                 # clients send no session id
#
# Everything listens on 127.0.0.1 and is stopped (by PID) when the script exits.
set -euo pipefail
cd "$(dirname "$0")/.."
SESSIONS="${1:-200}"
GATEWAYS="${GATEWAYS:-4}"
CLIENT_FLAGS=()
[ "${KEYLESS:-0}" = 1 ] && CLIENT_FLAGS+=(--keyless)
TURNS="${2:-6}"
CONC="${3:-32}"
if [ -z "${BIN:-}" ]; then
  cargo build --release --quiet
  BIN=target/release/agent-gateway
fi
command -v redis-server >/dev/null || scripts/setup.sh
WORK=$(mktemp -d)
PIDS=()
SIMS=()
cleanup() { for p in "${PIDS[@]}" "${SIMS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

. scripts/lib/ports.sh

REDIS_PORT=$(port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no >/dev/null &
PIDS+=($!)
wait_port "$REDIS_PORT"

SIM_PORTS=($(port) $(port) $(port))
SIM_COST=()   # extra sim-backend flags (the latency probe: no compute time)
start_sims() {
  for p in "${SIMS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${SIMS[@]}"; do wait "$p" 2>/dev/null || true; done
  SIMS=()
  for i in 0 1 2; do
    "$BIN" sim-backend --listen "127.0.0.1:${SIM_PORTS[$i]}" --id "vllm-$i" --max-batch 64 --cache-blocks 0 "${SIM_COST[@]}" >/dev/null &
    SIMS+=($!)
  done
  for i in 0 1 2; do wait_port "${SIM_PORTS[$i]}"; done
}

# gateway NAME STORE_KIND: starts one gateway, prints its port.
gateway() {
  local name=$1 kind=$2 gp mp ap
  gp=$(port); mp=$(port); ap=$(port)
  cat > "$WORK/$name.yaml" <<YAML
server:
  listen: ["127.0.0.1:$gp"]
  threads: 1
  pid_file: "$WORK/$name.pid"
  upgrade_sock: "$WORK/$name.sock"
tiers:
  default:
    default: true
    backends:
      - { id: vllm-0, addr: "127.0.0.1:${SIM_PORTS[0]}" }
      - { id: vllm-1, addr: "127.0.0.1:${SIM_PORTS[1]}" }
      - { id: vllm-2, addr: "127.0.0.1:${SIM_PORTS[2]}" }
affinity:
  hash_key: "2ebc3143e569f93133b6474c7610fd89ca5e1258917902a89e47b91a2c567d83"
  store: { kind: $kind, url: "redis://127.0.0.1:$REDIS_PORT", key_prefix: "$PREFIX" }
health: { interval_ms: 500 }
metrics: { listen: "127.0.0.1:$mp" }
admin: { listen: "127.0.0.1:$ap" }
YAML
  RUST_LOG=error "$BIN" run --config "$WORK/$name.yaml" >/dev/null 2>&1 &
  PIDS+=($!)
  wait_port "$gp"
  echo "$gp $mp $!"
}

# Sum of a metric family over the gateways' metrics ports.
metric_sum() {
  local name=$1; shift
  local total=0 v
  for mp in "$@"; do
    v=$(curl -s "http://127.0.0.1:$mp/metrics" | awk -v n="$name" 'index($0, n"{")==1 {s+=$NF} END {print s+0}')
    total=$(python3 -c "print($total + $v)")
  done
  echo "$total"
}

start_fleet() {  # label, store kind, number of gateways: sets URLS, MPORTS, GPIDS
  local label=$1 kind=$2 n=$3 line
  URLS=""; MPORTS=(); GPIDS=()
  PREFIX="bench-$label-$RANDOM:"   # one keyspace per run, shared by its gateways
  start_sims
  for i in $(seq 1 "$n"); do
    line=$(gateway "$label-$i" "$kind")
    set -- $line
    URLS="${URLS:+$URLS,}http://127.0.0.1:$1"
    MPORTS+=("$2")
    GPIDS+=("$3")
    PIDS+=("$3")
  done
}

stop_fleet() { for p in "${GPIDS[@]}"; do kill "$p" 2>/dev/null || true; done; }

per_request() {  # metric family: its sum over the gateways / their requests
  python3 -c "print(f'{$(metric_sum "$1" "${MPORTS[@]}") / max($(metric_sum agentserve_requests_total "${MPORTS[@]}"), 1):.3f}')"
}

run() {  # label, store kind, number of gateways
  local label=$1 kind=$2 n=$3
  start_fleet "$label" "$kind" "$n"
  "$BIN" bench --url "$URLS" --sessions "$SESSIONS" --turns "$TURNS" -c "$CONC" \
    --context-bytes 8000 "${CLIENT_FLAGS[@]}" --label "$label ($n gateway$([ "$n" = 1 ] || echo s), store $kind)" | grep -F "| $label ("
  local lat_sum lat_n
  lat_sum=$(metric_sum agentserve_store_latency_seconds_sum "${MPORTS[@]}")
  lat_n=$(metric_sum agentserve_store_latency_seconds_count "${MPORTS[@]}")
  echo "STORE $label $(per_request agentserve_store_ops_total) store operations per request; mean store round trip $(python3 -c "print(f'{1000 * $lat_sum / max($lat_n, 1):.2f}')") ms" >&2
  stop_fleet
}

echo "fleet bench: $SESSIONS sessions × $TURNS turns, concurrency $CONC, 3 replicas, turns round-robin over the gateways${CLIENT_FLAGS[*]:+, clients send no session id}"
echo
echo "| run | requests | errors | affinity hit | same backend as last turn | prefix-cache hit | TTFT p50 | TTFT p99 | E2E p50 | E2E p99 | req/s | balance |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
run one local 1
run local local "$GATEWAYS"
run redis redis "$GATEWAYS"

# Latency probe: what asking Redis adds to a request. Replicas without
# compute time, one request at a time, so the E2E latency is the gateway's
# path; the gateway's own verdict splits requests: a miss (first turn) writes
# its binding create-if-absent (one Redis round trip), a hit at steady state
# asks nothing (other gateways learned the binding from the channel).
SIM_COST=(--prefill-us-per-token 0 --decode-us-per-token 0)
PROBE_SESSIONS=$(( SESSIONS < 300 ? SESSIONS : 300 ))
echo
echo "latency probe: $PROBE_SESSIONS sessions × 4 turns, one at a time, replicas without compute time (E2E, ms)"
echo
echo "| run | hits p50 | hits p99 | misses p50 | misses p99 | store ops / request |"
echo "|---|---:|---:|---:|---:|---:|"
for spec in "one local 1" "redis redis $GATEWAYS"; do
  set -- $spec
  start_fleet "probe-$1" "$2" "$3"
  "$BIN" bench --url "$URLS" --sessions "$PROBE_SESSIONS" --turns 4 -c 1 --context-bytes 2000 "${CLIENT_FLAGS[@]}" \
    --label "$1" --json > "$WORK/probe.json"
  python3 - "$WORK/probe.json" "$1 ($3 gateway$([ "$3" = 1 ] || echo s), store $2)" "$(per_request agentserve_store_ops_total)" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
h, m = r["e2e_hit"], r["e2e_miss"]
print(f"| {sys.argv[2]} | {h['p50_ms']:.2f} | {h['p99_ms']:.2f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | {sys.argv[3]} |")
PY
  stop_fleet
done
