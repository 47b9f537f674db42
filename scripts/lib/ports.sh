# Sourced by the bench scripts: a free port on 127.0.0.1, and a wait until one
# accepts connections (WAIT_PORT_TRIES of 50 ms, 15 s by default).
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 1 "${WAIT_PORT_TRIES:-300}"); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened" >&2; exit 1; }
