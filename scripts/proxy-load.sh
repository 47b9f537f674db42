# Sourced by scripts/bench-proxy.sh and scripts/profile-proxy.sh, so the two
# measure the same thing: the simulated replica, the wrk request script and
# the gateway's configuration are written here once. Expects WORK and BIN.

. scripts/lib/ports.sh
# Up to a minute: a proxy under valgrind starts slowly.
WAIT_PORT_TRIES=1200

# start_sim: ${BACKENDS:-1} simulated replicas with zero model latency; sets
# SIM_PORT (the first, which the bare proxy and nginx use), SIM_PORTS and
# SIM_PIDS. More than one measures what the gateway's per-request work costs
# with a fleet behind it (every request looks at each backend's health and
# load). The simulator has no SIGINT handler, and a background job of a
# script ignores SIGINT: stop them with SIGTERM (stop_sims).
# With KV_EVENTS=1 each replica publishes its KV-cache events too, and SIM_KV
# holds each one's `kv_events` (gateway_config's configs use them when their
# name ends in -kv).
start_sim() {
  SIM_PORTS=(); SIM_PIDS=(); SIM_KV=()
  local kv=()
  [ -n "${KV_EVENTS:-}" ] && kv=(--kv-events 127.0.0.1:0)
  for i in $(seq 0 $(( ${BACKENDS:-1} - 1 ))); do
    SIM_PORTS+=("$(port)")
    "$BIN" sim-backend --listen "127.0.0.1:${SIM_PORTS[$i]}" --id "bench-$i" --prefill-us-per-token 0 \
      --decode-us-per-token 0 --cache-blocks 0 --max-batch 1024 ${kv[@]+"${kv[@]}"} > "$WORK/sim-$i.out" &
    SIM_PIDS+=($!)
  done
  for i in "${!SIM_PORTS[@]}"; do
    wait_port "${SIM_PORTS[$i]}"
    if [ -n "${KV_EVENTS:-}" ]; then
      for _ in $(seq 1 200); do [ "$(wc -l < "$WORK/sim-$i.out")" -ge 2 ] && break; sleep 0.05; done
      SIM_KV+=("$(sed -n 's/^kv events on \(.*\) replay \(.*\)/{ endpoint: "\1", replay: "\2" }/p' "$WORK/sim-$i.out")")
    fi
  done
  SIM_PORT=${SIM_PORTS[0]}
}
stop_sims() { for p in ${SIM_PIDS[@]+"${SIM_PIDS[@]}"}; do kill -TERM "$p" 2>/dev/null || true; done; }

# write_load: $WORK/req.lua, chat POSTs over 500 rotating session ids.
# PROMPT_BYTES=N makes each a chat of about N bytes (a shared system prompt,
# then the conversation's own first message); KEYLESS=1 sends no session id,
# so the gateway finds each request's conversation by its prompt. TURNS=N
# (with PROMPT_BYTES or KEYLESS) has each conversation run N turns, its
# prompt growing by one exchange a turn, then start over as a new one; with
# TURNS=1 (the default) every request repeats its conversation's only turn,
# which a keyless gateway takes for the same prompt sent again.
write_load() {
  if [ -z "${PROMPT_BYTES:-}" ] && [ "${KEYLESS:-0}" = 0 ]; then
    cat > "$WORK/req.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["content-type"] = "application/json"
wrk.headers["authorization"] = "Bearer sk-profile-tenant"
wrk.body = '{"model":"qwen3-8b","max_tokens":4,"messages":[{"role":"system","content":"You are a careful coding agent. Use the tools."},{"role":"user","content":"next step"}]}'
local n = 0
request = function()
  n = n + 1
  wrk.headers["x-session-id"] = "session-" .. (n % 500)
  return wrk.format()
end
LUA
    return
  fi
  cat > "$WORK/req.lua" <<LUA
local system = string.rep("You are a careful coding agent. Use the tools. ", math.floor(${PROMPT_BYTES:-200} / 48))
local keyless = ${KEYLESS:-0} == 1
local turns = ${TURNS:-1}
local n = 0
request = function()
  n = n + 1
  local conv = n % 500
  local round = math.floor(n / 500)
  local turn = round % turns
  local generation = math.floor(round / turns)
  local id = conv .. "." .. generation
  local messages = '{"role":"system","content":"' .. system .. '"},{"role":"user","content":"conversation ' .. id .. ': next step"}'
  for t = 1, turn do
    messages = messages .. ',{"role":"assistant","content":"step ' .. t .. ' done"},{"role":"user","content":"conversation ' .. id .. ', turn ' .. t .. ': go on"}'
  end
  local body = '{"model":"qwen3-8b","max_tokens":4,"messages":[' .. messages .. ']}'
  local headers = { ["content-type"] = "application/json" }
  if not keyless then headers["x-session-id"] = "session-" .. id end
  return wrk.format("POST", nil, headers, body)
end
LUA
}

# gateway_config PORT NAME THREADS: $WORK/NAME.yaml, the gateway in front of the replicas.
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
    backends:
$(for i in "${!SIM_PORTS[@]}"; do
  kv=""; case "$2" in *-kv) kv=", kv_events: ${SIM_KV[$i]}" ;; esac
  echo "      - { id: bench-$i, addr: \"127.0.0.1:${SIM_PORTS[$i]}\"$kv }"; done)
affinity: { hash_key: "c038e2936f9f214dab26f2ab9a8927bad9b6b3c10c696145853ff9aca9015f2e" }
metrics: { listen: "127.0.0.1:$(port)" }
admin: { listen: "127.0.0.1:$(port)" }
YAML
}
