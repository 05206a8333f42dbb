#!/usr/bin/env bash
# llama.cpp's transformers -> GGUF converter, which tests/test_gguf.py runs on exported folders:
# convert_hf_to_gguf.py with its conversion/ and gguf-py/ folders and src/llama-vocab.cpp (the
# pre-tokenizers' regexes), unpacked from the llama-cpp-python source package (its vendor/llama.cpp),
# and sentencepiece, which the converter imports for every
# Llama-class folder, installed beside it (site/) rather than into the environment. A second run
# finds the unpack and does nothing. Prints the folder; the tests find it there, or in
# $LLAMA_CPP_CONVERTER_DIR when that is set (here and in the tests).
#
#     bash scripts/fetch_llama_converter.sh && python -m pytest tests/test_gguf.py -q
set -euo pipefail
VERSION=0.3.36  # the converter the tests were written against
DIR=${LLAMA_CPP_CONVERTER_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/nanogpt/llama.cpp-$VERSION}
if [ -f "$DIR/convert_hf_to_gguf.py" ] && [ -f "$DIR/src/llama-vocab.cpp" ] && [ -d "$DIR/site/sentencepiece" ]; then
    echo "$DIR"
    exit 0
fi
tmp=$(mktemp -d "${TMPDIR:-/tmp}/llama-converter.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp"
src="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar xzf "$tmp/llama_cpp_python-$VERSION.tar.gz" -C "$tmp" "$src/convert_hf_to_gguf.py" "$src/conversion" "$src/gguf-py" \
    "$src/src/llama-vocab.cpp"
pip install --quiet --no-deps --target "$tmp/$src/site" sentencepiece==0.2.3  # as the tests last ran with
mkdir -p "$(dirname "$DIR")"
rm -rf "$DIR"
mv "$tmp/$src" "$DIR"  # whole or not at all: an interrupted run leaves no half unpack for the tests to find
echo "$DIR"
