#!/usr/bin/env bash
# Installs the real inference engine the tests, demo and bench run against:
# llama.cpp's own HTTP server through the `xllamacpp` wheel (no compiler, no
# download at run time), plus `gguf`/numpy for the model generator, and the
# official OpenAI and Anthropic Python SDKs (tests drive the gateway with
# them: 429 retries, Responses chains, Anthropic Messages) and
# opentelemetry-proto (the OTLP receiver the telemetry test decodes spans with),
# in a venv.
# Prints the venv's python. Safe to run repeatedly.
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${AGENT_GATEWAY_ENGINE_VENV:-$PWD/target/engine-venv}"
py="$venv/bin/python"
if ! "$py" -c 'import xllamacpp, gguf, numpy, openai, anthropic, opentelemetry.proto' >/dev/null 2>&1; then
  command -v python3 >/dev/null || {
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3 python3-venv >/dev/null
  }
  echo "installing the llama.cpp engine into $venv" >&2
  python3 -m venv "$venv" >&2
  "$py" -m pip install -q --disable-pip-version-check \
    "xllamacpp==2026.10.11549" "gguf==0.19.0" "numpy>=1.26,<3" "openai==3.57.0" "anthropic==2.17.0" \
    "opentelemetry-proto==1.45.2" >&2
fi
echo "$py"
