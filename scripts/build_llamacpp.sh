#!/usr/bin/env bash
# Build llama.cpp's llama-bench and llama-server for this CPU (GGML_NATIVE: the kernels of this machine's ISA) from
# the llama.cpp that llama-cpp-python's source distribution vendors on the package index: the anchor specc's
# benchmarks compare with, as a user of this machine would build it.
#
#   scripts/build_llamacpp.sh [VERSION]        (default: the newest llama-cpp-python)
#
# Prints the directory holding the binaries and llama.cpp's shared libraries (~/.cache/specc/llama.cpp/VERSION/bin).
# Needs cmake and a C++ compiler; several minutes on 2 cores. `specc bench --compare llamacpp` drives llama.cpp
# through llama-cpp-python; to give it this build rather than a second one:
#   CMAKE_ARGS=-DLLAMA_BUILD=OFF pip install llama-cpp-python==VERSION
#   LD_LIBRARY_PATH=DIR LLAMA_CPP_LIB_PATH=DIR specc bench ... --compare llamacpp
set -euo pipefail
version="${1:-}"
python="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
spec="llama-cpp-python${version:+==$version}"
"$python" -m pip download -q --no-deps --no-binary :all: -d "$work" "$spec" >&2
archive="$(ls "$work"/llama_cpp_python-*.tar.gz)"
version="$(basename "$archive" .tar.gz)"
version="${version#llama_cpp_python-}"
out="${SPECC_CACHE:-$HOME/.cache/specc}/llama.cpp/$version"
if [ -x "$out/bin/llama-bench" ] && [ -x "$out/bin/llama-server" ]; then
    echo "$out/bin"
    exit 0
fi
tar -xzf "$archive" -C "$work"
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$work/build" --target llama-bench llama-server -j "$(nproc)" >&2
mkdir -p "$out/bin"
cp "$work"/build/bin/llama-bench "$work"/build/bin/llama-server "$out/bin/"
cp "$work"/build/bin/*.so* "$out/bin/" 2>/dev/null || true
echo "$out/bin"
