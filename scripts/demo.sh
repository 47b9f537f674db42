#!/usr/bin/env bash
# One command from a fresh machine: install build prerequisites, build, and
# run the demo (3 simulated vLLM replicas + the gateway + an agent workload).
# `scripts/demo.sh --engine llamacpp` runs it on real llama.cpp replicas.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --locked
exec target/release/agent-gateway demo "$@"
