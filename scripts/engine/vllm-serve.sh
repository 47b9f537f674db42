#!/usr/bin/env bash
# Runs one vLLM server (CPU build, scripts/engine/vllm-setup.sh) on 127.0.0.1:PORT until
# killed: prefix caching, cached-token reports, the Responses store, /metrics, and its
# KV-cache events published at EVENTS (a ZeroMQ endpoint it binds: ipc:///path, or
# tcp://*:port) with their replay socket on 127.0.0.1:REPLAY_PORT. BLOCKS caps its KV
# cache (blocks of BLOCK_SIZE tokens). Used by tools/src/vllm.rs (tests, demo) and
# scripts/bench-kv-events.sh.
#
#   scripts/engine/vllm-serve.sh MODEL_DIR PORT EVENTS REPLAY_PORT [BLOCKS=512] [BLOCK_SIZE=32] [MAX_MODEL_LEN=4096]
set -euo pipefail
model=$1 port=$2 events=$3 replay=$4 blocks=${5:-512} block_size=${6:-32} max_len=${7:-4096}
py="${AGENT_GATEWAY_VLLM_PYTHON:-$(dirname "$0")/../../target/vllm-venv/bin/python}"
# One thread each, unpinned (by default every server pins itself to core 0); 1 GiB of KV
# space, of which --num-gpu-blocks-override uses what BLOCKS asks.
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1
export VLLM_ENABLE_RESPONSES_API_STORE=1 VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
exec "$py" -m vllm.entrypoints.openai.api_server --model "$model" --served-model-name tiny \
  --host 127.0.0.1 --port "$port" --enforce-eager --enable-prefix-caching \
  --enable-prompt-tokens-details --block-size "$block_size" --max-model-len "$max_len" \
  --num-gpu-blocks-override "$blocks" \
  --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$events\",\"replay_endpoint\":\"tcp://127.0.0.1:$replay\",\"topic\":\"kv\"}"
