# The two commands a new user needs: `make serve` and `make test`. Both set everything up first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test serve bench clean

setup:
	@bash scripts/setup.sh

test: setup
	$(PY) -m pytest

serve: setup
	$(VENV)/bin/dynctl generate "Write a haiku about distributed systems."

bench: setup
	$(PY) -m benchmarks.engine --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis benchmarks/results
