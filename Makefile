# One command to set up and serve, one to set up and test. Both work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
MODEL ?= default
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

.PHONY: setup serve test lint typecheck bench clean ci-tools

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: a bare `torch` requirement would otherwise pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# System tools the deploy/ and page tests drive (Debian packages): headless Chromium for
# /dashboard, Prometheus and promtool for the alert rules, kubectl (kustomize) where the machine
# has it. Their tests skip, saying why, where a tool is absent; CI (root, apt reachable) installs
# them here. Only what is missing is installed.
ci-tools:
	@missing=""; command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v prometheus >/dev/null && command -v promtool >/dev/null || missing="$$missing prometheus"; \
	command -v kubectl >/dev/null || missing="$$missing kubectl"; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
		else echo "ci-tools: not root or no apt-get; tests needing$$missing will skip"; fi; \
	fi

serve: setup
	$(VENV)/bin/ballast serve --model $(MODEL) --host $(HOST) --port $(PORT)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy ballast memory models engine scheduler server bench

# Two workers for all but the timing-sensitive tests, which then run alone (pyproject's `serial`).
test: lint
	$(PY) -m pytest -q -n 2 -m "not serial" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: PYTEST_ARGS chose none of them

bench: setup
	$(PY) -m ballast.bench.memory_costs

clean:
	rm -rf $(VENV) build dist *.egg-info
