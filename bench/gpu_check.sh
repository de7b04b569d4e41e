#!/usr/bin/env bash
# The GPU checks, as one script for a machine with a CUDA GPU (under 10 minutes on one H200):
# the tests that need CUDA, then the engine throughput bench on the GPU with its decode steps
# replayed as CUDA graphs and again without (every step eager). Run from the repository
# root with a Python that has torch (a CUDA build) and mashbox's dependencies:
#   PYTHON=.venv/bin/python bash bench/gpu_check.sh [OUT_DIR]
# On the lent device machine (its image has torch, transformers and pytest, not mashbox's other
# packages nor the embedded model), first `bash bench/gpu_prepare.sh` here, then carry .gpu/:
# its wheels are installed under /tmp/site, the tests read the tokenizer from it, and the bench
# runs a SmolLM2-135M-shaped model with random weights (same shapes, so the same speed).
set -uo pipefail
PYTHON=${PYTHON:-python3}
out=${1:-${OUT:-/tmp/mashbox-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
model=smollm2-135m
if [ -d .gpu/wheels ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .gpu/wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD MASHBOX_TEST_TOKENIZER=$PWD/.gpu/tokenizer
    model=/tmp/smollm2-random
    "$PYTHON" - "$model" <<'PY' || exit 1
import sys

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                     rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
LlamaForCausalLM(config).save_pretrained(sys.argv[1])
AutoTokenizer.from_pretrained(".gpu/tokenizer").save_pretrained(sys.argv[1])
PY
fi
"$PYTHON" - <<'PY' 2>&1 | tee "$out/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0))
PY
status=0
timeout 300 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$out/tests.txt" || status=1
timeout 200 "$PYTHON" bench/engine_throughput.py --model "$model" --n 1 16 64 --max-tokens 128 2>&1 \
    | tee "$out/throughput.txt" || status=1
timeout 100 "$PYTHON" bench/engine_throughput.py --model "$model" --n 1 16 64 --max-tokens 128 --no-cuda-graphs \
    --no-baseline 2>&1 | tee "$out/throughput-eager.txt" || status=1
exit $status
