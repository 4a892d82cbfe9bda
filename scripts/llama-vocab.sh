#!/usr/bin/env bash
# llama.cpp's tokenizer test files (ggml-vocab-<name>.gguf, with .gguf.inp / .gguf.out for the vocabularies
# that have them) for tests/test_gguf_tokenizers.py, taken from the llama-cpp-python sdist (a test input
# only: dynserve never imports it). Fetched once with pip, only these files kept, in
# ${XDG_CACHE_HOME:-~/.cache}/dynserve/llama-vocab/<version>/; does nothing when they are there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VERSION=0.3.36
# with .inp/.out: the vocabularies dynserve claims (byte-level BPE, then SentencePiece); GGUF only: some it
# must refuse by name
TESTED=(command-r deepseek-coder deepseek-llm falcon gpt-2 llama-bpe mpt qwen2 qwen35 refact starcoder llama-spm phi-3)
REFUSED=(bert-bge gemma-4)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/dynserve/llama-vocab/$VERSION"
# `complete` lists what was extracted: a cache made for another list is filled again
want="tested: ${TESTED[*]}; refused: ${REFUSED[*]}"
[ "$(cat "$cache/complete" 2>/dev/null)" = "$want" ] && exit 0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "setup: fetching llama.cpp's tokenizer test files (llama-cpp-python $VERSION sdist)"
"$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" -d "$work" 2> >(grep -v "is ignored: it is neither" >&2)
prefix="llama_cpp_python-$VERSION/vendor/llama.cpp/models"
members=()
for name in "${TESTED[@]}"; do
  members+=("$prefix/ggml-vocab-$name.gguf" "$prefix/ggml-vocab-$name.gguf.inp" "$prefix/ggml-vocab-$name.gguf.out")
done
for name in "${REFUSED[@]}"; do members+=("$prefix/ggml-vocab-$name.gguf"); done
tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work" "${members[@]}"
mkdir -p "$cache"
mv -f "$work/$prefix"/ggml-vocab-* "$cache/"
echo "$want" > "$cache/complete"
