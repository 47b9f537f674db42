# Sourced by scripts/bench-proxy.sh and scripts/profile-proxy.sh, so the two
# measure the same thing: the simulated replica, the wrk request script and
# the gateway's configuration are written here once. Expects WORK and BIN.

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Up to a minute: a proxy under valgrind starts slowly.
wait_port() { for _ in $(seq 1 1200); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }

# start_sim: one simulated replica with zero model latency; sets SIM_PORT and
# SIM_PID. The simulator has no SIGINT handler, and a background job of a
# script ignores SIGINT: stop it with SIGTERM.
start_sim() {
  SIM_PORT=$(port)
  "$BIN" sim-backend --listen "127.0.0.1:$SIM_PORT" --id bench-0 --prefill-us-per-token 0 \
    --decode-us-per-token 0 --cache-blocks 0 --max-batch 1024 >/dev/null &
  SIM_PID=$!
  wait_port "$SIM_PORT"
}

# write_load: $WORK/req.lua, chat POSTs over 500 rotating session ids.
write_load() {
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
}

# gateway_config PORT NAME THREADS: $WORK/NAME.yaml, the gateway in front of the replica.
gateway_config() {
  cat > "$WORK/$2.yaml" <<YAML
server:
  listen: ["127.0.0.1:$1"]
  threads: $3
  pid_file: "$WORK/$2.pid"
  upgrade_sock: "$WORK/$2.sock"
tiers:
  default:
    default: true
    backends: [{ id: bench-0, addr: "127.0.0.1:$SIM_PORT" }]
affinity: { hash_key: "bench-key" }
metrics: { listen: "127.0.0.1:$(port)" }
admin: { listen: "127.0.0.1:$(port)" }
YAML
}
