#!/usr/bin/env bash
# GPU validation + benchmark in one command (H100/H200, Python 3.11 + driver only).
#   test/manual/kvcr_direct_linker/gpu_check.sh [MODEL]
# Installs the full CUDA sglang 0.5.23 (its own torch), kvcr, nixl and this package
# into .venv-gpu, then runs the end-to-end validation and the serving benchmark with
# Qwen/Qwen3-0.6B (page 64, 3000-token prompts). Prints both REPORT lines.
# NOT yet run on a GPU: no device was lent to the session that wrote it.
set -euo pipefail
cd "$(dirname "$0")/../../.."
MODEL=${1:-Qwen/Qwen3-0.6B}
VENV=.venv-gpu
export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo} NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "sglang==0.5.23" "kvcr==0.1.1" "nixl==1.5.0" msgpack requests
  "$VENV/bin/pip" install -q --no-deps -e .
fi
PY="$VENV/bin/python"
"$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
common=(--device cuda --model-path "$MODEL" --page-size 64 --prompt-len 3000 --output-len 1
        --dram-bytes $((16 << 30)) --max-total-tokens 12000 --operation-timeout-ms 2000
        --server-args "--mem-fraction-static 0.5 --attention-backend triton")
timeout 420 "$PY" test/manual/kvcr_direct_linker/kvcr_validate.py "${common[@]}" | tail -12
timeout 300 "$PY" test/manual/kvcr_direct_linker/kvcr_bench.py --device cuda --model-path "$MODEL" \
  --page-size 64 --prompt-len 3000 | tail -20
