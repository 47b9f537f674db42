#!/usr/bin/env bash
# What idle client connections cost the gateway, and what it gives back:
# N (default 5000) connections that send nothing, then closed; the gateway's
# RSS at start, while they are open (per connection), and AFTER seconds
# (default 30) after they closed. One simulated replica, 127.0.0.1 only.
#   BIN=target/demo/agent-gateway scripts/idle-connections.sh [N] [AFTER]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-target/demo/agent-gateway}"
N="${1:-5000}"; AFTER="${2:-30}"
WORK=$(mktemp -d)
source scripts/proxy-load.sh
start_sim
GWP=$(port)
gateway_config "$GWP" gw 2
ulimit -n $((N + 1000))
RUST_LOG=error "$BIN" run --config "$WORK/gw.yaml" >"$WORK/gw.log" 2>&1 &
GPID=$!
trap 'kill -TERM $GPID 2>/dev/null || true; stop_sims; rm -rf "$WORK"' EXIT
wait_port "$GWP"
python3 - "$GWP" "$GPID" "$N" "$AFTER" <<'PY'
import os, resource, socket, sys, time
port, pid, n, after = (int(a) for a in sys.argv[1:])
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 1000, n + 1000))
def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
fds = lambda: len(os.listdir(f"/proc/{pid}/fd"))
start = rss()
socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
time.sleep(3)
opened, open_fds = rss(), fds()
for s in socks:
    s.close()
time.sleep(after)
closed = rss()
print(f"{n} idle connections: RSS {start:.1f} MiB at start, {opened:.1f} MiB open "
      f"({(opened - start) * 1024 / n:.1f} KB each; {open_fds} descriptors), "
      f"{closed:.1f} MiB {after} s after they closed ({closed - start:+.1f} MiB; {fds()} descriptors)")
PY
