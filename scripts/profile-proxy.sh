#!/usr/bin/env bash
# Instructions per proxied request, counted by valgrind's callgrind, for the
# bare Pingora pass-through (examples/bare_proxy.rs) and agent-gateway under the
# same wrk load as scripts/bench-proxy.sh. Unlike CPU time, instruction counts
# hardly move with the machine's load (the same build gave figures within 0.5%
# of each other in three runs), so a change of 1% shows. User space only (the
# kernel's share of a request, about two thirds of the floor, is not counted).
#
#   scripts/profile-proxy.sh [seconds=15] [connections=16]
#   BIN=… BARE=… scripts/profile-proxy.sh        # prebuilt binaries
#   BIN_BEFORE=/older/agent-gateway scripts/profile-proxy.sh   # adds its row
#   KEEP=dir scripts/profile-proxy.sh            # keep callgrind.out.* for callgrind_annotate
#   BACKENDS=8 scripts/profile-proxy.sh          # the gateway in front of 8 replicas (bare Pingora: the first)
#   ADMISSION=1 scripts/profile-proxy.sh         # adds a row: admission and client keys on, unsaturated
#   KV_EVENTS=1 scripts/profile-proxy.sh         # adds a row: each replica's KV-cache events followed
#   TELEMETRY=1 scripts/profile-proxy.sh         # adds a row: OpenTelemetry spans for every request
#                                                # (sample_ratio 1.0), exported to a local OTLP receiver
#
# Prints instructions per request for each proxy, the ratio to the bare floor,
# and the instructions inside each of the gateway's hooks, per request.
# Everything listens on 127.0.0.1 and is stopped (by PID) when the script exits.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR="${1:-15}"
CONN="${2:-16}"
command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
if [ -z "${BIN:-}" ]; then
  cargo build --release --quiet --bin agent-gateway --example bare_proxy
  BIN=target/release/agent-gateway
fi
BARE="${BARE:-target/release/examples/bare_proxy}"
WORK=$(mktemp -d)
OUT="${KEEP:-$WORK}"
mkdir -p "$OUT"
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done; declare -F stop_sims >/dev/null && stop_sims; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

. scripts/proxy-load.sh
start_sim
write_load

# profile NAME PORT CMD...: runs CMD under callgrind, uninstrumented until warmed
# up; counts instructions over one wrk run; appends "NAME instructions requests".
profile() {
  local name=$1 p=$2; shift 2
  RUST_LOG=error valgrind --tool=callgrind --instr-atstart=no \
    --callgrind-out-file="$OUT/callgrind.out.$name" "$@" >/dev/null 2>"$WORK/$name.vg" &
  local pid=$!
  PIDS+=("$pid")
  wait_port "$p"
  wrk -t1 -c"$CONN" -d3s -s "$WORK/req.lua" "http://127.0.0.1:$p/v1/chat/completions" >/dev/null
  callgrind_control -i on "$pid" >/dev/null 2>&1
  wrk -t1 -c"$CONN" -d"${DUR}s" -s "$WORK/req.lua" "http://127.0.0.1:$p/v1/chat/completions" > "$WORK/wrk.txt"
  callgrind_control -i off "$pid" >/dev/null 2>&1
  kill -INT "$pid"; wait "$pid" 2>/dev/null || true
  local n ir
  n=$(awk '/requests in/ {print $1}' "$WORK/wrk.txt")
  ir=$(awk '/^totals:/ {s += $2} END {print s}' "$OUT/callgrind.out.$name")
  echo "$name $ir $n" >> "$WORK/results"
}

: > "$WORK/results"
BP=$(port)
profile bare-pingora "$BP" "$BARE" "127.0.0.1:$BP" "127.0.0.1:$SIM_PORT" 1
GP=$(port); gateway_config "$GP" gateway 1
profile agent-gateway "$GP" "$BIN" run --config "$WORK/gateway.yaml"
if [ -n "${ADMISSION:-}" ]; then
  # Every request presents a known key (tenant, limits looked at) and takes
  # a slot (never waits: the limit is far above the load).
  AP=$(port); gateway_config "$AP" admission 1
  printf 'keys:\n  - { key_sha256: %s, tenant: profile, max_in_flight: 100000 }\n' \
    "$(printf %s sk-profile-tenant | "$BIN" hash-key)" > "$WORK/keys.yaml"
  printf 'admission: { enabled: true, max_in_flight: 100000 }\nauth: { keys_file: "%s" }\n' \
    "$WORK/keys.yaml" >> "$WORK/admission.yaml"
  profile agent-gateway-admission "$AP" "$BIN" run --config "$WORK/admission.yaml"
fi
if [ -n "${KV_EVENTS:-}" ]; then
  # The same gateway following every replica's events (sessions named
  # upstream, holdings read for each request's candidates).
  KP=$(port); gateway_config "$KP" gateway-kv 1
  profile agent-gateway-kv-events "$KP" "$BIN" run --config "$WORK/gateway-kv.yaml"
fi
if [ -n "${TELEMETRY:-}" ]; then
  # Every request is sampled; its span is built, queued, batched, encoded
  # and posted (the export runs in the gateway's process: counted too).
  PY=$(scripts/engine/setup.sh)
  RP=$(port)
  "$PY" scripts/otlp-receiver.py "$RP" --count-only &
  PIDS+=("$!")
  wait_port "$RP"
  TP=$(port); gateway_config "$TP" telemetry 1
  printf 'telemetry: { otlp: { endpoint: "http://127.0.0.1:%s" }, sample_ratio: 1.0 }\n' "$RP" >> "$WORK/telemetry.yaml"
  profile agent-gateway-telemetry "$TP" "$BIN" run --config "$WORK/telemetry.yaml"
  echo "spans received by the OTLP receiver: $(curl -s "http://127.0.0.1:$RP/count")" >&2
fi
if [ -n "${BIN_BEFORE:-}" ]; then
  OP=$(port); gateway_config "$OP" before 1
  profile agent-gateway-before "$OP" "$BIN_BEFORE" run --config "$WORK/before.yaml"
fi

echo
echo "callgrind, wrk -t1 -c$CONN for ${DUR}s, 1 worker thread; user-space instructions per request"
python3 - "$WORK/results" <<'PY'
import sys
rows = [l.split() for l in open(sys.argv[1])]
base = next(int(ir) / int(n) for name, ir, n in rows if name == "bare-pingora")
print("| path | requests | instructions / request | × bare Pingora |")
print("|---|---:|---:|---:|")
for name, ir, n in rows:
    per = int(ir) / int(n)
    print(f"| {name} | {n} | {per:,.0f} | {per / base:.3f}× |")
PY
# Where the gateway's extra instructions go: its Pingora hooks, inclusive of
# what they call (Pingora's header inserts included), per request.
echo
echo "agent-gateway, per request: instructions inside each hook (inclusive)"
n=$(awk '$1 == "agent-gateway" {print $3}' "$WORK/results")
callgrind_annotate --inclusive=yes --threshold=100 --auto=no "$OUT/callgrind.out.agent-gateway" 2>/dev/null \
  | python3 -c '
import re, sys
n = float(sys.argv[1])
want = [
    ("request_filter", r"ProxyHttp>::request_filter::\{\{closure\}\}( \[|$)"),
    ("upstream_peer", r"ProxyHttp>::upstream_peer::\{\{closure\}\}( \[|$)"),
    ("response_filter", r"ProxyHttp>::response_filter::\{\{closure\}\}( \[|$)"),
    ("response_body_filter", r"ProxyHttp>::response_body_filter( \[|$)"),
    ("logging", r"ProxyHttp>::logging::\{\{closure\}\}( \[|$)"),
    ("Pingora timers (upstream read and idle timeouts)", r"TimerManager::register_timer( \[|$)"),
    ("connection guard read (with the read)", r"GuardedStream as tokio::io::async_read::AsyncRead>::poll_read( \[|$)"),
]
lines = sys.stdin.read().splitlines()
print("| hook | instructions / request |")
print("|---|---:|")
for label, pat in want:
    # The hook itself is its heaviest entry (inlined parts appear under other files).
    found = [int(re.match(r"\s*([\d,]+)", l).group(1).replace(",", "")) for l in lines if re.search(pat, l)]
    if found:
        print(f"| {label} | {max(found) / n:,.0f} |")
' "$n"
