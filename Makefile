# The two commands a new user needs: `make serve` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python
# What `make test-fast` leaves out: every test that needs one of these (markers come from the fixtures a
# test reaches: tests/conftest.py; docs/testing.md lists them).
HEAVY := model or ray or fleet or services or netns or install or fuzz or peers or models
# Python caches each module's bytecode on first import (setup installs with --no-compile): a shell that sets
# PYTHONDONTWRITEBYTECODE would have every process (each Ray worker, each dynctl) compile ray, torch and
# dynserve from source again, about 15 s a process start on this machine
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup test test-fast test-peers test-models test-gpu serve bench clean

setup:
	@bash scripts/setup.sh

# the whole suite, on two workers: the slowest files first (tests/conftest.py), each file on one worker
test: setup
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not peers and not models"

# the tests against peer systems in their own venvs (vLLM's CPU build: a few minutes to set up the first time)
test-peers: setup
	bash scripts/setup-peers.sh vllm
	$(PY) -m pytest -m peers -s

# the real models other than the default (Gemma 3 270M GGUF): parity with transformers, dynctl serve
test-models: setup
	$(PY) -m pytest -m models -rP

# the built-in engine on a CUDA device, its kernels compiled (they skip without one; scripts/gpu-run.sh runs
# them with the benchmark on a machine without this venv)
test-gpu: setup
	TRITON_INTERPRET=0 $(PY) -m pytest -m gpu tests/test_gpu.py -rP

# everything that needs none of the heavy parts, in about a minute
test-fast: setup
	$(PY) -m pytest -m "not ($(HEAVY))"

serve: setup
	$(VENV)/bin/dynctl serve

bench: setup
	$(PY) -m benchmarks.engine --quick
	$(PY) -m benchmarks.gateway --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis benchmarks/results
