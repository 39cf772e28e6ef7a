#!/usr/bin/env bash
# Build llama.cpp's bench tools (llama-bench, llama-batched-bench, llama-perplexity, llama-quantize,
# llama-imatrix, llama-simple for greedy parity) from the llama.cpp source vendored in the llama-cpp-python
# sdist, once, and cache them outside the repository. Prints the folder holding the binaries; re-running
# with them present builds nothing.
#
#   bash scripts/bench/llamacpp.sh            # -> ~/.cache/compress/llama.cpp-0.3.36/bin
#   LLAMACPP_VERSION=0.3.36 COMPRESS_CACHE=/somewhere bash scripts/bench/llamacpp.sh
#
# Needs cmake and a C++ compiler (apt-get install cmake g++). GGML_NATIVE=ON: the binaries use this
# CPU's instruction set (AVX-512, VNNI, BF16, AMX where present), so they belong to this machine only.
set -euo pipefail
version=${LLAMACPP_VERSION:-0.3.36}
cache=${COMPRESS_CACHE:-$HOME/.cache/compress}/llama.cpp-$version
targets=(llama-bench llama-batched-bench llama-perplexity llama-quantize llama-imatrix llama-simple)
python=${PYTHON:-python3}

have_all() { for t in "${targets[@]}"; do [ -x "$cache/bin/$t" ] || return 1; done; }
if have_all; then echo "$cache/bin"; exit 0; fi

for tool in cmake c++; do
  command -v "$tool" >/dev/null || { echo "llamacpp.sh: '$tool' is missing; apt-get install cmake g++" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "llamacpp.sh: downloading the llama-cpp-python $version sdist" >&2
"$python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work" >&2
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
[ -f "$src/CMakeLists.txt" ] || { echo "llamacpp.sh: no vendored llama.cpp in the sdist" >&2; exit 2; }
echo "llamacpp.sh: building ${targets[*]} (a few minutes on 2 cores)" >&2
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >&2
cmake --build "$work/build" --config Release -j "$(nproc)" --target "${targets[@]}" >&2
mkdir -p "$cache.tmp/bin"
for t in "${targets[@]}"; do cp "$work/build/bin/$t" "$cache.tmp/bin/"; done
git -C "$src" rev-parse HEAD >"$cache.tmp/COMMIT" 2>/dev/null || echo "llama-cpp-python $version" >"$cache.tmp/COMMIT"
rm -rf "$cache" && mv "$cache.tmp" "$cache"
echo "$cache/bin"
