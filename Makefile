# guards: `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
WORKERS ?= 1
# prometheus-client's multiprocess directory for `make run`: emptied at every start.
METRICS_DIR ?= .run/prometheus
# `make soak`: requests in all (split between its SQLite and Redis phases), and further options.
SOAK_REQUESTS ?= 1000000
SOAK_ARGS ?=
# `make docs`: the port the docs site is served on.
DOCS_PORT ?= 8001
# `make bench-http`: interleaved rounds (each figure is the median over them).
HTTP_ROUNDS ?= 5

.DEFAULT_GOAL := help
.PHONY: help install run test lint package-check format docs docs-build bench bench-http bench-instructions soak clean

# Variables a help text may name as $(NAME): `make help` prints their values.
HELP_VARS := HOST PORT WORKERS DOCS_PORT METRICS_DIR SOAK_REQUESTS HTTP_ROUNDS VENV PYTHON

help: ## list the targets
	@grep -hE '^[A-Za-z0-9][A-Za-z0-9_.-]*:.*## ' $(MAKEFILE_LIST) \
		| sed $(foreach v,$(HELP_VARS),-e 's|$$($(v))|$($(v))|g') \
		| awk -F':.*## ' '{printf "  make %-20s %s\n", $$1, $$2}'

# PYTHONWARNINGS=ignore: setuptools boxes a warning about every editable install.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@ $(BIN)/.app-installed

# What `make run` needs, and no more: guards with the server, and the example app's own needs.
# (--no-compile: the app compiles what it imports as it starts, not every installed module.)
$(BIN)/.app-installed: pyproject.toml app/requirements.txt
	$(PYTHON) -m venv $(VENV)
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install --quiet --no-compile -e '.[serve,redis,otel]' -r app/requirements.txt
	touch $@

install: $(BIN)/.installed ## create .venv and install guards with the app and dev tools

run: $(BIN)/.app-installed ## install what the example app needs into .venv, then serve it on $(HOST):$(PORT) (offline fake provider by default; WORKERS=n)
	rm -rf $(METRICS_DIR) && mkdir -p $(METRICS_DIR)
	PROMETHEUS_MULTIPROC_DIR=$(abspath $(METRICS_DIR)) \
		exec $(BIN)/python -m guards.serve app.main:app --host $(HOST) --port $(PORT) --workers $(WORKERS)

# Two passes: most tests spread over two processes (pytest-xdist, one file per process at a
# time; the long ones, marked slow, among them), then, one at a time, the tests that load the
# whole machine or must have it to themselves (marked stress or serial; see pyproject.toml:
# the schemathesis run is marked serial too).
ALONE := stress or serial

test: install ## run the test suite
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not ($(ALONE))"
	$(BIN)/python -m pytest -m "$(ALONE)"

lint: install ## ruff (lint and format check) and mypy (strict on guards/)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

package-check: install ## build the sdist and wheel, twine check, and test examples/triage against the wheel in a clean venv
	bash .ci/package $(abspath $(BIN)/python)

format: install ## apply ruff's fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

docs: install ## serve the docs site on http://$(HOST):$(DOCS_PORT), rebuilt on every change (mkdocs serve)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr $(HOST):$(DOCS_PORT)

docs-build: install ## build the docs site into site/, every warning an error (mkdocs build --strict)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

bench: install ## print the performance figures (name = value unit)
	PYTHONPATH=$(CURDIR) $(BIN)/python bench/bench.py

bench-http: install ## over HTTP (wrk, $(HTTP_ROUNDS) rounds, asyncio+h11 and uvloop+httptools): guarded vs bare (success, outage, capacity), 2 workers vs 1
	@command -v wrk >/dev/null || { echo "bench-http: wrk is missing; installing it: apt-get update && apt-get install -y wrk"; \
		apt-get update && apt-get install -y wrk; }
	PYTHONPATH=$(CURDIR) $(BIN)/python bench/http_bench.py --rounds $(HTTP_ROUNDS)

bench-instructions: install ## the guard pipeline's cost in CPU instructions (valgrind: deterministic)
	@command -v valgrind >/dev/null || { echo "bench-instructions: valgrind is missing; installing it: apt-get update && apt-get install -y valgrind"; \
		apt-get update && apt-get install -y valgrind; }
	PYTHONPATH=$(CURDIR) $(BIN)/python bench/instructions.py

soak: install ## $(SOAK_REQUESTS) requests against the app (4 workers on SQLite, 2 processes on Redis), a tenth of provider calls failing
	$(BIN)/python -m bench.soak --requests $(SOAK_REQUESTS) $(SOAK_ARGS)

clean: ## remove the virtualenv and caches
	rm -rf $(VENV) .run .pytest_cache .mypy_cache .ruff_cache .hypothesis
