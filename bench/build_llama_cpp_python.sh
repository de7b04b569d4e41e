#!/usr/bin/env bash
# Install llama-cpp-python (its OpenAI-compatible server: `python -m llama_cpp.server`), the second
# llama.cpp peer bench/compare.py measures, into its own virtual environment, built from PyPI's
# sdist for this CPU (no other network). About 8 minutes on 2 cores; needs cmake and a C/C++
# compiler. Usage: bench/build_llama_cpp_python.sh [DIR] (default /tmp/llama-peer); prints the
# environment's python.
set -euo pipefail
dir=${1:-/tmp/llama-peer}
version=0.3.36
python="$dir/python/bin/python"
if "$python" -c "import llama_cpp.server" 2>/dev/null; then echo "$python"; exit 0; fi
mkdir -p "$dir"
python3 -m venv "$dir/python"
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF" \
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$python" -m pip install -q "llama-cpp-python[server]==$version" >&2
echo "$python"
