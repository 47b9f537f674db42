#!/usr/bin/env bash
# Installs what building agent-gateway needs and the machine may lack:
# cmake (Pingora's zlib-ng build), a C compiler, redis-server, dnsmasq, and the real inference
# engine the tests and `demo --engine llamacpp` run (scripts/engine/setup.sh). With `--vllm`
# (scripts/test.sh, `scripts/demo.sh --engine vllm`) also vLLM's CPU build
# (scripts/engine/vllm-setup.sh: about 5 minutes and 6.3 GB the first time).
# Safe to run repeatedly.
set -euo pipefail
need=()
command -v cmake >/dev/null || need+=(cmake)
command -v cc >/dev/null || need+=(gcc)
command -v systemd-analyze >/dev/null || need+=(systemd)   # tests verify the unit file
command -v redis-server >/dev/null || need+=(redis-server)  # shared bindings (affinity.store: redis) and its tests
command -v dnsmasq >/dev/null || [ -x /usr/sbin/dnsmasq ] || need+=(dnsmasq-base)  # the DNS server tests/discovery.rs runs
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}" >&2
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "cargo is required (https://rustup.rs)" >&2; exit 1; }
"$(dirname "$0")/engine/setup.sh" >/dev/null
if [ "${1:-}" = --vllm ]; then "$(dirname "$0")/engine/vllm-setup.sh" >/dev/null; fi
