#!/usr/bin/env bash
# llama.cpp's runtime for scripts/compare_llama_cpp.py, built once, outside the repository: llama-simple
# (greedy text) from the llama.cpp vendored in the llama-cpp-python source package of the version
# scripts/fetch_llama_converter.sh names (the converter and the runtime agree on the GGUF they read), and
# llama-cpp-logits (scripts/llama_cpp_logits.cpp) linked against its libllama. CPU only, niced, one job
# by default (JOBS=2 for more). A second run finds the tools and does nothing.
#
#     bash scripts/build_llama_cpp.sh && python scripts/compare_llama_cpp.py --out_dir=RUN
#
# Prints the build folder: $LLAMA_CPP_BUILD_DIR, else ~/.cache/nanogpt/llama.cpp-build.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
VERSION=$(sed -n 's/^VERSION=\([0-9.]*\).*/\1/p' "$here/fetch_llama_converter.sh")
BUILD=${LLAMA_CPP_BUILD_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/nanogpt/llama.cpp-build}
if [ -x "$BUILD/bin/llama-simple" ] && [ -x "$BUILD/bin/llama-cpp-logits" ] && \
        [ "$BUILD/bin/llama-cpp-logits" -nt "$here/llama_cpp_logits.cpp" ]; then
    echo "$BUILD"
    exit 0
fi
src="$BUILD/llama_cpp_python-$VERSION/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$BUILD"
    pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$BUILD"
    tar xzf "$BUILD/llama_cpp_python-$VERSION.tar.gz" -C "$BUILD" "llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
cmake -S "$src" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF >/dev/null
nice -n 19 cmake --build "$BUILD" -j"${JOBS:-1}" --target llama-simple >&2
nice -n 19 g++ -O2 -std=c++17 "$here/llama_cpp_logits.cpp" -I"$src/include" -I"$src/ggml/include" \
    -L"$BUILD/bin" -lllama -lggml -lggml-base -Wl,-rpath,"$BUILD/bin" -o "$BUILD/bin/llama-cpp-logits"
echo "$BUILD"
