#!/usr/bin/env bash
# What idle client connections cost the gateway, and what it gives back:
# N (default 5000) connections that send nothing, then closed; the gateway's
# RSS at start, while they are open (per connection), and AFTER seconds
# (default 30) after they closed. One simulated replica, 127.0.0.1 only.
# TLS=1: each connection completes a TLS handshake first (TLS=h2: and
# negotiates HTTP/2 by ALPN), against a self-signed certificate.
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
if [ -n "${TLS:-}" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 1 \
    -subj /CN=localhost -keyout "$WORK/key.pem" -out "$WORK/cert.pem" 2>/dev/null
  TLS_PORT=$(port)
  # Handshakes one after another take longer than the 30 s a connection may
  # wait for its first request: the measurement lets them all wait.
  sed -i "s|^server:|server:\n  header_timeout_ms: 600000\n  tls: { listen: [\"127.0.0.1:$TLS_PORT\"], certificates: [{ cert: \"$WORK/cert.pem\", key: \"$WORK/key.pem\" }] }|" "$WORK/gw.yaml"
  GWP_CONNECT=$TLS_PORT
fi
ulimit -n $((N + 1000))
RUST_LOG=error "$BIN" run --config "$WORK/gw.yaml" >"$WORK/gw.log" 2>&1 &
GPID=$!
trap 'kill -TERM $GPID 2>/dev/null || true; stop_sims; rm -rf "$WORK"' EXIT
wait_port "$GWP"
python3 - "${GWP_CONNECT:-$GWP}" "$GPID" "$N" "$AFTER" "${TLS:-}" <<'PY'
import os, resource, socket, ssl, sys, time
port, pid, n, after = (int(a) for a in sys.argv[1:5])
tls = sys.argv[5]
resource.setrlimit(resource.RLIMIT_NOFILE, (n + 1000, n + 1000))
def rss():
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
fds = lambda: len(os.listdir(f"/proc/{pid}/fd"))
start = rss()
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
if tls == "h2":
    ctx.set_alpn_protocols(["h2"])
def connect():
    s = socket.create_connection(("127.0.0.1", port))
    if not tls:
        return s
    t = ctx.wrap_socket(s, server_hostname="localhost")
    if tls == "h2":
        # The client preface and an empty SETTINGS frame: an idle HTTP/2 connection.
        t.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0]))
    return t
socks = [connect() for _ in range(n)]
time.sleep(3)
opened, open_fds = rss(), fds()
for s in socks:
    s.close()
time.sleep(after)
closed = rss()
print(f"{n} idle {'TLS (' + tls + ') ' if tls else ''}connections: RSS {start:.1f} MiB at start, {opened:.1f} MiB open "
      f"({(opened - start) * 1024 / n:.1f} KB each; {open_fds} descriptors), "
      f"{closed:.1f} MiB {after} s after they closed ({closed - start:+.1f} MiB; {fds()} descriptors)")
PY
