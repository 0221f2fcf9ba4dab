# `make serve` and `make test` do all the set-up on a fresh machine (Python 3.11, no GPU needed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup serve test test-all bench

setup: $(VENV)/.installed

# NOTE: --system-site-packages lets a GPU machine's own CUDA torch be the one used; where no torch
# is importable, the small CPU build is installed before pdserve's `torch>=2.4` resolves.
$(VENV)/.installed: pyproject.toml router/proto/pdserve.proto
	$(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	$(PY) -m router.proto.codegen
	touch $@

serve: setup
	$(VENV)/bin/pdserve serve $(ARGS)

test: setup
	$(PY) -m pytest -q -m "not gpu" --durations=15 $(ARGS)

bench: setup
	$(PY) -m bench.batching $(ARGS)
