#!/usr/bin/env bash
# llama.cpp's tokenizer test files (ggml-vocab-<name>.gguf, with .gguf.inp / .gguf.out for the vocabularies
# that have them) for tests/test_gguf_tokenizers.py, and some models' published chat templates (those with a
# tools section) for tests/test_tool_formats.py, taken from the llama-cpp-python sdist (test inputs only:
# dynserve never imports them). Fetched once with pip, only these files kept, in
# ${XDG_CACHE_HOME:-~/.cache}/dynserve/llama-vocab/<version>/ and .../llama-templates/<version>/; does
# nothing when they are there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VERSION=0.3.36
# with .inp/.out: the vocabularies dynserve claims (byte-level BPE, then SentencePiece); GGUF only: some it
# must refuse by name
TESTED=(command-r deepseek-coder deepseek-llm falcon gpt-2 llama-bpe mpt qwen2 qwen35 refact starcoder llama-spm phi-3)
REFUSED=(bert-bge gemma-4)
TEMPLATES=(Qwen-Qwen2.5-7B-Instruct Qwen-Qwen3-0.6B meta-llama-Llama-3.1-8B-Instruct mistralai-Mistral-Nemo-Instruct-2407)
cache="${XDG_CACHE_HOME:-$HOME/.cache}/dynserve/llama-vocab/$VERSION"
templates="${XDG_CACHE_HOME:-$HOME/.cache}/dynserve/llama-templates/$VERSION"
# `complete` lists what was extracted: a cache made for another list is filled again
want="tested: ${TESTED[*]}; refused: ${REFUSED[*]}"
want_templates="${TEMPLATES[*]}"
[ "$(cat "$cache/complete" 2>/dev/null)" = "$want" ] \
  && [ "$(cat "$templates/complete" 2>/dev/null)" = "$want_templates" ] && exit 0

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
for name in "${TEMPLATES[@]}"; do members+=("$prefix/templates/$name.jinja"); done
tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work" "${members[@]}"
mkdir -p "$cache"
mv -f "$work/$prefix"/ggml-vocab-* "$cache/"
echo "$want" > "$cache/complete"
mkdir -p "$templates"
mv -f "$work/$prefix"/templates/*.jinja "$templates/"
echo "$want_templates" > "$templates/complete"
