#!/usr/bin/env bash
# The GPU checks, as one script for a machine with a CUDA GPU (under 10 minutes on one H200):
# the tests that need CUDA, then the engine throughput bench on the GPU with its decode steps
# replayed as CUDA graphs and again without (every step eager). Run from the repository
# root with a Python that has torch (a CUDA build) and mashbox's dependencies:
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh [OUT_DIR]
set -uo pipefail
PYTHON=${PYTHON:-python3}
out=${1:-${OUT:-/tmp/mashbox-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
"$PYTHON" - <<'PY' 2>&1 | tee "$out/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0))
PY
status=0
timeout 300 "$PYTHON" -m pytest -q -rs tests/test_cuda.py 2>&1 | tee "$out/tests.txt" || status=1
timeout 200 "$PYTHON" bench/engine_throughput.py --n 1 16 64 --max-tokens 128 2>&1 | tee "$out/throughput.txt" || status=1
timeout 100 "$PYTHON" bench/engine_throughput.py --n 1 16 64 --max-tokens 128 --no-cuda-graphs --no-baseline 2>&1 \
    | tee "$out/throughput-eager.txt" || status=1
exit $status
