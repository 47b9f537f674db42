#!/usr/bin/env bash
# Proxy-overhead benchmark (issue 11): the same chat requests sent, in one run,
#
#   direct         straight to a simulated replica (zero model latency)
#   bare-pingora   through `examples/bare_proxy.rs`: a ProxyHttp that only
#                  returns the peer, built from this crate's Pingora and profile
#   agent-gateway  through the gateway (affinity, metrics, guards: all on)
#   nginx          `hash $http_x_session_id consistent` + upstream keepalive
#                  (installed when missing and the package registry answers)
#
# with wrk, for each worker-thread count and each concurrency, in several
# alternating rounds. For every proxy it reads the process's own CPU time
# (utime+stime from /proc, all threads; nginx: master and workers) and counts
# its system calls (perf's raw_syscalls:sys_enter tracepoint, when perf can),
# each divided by the requests served. Prints one table per (threads, c) with
# the median and the spread (min–max) over rounds, and CPU ratios to the
# bare-Pingora floor and to nginx.
#
#   scripts/bench-proxy.sh [seconds=5] [rounds=3] [connections="16 64"] [threads="1 2"]
#   BIN=target/release/agent-gateway BARE=target/release/examples/bare_proxy scripts/bench-proxy.sh
#   BIN_BEFORE=/path/to/older/agent-gateway scripts/bench-proxy.sh   # adds its row: before/after in one run
#   BACKENDS=8 scripts/bench-proxy.sh   # the gateway and nginx in front of 8 replicas (bare Pingora: the first)
#
# Everything listens on 127.0.0.1 and is stopped (by PID) when the script exits.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR="${1:-5}"
ROUNDS="${2:-3}"
CONNS="${3:-16 64}"
THREADS="${4:-1 2}"
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
if [ -z "${BIN:-}" ]; then
  cargo build --release --quiet --bin agent-gateway --example bare_proxy
  BIN=target/release/agent-gateway
fi
BARE="${BARE:-target/release/examples/bare_proxy}"
WORK=$(mktemp -d)
PIDS=()
# SIGINT: Pingora's fast shutdown (SIGTERM waits out a grace period).
cleanup() { for p in "${PIDS[@]}"; do kill -INT "$p" 2>/dev/null || true; done; declare -F stop_sims >/dev/null && stop_sims; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

. scripts/proxy-load.sh

HAVE_PERF=0
perf stat -e raw_syscalls:sys_enter -- true >/dev/null 2>&1 && HAVE_PERF=1
HAVE_NGINX=0
if command -v nginx >/dev/null || { apt-get install -y -qq nginx >/dev/null 2>&1 && command -v nginx >/dev/null; }; then
  HAVE_NGINX=1
fi

start_sim
write_load

# start_proxies THREADS: sets PORT_<path> and PROC_<path> (PIDs whose CPU counts).
start_proxies() {
  local t=$1 gp
  gp=$(port)
  gateway_config "$gp" gw "$t"
  RUST_LOG=error "$BIN" run --config "$WORK/gw.yaml" >/dev/null 2>&1 &
  PROC_gateway=$!; PIDS+=($!); PORT_gateway=$gp
  if [ -n "${BIN_BEFORE:-}" ]; then
    PORT_before=$(port)
    gateway_config "$PORT_before" before "$t"
    RUST_LOG=error "$BIN_BEFORE" run --config "$WORK/before.yaml" >/dev/null 2>&1 &
    PROC_before=$!; PIDS+=($!)
    wait_port "$PORT_before"
  fi
  PORT_bare=$(port)
  RUST_LOG=error "$BARE" "127.0.0.1:$PORT_bare" "127.0.0.1:$SIM_PORT" "$t" >/dev/null 2>&1 &
  PROC_bare=$!; PIDS+=($!)
  wait_port "$PORT_gateway"; wait_port "$PORT_bare"
  if [ "$HAVE_NGINX" = 1 ]; then
    PORT_nginx=$(port)
    mkdir -p "$WORK/nginx"
    cat > "$WORK/nginx.conf" <<NGX
worker_processes $t;
pid $WORK/nginx.pid;
error_log $WORK/nginx/error.log error;
daemon off;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx;
  proxy_temp_path $WORK/nginx;
  upstream llm { hash \$http_x_session_id consistent; $(for p in "${SIM_PORTS[@]}"; do printf "server 127.0.0.1:%s; " "$p"; done)keepalive 64; }
  server {
    listen 127.0.0.1:$PORT_nginx;
    location / { proxy_pass http://llm; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; }
  }
}
NGX
    nginx -c "$WORK/nginx.conf" &
    PROC_nginx=$!; PIDS+=($!)
    wait_port "$PORT_nginx"
  fi
}

stop_proxies() {
  for p in $PROC_gateway $PROC_bare ${PROC_nginx:-} ${PROC_before:-}; do kill -INT "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
  PROC_nginx=""; PROC_before=""
}

# The process and its children (nginx's workers), comma-separated.
family() { local kids; kids=$(pgrep -P "$1" | paste -sd, -); echo "$1${kids:+,$kids}"; }
# Clock ticks of CPU (user + system) used so far by the PIDs in $1.
ticks() { local t=0 p; for p in ${1//,/ }; do t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0))); done; echo "$t"; }
to_ms() { awk -v v="$1" 'BEGIN { if (v ~ /us$/) { sub(/us/,"",v); print v/1000 } else if (v ~ /ms$/) { sub(/ms/,"",v); print v } else { sub(/s/,"",v); print v*1000 } }'; }

HZ=$(getconf CLK_TCK)
# measure THREADS CONNS ROUND PATH PORT [PID]: appends one line to results.
measure() {
  local t=$1 c=$2 r=$3 path=$4 p=$5 pid=${6:-} pids="" t0=0 t1=0 perfpid=""
  if [ -n "$pid" ]; then
    pids=$(family "$pid")
    t0=$(ticks "$pids")
    if [ "$HAVE_PERF" = 1 ]; then
      perf stat -x, -e raw_syscalls:sys_enter -p "$pids" -o "$WORK/perf.txt" -- sleep "$DUR" &
      perfpid=$!
    fi
  fi
  wrk -t1 -c"$c" -d"${DUR}s" --latency -s "$WORK/req.lua" "http://127.0.0.1:$p/v1/chat/completions" > "$WORK/wrk.txt"
  [ -n "$perfpid" ] && wait "$perfpid" 2>/dev/null || true
  [ -n "$pid" ] && t1=$(ticks "$pids")
  local n rps p50 p99 cpu sc
  n=$(awk '/requests in/ {print $1}' "$WORK/wrk.txt")
  rps=$(awk '/Requests\/sec/ {print $2}' "$WORK/wrk.txt")
  p50=$(to_ms "$(awk '$1=="50%" {print $2}' "$WORK/wrk.txt")")
  p99=$(to_ms "$(awk '$1=="99%" {print $2}' "$WORK/wrk.txt")")
  cpu=-; sc=-
  if [ -n "$pid" ]; then
    cpu=$(python3 -c "print(($t1 - $t0) * 1e6 / $HZ / max($n, 1))")
    if [ -n "$perfpid" ]; then
      sc=$(awk -F, '/raw_syscalls/ {print $1}' "$WORK/perf.txt")
      sc=$(python3 -c "print(${sc:-0} / max($n, 1))")
    fi
  fi
  echo "$t $c $r $path $rps $p50 $p99 $cpu $sc" >> "$WORK/results"
}

: > "$WORK/results"
for t in $THREADS; do
  start_proxies "$t"
  # Warm up every path's connections.
  for p in $PORT_gateway $PORT_bare ${PORT_nginx:-} ${PORT_before:-}; do
    wrk -t1 -c64 -d1s -s "$WORK/req.lua" "http://127.0.0.1:$p/v1/chat/completions" >/dev/null
  done
  for c in $CONNS; do
    for r in $(seq 1 "$ROUNDS"); do
      measure "$t" "$c" "$r" direct "$SIM_PORT"
      measure "$t" "$c" "$r" bare-pingora "$PORT_bare" "$PROC_bare"
      measure "$t" "$c" "$r" agent-gateway "$PORT_gateway" "$PROC_gateway"
      [ -n "${BIN_BEFORE:-}" ] && measure "$t" "$c" "$r" agent-gateway-before "$PORT_before" "$PROC_before"
      [ "$HAVE_NGINX" = 1 ] && measure "$t" "$c" "$r" nginx "$PORT_nginx" "$PROC_nginx"
    done
  done
  stop_proxies
done

echo
echo "wrk -t1, ${DUR}s per round, $ROUNDS alternating rounds, POST /v1/chat/completions, 500 sessions;"
echo "backend: sim-backend with zero model latency; $(nproc) cores shared by wrk, the proxy and the backend."
echo "Each cell: median (min–max over rounds). CPU: the proxy process's own, per request."
[ "$HAVE_PERF" = 1 ] || echo "(perf cannot count syscalls here: syscalls/request left out)"
[ "$HAVE_NGINX" = 1 ] || echo "(nginx is not installed: its rows left out)"
python3 - "$WORK/results" <<'PY'
import sys, statistics
from collections import defaultdict
rows = defaultdict(list)
for line in open(sys.argv[1]):
    t, c, r, path, rps, p50, p99, cpu, sc = line.split()
    num = lambda v: None if v == "-" else float(v)
    rows[(int(t), int(c), path)].append((float(rps), float(p50), float(p99), num(cpu), num(sc)))
def cell(vals, fmt):
    vals = [v for v in vals if v is not None]
    if not vals:
        return "–"
    return f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}–{fmt.format(max(vals))})"
def med(key, i):
    vals = [m[i] for m in rows.get(key, []) if m[i] is not None]
    return statistics.median(vals) if vals else None
for (t, c) in sorted({(k[0], k[1]) for k in rows}):
    print(f"\n**{t} worker thread{'s' if t > 1 else ''}, c={c}**\n")
    print("| path | requests/s | p50 ms | p99 ms | CPU µs / request | syscalls / request | CPU × bare Pingora | CPU × nginx |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    bare, ngx = med((t, c, "bare-pingora"), 3), med((t, c, "nginx"), 3)
    for path in ["direct", "bare-pingora", "agent-gateway", "agent-gateway-before", "nginx"]:
        m = rows.get((t, c, path))
        if not m:
            continue
        cpu = med((t, c, path), 3)
        ratio = lambda base: f"{cpu / base:.2f}×" if cpu and base else "–"
        print(f"| {path} | {cell([x[0] for x in m], '{:.0f}')} | {cell([x[1] for x in m], '{:.3f}')} | "
              f"{cell([x[2] for x in m], '{:.3f}')} | {cell([x[3] for x in m], '{:.1f}')} | "
              f"{cell([x[4] for x in m], '{:.2f}')} | {ratio(bare)} | {ratio(ngx)} |")
PY
