# One command to set up and serve, one to set up and test. Both work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
MODEL ?= default
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: setup serve test lint typecheck bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

serve: setup
	$(VENV)/bin/ballast serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy ballast memory models engine scheduler server bench

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(PY) -m ballast.bench.memory_costs

clean:
	rm -rf $(VENV) build dist *.egg-info
