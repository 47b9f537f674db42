#!/usr/bin/env bash
# The whole test suite: formatting, lints, unit tests, integration tests
# (real gateway and simulated-replica processes on 127.0.0.1).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo fmt --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked --no-fail-fast
