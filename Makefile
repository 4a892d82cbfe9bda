# The two commands a new user needs: `make serve` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test serve bench clean

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest

serve: setup
	$(VENV)/bin/dynctl serve

bench: setup
	$(PY) -m benchmarks.engine --quick
	$(PY) -m benchmarks.gateway --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis benchmarks/results
