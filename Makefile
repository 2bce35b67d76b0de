# miStudio: `make run` serves it on the embedded default; `make test` runs the test suite.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test worker lint format gpu-check

$(VENV)/.installed: requirements.txt requirements-dev.txt
	@command -v $(PYTHON) >/dev/null || { echo "miStudio needs Python 3.11 ($(PYTHON) not found)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

## run: install, migrate, build the demo, start web + one worker (Ctrl-C stops both)
run: $(VENV)/.installed
	$(PY) manage.py serve

## test: the whole test suite (set DATABASE_URL / REDIS_URL to test against PostgreSQL and Redis)
test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

## worker: a second worker against the same data directory (NAME=worker-2 DEVICE=cpu|cuda:N|auto,
## MAX_MEMORY=cuda:0=20GiB,cpu=64GiB with DEVICE=auto)
worker: $(VENV)/.installed
	$(PY) manage.py worker --name $(or $(NAME),worker-2) $(if $(DEVICE),--device $(DEVICE)) \
		$(if $(MAX_MEMORY),--max-memory $(MAX_MEMORY))

## gpu-check: on a machine with a CUDA device, the tests marked gpu, then bench/gpu.py (BENCH_ARGS=--quick)
gpu-check: $(VENV)/.installed
	PYTHON=$(PY) scripts/gpu-check $(BENCH_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/architecture_docs.py --check && $(PY) scripts/code_gates.py

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .
