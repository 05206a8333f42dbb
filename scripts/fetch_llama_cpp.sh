#!/usr/bin/env bash
# llama.cpp's runtime for tests/test_llama_cpp.py and bench.py's peers section: node-llama-cpp's prebuilt
# llama.cpp (a CPU build for every x86-64 level, chosen at load), installed with `npm ci` from
# tools/llama-cpp/package-lock.json, so nothing is compiled. Only the linux-x64 CPU build: --omit=optional
# skips node-llama-cpp's optional CUDA, Vulkan and other platforms' builds (about 730 MB with them, 83 MB
# without), and package.json names linux-x64 itself; --ignore-scripts skips its postinstall, which would
# offer to build from source. Installed once into a cache folder per lock (a second run finds it and does
# nothing), and tools/llama-cpp/node_modules links to it. Prints the folder. Needs node and npm.
#
#     bash scripts/fetch_llama_cpp.sh && python -m pytest tests/test_llama_cpp.py -q
set -euo pipefail
TOOLS="$(cd "$(dirname "$0")/../tools/llama-cpp" && pwd)"
LOCK_HASH=$(sha256sum "$TOOLS/package-lock.json" | cut -c1-12)
DIR=${LLAMA_CPP_RUNTIME_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/nanogpt/node-llama-cpp-$LOCK_HASH}
if [ ! -f "$DIR/node_modules/node-llama-cpp/package.json" ]; then
    tmp=$(mktemp -d "${TMPDIR:-/tmp}/node-llama-cpp.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    cp "$TOOLS/package.json" "$TOOLS/package-lock.json" "$tmp/"
    (cd "$tmp" && npm ci --omit=optional --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
    mkdir -p "$(dirname "$DIR")"
    rm -rf "$DIR"
    mv "$tmp" "$DIR"  # whole or not at all: an interrupted install leaves nothing for the tests to find
fi
ln -sfn "$DIR/node_modules" "$TOOLS/node_modules"
echo "$DIR"
