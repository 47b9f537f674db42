#!/usr/bin/env bash
# Proxy-overhead benchmark: the same chat requests sent (1) directly to a
# simulated replica, (2) through agent-gateway, (3) through nginx with
# `hash $http_x_session_id consistent` when nginx is installed — in one run, at
# fixed concurrency, with wrk. Prints a markdown table with ratios to direct.
#
#   scripts/bench-proxy.sh [duration_seconds=10] [connections=16]
#
# Everything listens on 127.0.0.1 and is stopped (by PID) when the script exits.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR="${1:-10}"
CONN="${2:-16}"
command -v wrk >/dev/null || { apt-get update -qq && apt-get install -y -qq wrk >/dev/null; }
cargo build --release --quiet
BIN=target/release/agent-gateway
WORK=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$WORK"; }
trap cleanup EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 1 300); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

SIM_PORT=$(port); GW_PORT=$(port); MET_PORT=$(port); ADM_PORT=$(port); NGX_PORT=$(port)
"$BIN" sim-backend --listen "127.0.0.1:$SIM_PORT" --id bench-0 --prefill-us-per-token 0 \
  --decode-us-per-token 0 --cache-blocks 0 --max-batch 1024 >/dev/null &
PIDS+=($!)
wait_port "$SIM_PORT"

cat > "$WORK/gw.yaml" <<YAML
server:
  listen: ["127.0.0.1:$GW_PORT"]
  threads: 1
  pid_file: "$WORK/gw.pid"
  upgrade_sock: "$WORK/gw.sock"
tiers:
  default:
    default: true
    backends: [{ id: bench-0, addr: "127.0.0.1:$SIM_PORT" }]
affinity: { hash_key: "bench-key" }
metrics: { listen: "127.0.0.1:$MET_PORT" }
admin: { listen: "127.0.0.1:$ADM_PORT" }
YAML
RUST_LOG=error "$BIN" run --config "$WORK/gw.yaml" >/dev/null 2>&1 &
PIDS+=($!)
wait_port "$GW_PORT"

HAVE_NGINX=0
if command -v nginx >/dev/null || { apt-get install -y -qq nginx >/dev/null 2>&1 && command -v nginx >/dev/null; }; then
  HAVE_NGINX=1
  mkdir -p "$WORK/nginx"
  cat > "$WORK/nginx.conf" <<NGX
worker_processes 1;
pid $WORK/nginx.pid;
error_log $WORK/nginx/error.log error;
daemon off;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx;
  proxy_temp_path $WORK/nginx;
  upstream llm { hash \$http_x_session_id consistent; server 127.0.0.1:$SIM_PORT; keepalive 64; }
  server {
    listen 127.0.0.1:$NGX_PORT;
    location / { proxy_pass http://llm; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_buffering off; }
  }
}
NGX
  nginx -c "$WORK/nginx.conf" &
  PIDS+=($!)
  wait_port "$NGX_PORT"
fi

cat > "$WORK/req.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.body = '{"model":"qwen3-8b","max_tokens":4,"messages":[{"role":"system","content":"You are a careful coding agent. Use the tools."},{"role":"user","content":"next step"}]}'
local n = 0
request = function()
  n = n + 1
  wrk.headers["x-session-id"] = "session-" .. (n % 500)
  return wrk.format()
end
LUA

run() { # name port
  wrk -t1 -c"$CONN" -d"${DUR}s" --latency -s "$WORK/req.lua" "http://127.0.0.1:$2/v1/chat/completions" > "$WORK/$1.txt"
  local rps p50 p99
  rps=$(awk '/Requests\/sec/ {print $2}' "$WORK/$1.txt")
  p50=$(awk '$1=="50%" {print $2}' "$WORK/$1.txt")
  p99=$(awk '$1=="99%" {print $2}' "$WORK/$1.txt")
  echo "$1 $rps $p50 $p99"
}
to_ms() { awk -v v="$1" 'BEGIN { if (v ~ /us$/) { sub(/us/,"",v); print v/1000 } else if (v ~ /ms$/) { sub(/ms/,"",v); print v } else { sub(/s/,"",v); print v*1000 } }'; }

# Warm up connections and caches, then measure.
wrk -t1 -c"$CONN" -d2s -s "$WORK/req.lua" "http://127.0.0.1:$GW_PORT/v1/chat/completions" >/dev/null
RESULTS=("$(run direct "$SIM_PORT")" "$(run agent-gateway "$GW_PORT")")
[ "$HAVE_NGINX" = 1 ] && RESULTS+=("$(run nginx "$NGX_PORT")")

echo
echo "wrk -t1 -c$CONN -d${DUR}s, POST /v1/chat/completions, 500 sessions; backend: sim-backend with zero model latency; $(nproc) cores"
echo
echo "| path | requests/s | ratio to direct | p50 ms | p99 ms |"
echo "|---|---:|---:|---:|---:|"
BASE=$(echo "${RESULTS[0]}" | awk '{print $2}')
for r in "${RESULTS[@]}"; do
  set -- $r
  printf "| %s | %.0f | %.2f× | %.3f | %.3f |\n" "$1" "$2" "$(awk -v a="$2" -v b="$BASE" 'BEGIN{print a/b}')" "$(to_ms "$3")" "$(to_ms "$4")"
done
