#!/usr/bin/env bash
# One command from a fresh machine: install build prerequisites, build, and
# run the demo (3 simulated vLLM replicas + the gateway + an agent workload).
# `scripts/demo.sh --engine llamacpp` runs it on real llama.cpp replicas,
# `--engine vllm` on real vLLM servers (installed first: about 5 minutes, 6.3 GB).
set -euo pipefail
cd "$(dirname "$0")/.."
case " $* " in
  *" --engine vllm "*|*" --engine=vllm "*) scripts/setup.sh --vllm ;;
  *) scripts/setup.sh ;;
esac
# The demo profile: release optimisation without fat LTO (Cargo.toml).
cargo build --profile demo --locked
exec target/demo/agent-gateway demo "$@"
