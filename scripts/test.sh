#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit and integration tests
# (real gateway, simulated-replica, llama.cpp, vLLM and Redis processes on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --vllm
cargo fmt --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cat >&2 <<'NOTE'
Running the tests. They kill, hang and fault backends, Redis and clients on purpose:
the ERROR and WARN lines the gateways under test log are those faults, expected.
A test that fails says FAILED, and the run ends with the failures listed.
NOTE
# From a clean checkout incremental caches only cost disk (1.4 GB of it).
CARGO_INCREMENTAL=0 cargo test --workspace --locked --no-fail-fast
