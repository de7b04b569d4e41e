#!/usr/bin/env bash
# Build llama.cpp's llama-server, the peer bench/compare.py measures mashbox against, from the
# llama.cpp sources vendored in PyPI's llama-cpp-python sdist (no other network). About 6 minutes
# on 2 cores; needs cmake and a C/C++ compiler. Usage: bench/build_llama_server.sh [DIR]
# (default /tmp/llama-peer); prints the binary's path. On a CPU that reports AMX it cannot use,
# run llama-server with --no-repack (bench/compare.py does).
set -euo pipefail
dir=${1:-/tmp/llama-peer}
version=0.3.36
binary="$dir/build/bin/llama-server"
if [ -x "$binary" ]; then echo "$binary"; exit 0; fi
mkdir -p "$dir"
python3 -m pip download -q --no-deps --no-binary :all: -d "$dir" "llama_cpp_python==$version" >&2
tar -xzf "$dir/llama_cpp_python-$version.tar.gz" -C "$dir"
sources="$dir/llama_cpp_python-$version/vendor/llama.cpp"
# no web UI: its default build step downloads the page
cmake -S "$sources" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$dir/build" --target llama-server -j "$(nproc)" >&2
echo "$binary"
