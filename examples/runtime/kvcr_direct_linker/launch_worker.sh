#!/usr/bin/env bash
# One SGLang worker with the KVCR direct linker.
# Usage: MODEL=Qwen/Qwen3-0.6B PORT=30000 CONTROL_PORT=47000 DRAM_BYTES=$((32<<30)) ./launch_worker.sh [extra launch_server flags]
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen3-0.6B}
PORT=${PORT:-30000}
CONTROL_PORT=${CONTROL_PORT:-47000}
DRAM_BYTES=${DRAM_BYTES:-$((32 << 30))}
HOST=${HOST:-127.0.0.1}
ADVERTISE=${ADVERTISE:-$HOST}
PAGE_SIZE=${PAGE_SIZE:-64}
CONFIG=$(printf '{"local_dram_bytes_per_worker": %d, "control_bind_host": "%s", "control_advertise_host": "%s", "control_port": %d}' \
  "$DRAM_BYTES" "$HOST" "$ADVERTISE" "$CONTROL_PORT")
exec python -m sglang.launch_server --model-path "$MODEL" --host "$HOST" --port "$PORT" \
  --page-size "$PAGE_SIZE" \
  --enable-unified-cache-external-linker \
  --unified-cache-external-linker-backend kvcr \
  --unified-cache-external-linker-config "$CONFIG" "$@"
