#!/usr/bin/env bash
# llama.cpp's HF-to-GGUF converter (convert_hf_to_gguf.py, its conversion/ package and its own gguf-py) for
# tests/_tiny_models.py, which converts random-weight tiny models with it. Taken from the llama-cpp-python
# sdist; a test and benchmark input only: dynserve never imports it, and it runs as a subprocess with
# PYTHONPATH set to its gguf-py. Fetched once with pip, only these files kept, in
# ${XDG_CACHE_HOME:-~/.cache}/dynserve/llama-convert/<version>/; does nothing when they are there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VERSION=0.3.36
cache="${XDG_CACHE_HOME:-$HOME/.cache}/dynserve/llama-convert/$VERSION"
[ -f "$cache/complete" ] && exit 0

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "setup: fetching llama.cpp's HF-to-GGUF converter (llama-cpp-python $VERSION sdist)"
"$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" -d "$work" 2> >(grep -v "is ignored: it is neither" >&2)
prefix="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar -xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work" \
  "$prefix/convert_hf_to_gguf.py" "$prefix/conversion" "$prefix/gguf-py/gguf" "$prefix/LICENSE"
mkdir -p "$(dirname "$cache")"
rm -rf "$cache"
mv "$work/$prefix" "$cache"
touch "$cache/complete"
