#!/usr/bin/env bash
# Learned admission in front of an honest engine (issues 49, 61): one simulated
# replica that runs 40 requests side by side (--max-batch 40), each a
# one-second answer (16 tokens at 62.5 ms), behind one gateway, in each of the
# shapes clients send (SHAPES): `json` without max_tokens (the OpenAI SDKs'
# default: the engine decides the length, here the simulator's 16 tokens),
# `json-max` with max_tokens 16, `stream`, `stream-max`, and `mix` (the four
# in turn). Rounds of
# 40 parallel requests, each round after the one before has ended; the time
# of each round, with admission off (the baseline) and learned (admission on
# and nothing else), on an engine whose gauges tell the truth and on three
# whose gauges lie (always 0 running; always 100,000 waiting; always 1
# running and 10 waiting, which says the gateway's own requests queue inside
# it: only what the engine completes tells otherwise). Replica and
# gateway are started afresh for each mode, so round 1 includes the
# gateway's start.
#
#   scripts/bench-honest.sh
#   BIN=target/debug/agent-gateway ROUNDS=8 SHAPES="json mix" scripts/bench-honest.sh
#
# Everything listens on 127.0.0.1 and is stopped (by PID) when the script exits.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${BIN:-}" ]; then
  cargo build --profile demo --quiet
  BIN=target/demo/agent-gateway
fi
ROUNDS="${ROUNDS:-6}"
PARALLEL="${PARALLEL:-40}"
MODES="${MODES:-off learned lie-idle lie-busy lie-both}"
SHAPES="${SHAPES:-json json-max stream stream-max mix}"
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

. scripts/lib/ports.sh

run_mode() {  # mode shape: prints one JSON line {mode, shape, rounds: [s...]}
  local mode=$1 shape=$2 sp gp ap mp section="" faults=""
  sp=$(port); gp=$(port); ap=$(port); mp=$(port)
  "$BIN" sim-backend --listen "127.0.0.1:$sp" --id vllm-0 --max-batch "$PARALLEL" \
    --prefill-us-per-token 0 --decode-us-per-token 62500 >/dev/null &
  local sim=$!; PIDS+=($sim)
  case "$mode" in
    off) ;;
    learned) section="admission: { enabled: true, max_wait_ms: 120000 }" ;;
    lie-idle) section="admission: { enabled: true, max_wait_ms: 120000 }"; faults='{"gauge_running": 0}' ;;
    lie-busy) section="admission: { enabled: true, max_wait_ms: 120000 }"; faults='{"gauge_waiting": 100000}' ;;
    lie-both) section="admission: { enabled: true, max_wait_ms: 120000 }"; faults='{"gauge_running": 1, "gauge_waiting": 10}' ;;
  esac
  wait_port "$sp"
  [ -n "$faults" ] && curl -s -X POST "http://127.0.0.1:$sp/sim/config" -d "$faults" >/dev/null
  cat > "$WORK/gw.yaml" <<YAML
server:
  listen: ["127.0.0.1:$gp"]
  pid_file: "$WORK/gw.pid"
  upgrade_sock: "$WORK/gw.sock"
tiers:
  default:
    default: true
    backends:
      - { id: vllm-0, addr: "127.0.0.1:$sp" }
affinity: { hash_key: "8e34d4a94207fd1bd32d9e5b171738f5821444ff6a66f3a5a9836a311c474923" }
health: { interval_ms: 500 }
metrics: { listen: "127.0.0.1:$mp" }
admin: { listen: "127.0.0.1:$ap" }
$section
YAML
  RUST_LOG=error "$BIN" run --config "$WORK/gw.yaml" >/dev/null 2>&1 &
  local gw=$!; PIDS+=($gw)
  wait_port "$gp"
  python3 - "$mode" "$shape" "http://127.0.0.1:$gp" "$ROUNDS" "$PARALLEL" <<'PY'
import json, sys, time, threading, urllib.request
mode, shape, url, rounds, parallel = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
SHAPES = ["json", "json-max", "stream", "stream-max"]
def one(r, i, errors):
    kind = SHAPES[i % 4] if shape == "mix" else shape
    body = {"model": "qwen3-8b",
            "messages": [{"role": "user", "content": f"round {r} request {i}: a question of its own"}]}
    if kind.endswith("-max"):
        body["max_tokens"] = 16
    if kind.startswith("stream"):
        body["stream"] = True
    body = json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=300).read()
    except Exception as e:
        errors.append(str(e))
times, errors = [], []
for r in range(rounds):
    t = time.monotonic()
    ts = [threading.Thread(target=one, args=(r, i, errors)) for i in range(parallel)]
    for th in ts: th.start()
    for th in ts: th.join()
    times.append(time.monotonic() - t)
print(json.dumps({"mode": mode, "shape": shape, "rounds": times, "errors": len(errors)}))
PY
  curl -s "http://127.0.0.1:$ap/admin/admission" > "${ADMIN_DIR:-$WORK}/admin-$mode-$shape.json" || true
  kill "$gw" "$sim" 2>/dev/null || true
  wait "$gw" "$sim" 2>/dev/null || true
}

echo "honest-engine bench: 1 replica running $PARALLEL side by side, 1 s answers, $ROUNDS rounds of $PARALLEL"
for shape in $SHAPES; do for mode in $MODES; do run_mode "$mode" "$shape"; done; done > "$WORK/results"
python3 - "$WORK/results" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("\n| requests | admission | round times, s | worst round after the first ÷ off's mean | errors |")
print("|---|---|---|---|---|")
for r in rows:
    off = next((o for o in rows if o["mode"] == "off" and o["shape"] == r["shape"]), None)
    base = sum(off["rounds"][1:]) / max(len(off["rounds"]) - 1, 1) if off else None
    later = r["rounds"][1:]
    worst = max(later) / base if base and later else float("nan")
    print(f"| {r['shape']} | {r['mode']} | {' / '.join(f'{t:.2f}' for t in r['rounds'])} | **{worst:.2f}×** | {r['errors']} |")
PY
