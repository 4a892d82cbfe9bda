#!/usr/bin/env bash
# The built-in engine's GPU run, in one call: the GPU tests (tests/test_gpu.py), then `benchmarks.gpu`.
# Logs, the benchmark's JSON and its PNG go under $OUT (default build/gpu-run): six files.
#
#   scripts/gpu-run.sh            # on a CUDA machine (about 5 minutes on an H100/H200)
#   scripts/gpu-run.sh --quick    # the benchmark's --quick (no launch sweep, fewer tokens)
#   scripts/gpu-run.sh --check    # anywhere: the script's syntax and the benchmark's --help
#
# A machine whose Python lacks dynserve's pure-Python dependencies gets them from wheels in .whl/
# (docs/gpu.md says which, and how to fetch them for its Python). The device's own torch, Triton and
# transformers are used as they are.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-build/gpu-run}
QUICK=""
case "${1:-}" in
  --check)
    bash -n "$0" && PYTHONPATH="$PWD" $PY -m benchmarks.gpu --help >/dev/null && echo "gpu-run: checks passed"
    exit $?
    ;;
  --quick) QUICK="--quick" ;;
  "") ;;
  *) echo "usage: $0 [--quick | --check]" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/dynserve-site \
    .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/dynserve-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'device', torch.cuda.get_device_name(0))" 2>&1 | tee "$OUT/versions.txt"

start=$SECONDS
timeout "${GPU_TESTS_TIMEOUT_S:-200}" $PY -m pytest -m gpu tests/test_gpu.py -q -rP -W default -p no:cacheprovider \
  2>&1 | tee "$OUT/gpu-tests.log"
tests=${PIPESTATUS[0]}
echo "gpu-run: tests exit $tests after $((SECONDS - start)) s"

start=$SECONDS
timeout "${GPU_BENCH_TIMEOUT_S:-270}" $PY -m benchmarks.gpu $QUICK --out "$OUT" 2>&1 | tee "$OUT/gpu-bench.log"
bench=${PIPESTATUS[0]}
echo "gpu-run: benchmark exit $bench after $((SECONDS - start)) s"
exit $(( tests != 0 || bench != 0 ))
