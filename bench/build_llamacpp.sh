#!/usr/bin/env bash
# Builds llama.cpp natively for this host (-DGGML_NATIVE=ON: the host's own instruction sets), from
# the llama.cpp that llama-cpp-python's source distribution carries, into DIR (default
# ~/.cache/llamacpp-native). Prints the folder of the binaries. About 8 minutes on 2 cores, once.
#   bash bench/build_llamacpp.sh [DIR] [LLAMA_CPP_PYTHON_VERSION]
set -euo pipefail
dir=${1:-$HOME/.cache/llamacpp-native}
version=${2:-0.3.36}
bin="$dir/llama.cpp/build/bin"
if [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-batched-bench" ]; then
    echo "$bin"
    exit 0
fi
mkdir -p "$dir/sdist"
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$dir/sdist" >&2
tar -xzf "$dir/sdist/llama_cpp_python-$version.tar.gz" -C "$dir"
ln -sfn "$dir/llama_cpp_python-$version/vendor/llama.cpp" "$dir/llama.cpp"
cmake -S "$dir/llama.cpp" -B "$dir/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF >&2
cmake --build "$dir/llama.cpp/build" -j"$(nproc)" --target llama-bench llama-batched-bench >&2
echo "$bin"
