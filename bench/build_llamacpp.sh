#!/usr/bin/env bash
# Builds llama.cpp natively for this host (-DGGML_NATIVE=ON: the host's own instruction sets), from
# the llama.cpp that llama-cpp-python's source distribution carries, into DIR (default
# ~/.cache/llamacpp-native). Prints the folder of the binaries. About 8 minutes on 2 cores, once.
# With LLAMACPP_ISA=avx2 it builds for AVX2 hosts instead (AVX2, FMA, F16C; no AVX-512), into
# build-avx2/, so an AVX-512 host can give both sides of the AVX2 rows (LLAMACPP_BIN=that folder).
#   [LLAMACPP_ISA=avx2] bash bench/build_llamacpp.sh [DIR] [LLAMA_CPP_PYTHON_VERSION]
set -euo pipefail
dir=${1:-$HOME/.cache/llamacpp-native}
version=${2:-0.3.36}
isa=${LLAMACPP_ISA:-native}
case "$isa" in
    native) build_name=build; isa_flags=(-DGGML_NATIVE=ON) ;;
    avx2) build_name=build-avx2
        isa_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
            -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
            -DGGML_AVX_VNNI=OFF) ;;
    *) echo "LLAMACPP_ISA must be native or avx2, not $isa" >&2; exit 2 ;;
esac
bin="$dir/llama.cpp/$build_name/bin"
if [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-batched-bench" ]; then
    echo "$bin"
    exit 0
fi
if [ ! -d "$dir/llama_cpp_python-$version/vendor/llama.cpp" ]; then
    mkdir -p "$dir/sdist"
    python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" \
        -d "$dir/sdist" >&2
    tar -xzf "$dir/sdist/llama_cpp_python-$version.tar.gz" -C "$dir"
fi
ln -sfn "$dir/llama_cpp_python-$version/vendor/llama.cpp" "$dir/llama.cpp"
cmake -S "$dir/llama.cpp" -B "$dir/llama.cpp/$build_name" -DCMAKE_BUILD_TYPE=Release \
    "${isa_flags[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF >&2
cmake --build "$dir/llama.cpp/$build_name" -j"$(nproc)" --target llama-bench llama-batched-bench >&2
echo "$bin"
