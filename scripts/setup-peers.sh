#!/usr/bin/env bash
# Idempotent set-up of the peer systems the benchmarks compare against, in their own virtualenv
# (.venv-peers, git-ignored): they pin their own web stacks, which must not leak into dynserve's .venv.
# Now: sglang-router 0.3.2 (benchmarks/routing.py). Re-running it does nothing when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PEERS_VENV:-.venv-peers}
PYTHON=${PYTHON:-python3}
SGLANG_ROUTER=sglang-router==0.3.2

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
stamp="$VENV/.dynserve-peers"
want=$(sha256sum scripts/setup-peers.sh | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ ! -x "$VENV/bin/sglang-router" ]; then
  echo "setup-peers: installing $SGLANG_ROUTER into $VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$SGLANG_ROUTER"
  echo "$want" > "$stamp"
fi
echo "setup-peers: ready ($VENV)"
