# otelprof: `make demo` and `make test` work on a fresh machine (Python 3.10+, Go, npm, apt).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The venv is reinstalled when what the install builds changes (the C hot path included).
INSTALL_INPUTS := pyproject.toml setup.py otelprof/_timings/_speedups.c \
  otelprof/_timings/_cpython_compat.h
STAMP := $(VENV)/.installed-$(shell cat $(INSTALL_INPUTS) | sha256sum | cut -c1-12)
PYTEST_ARGS ?=
# Tests of the recorder that `make test` runs a second time with OTELPROF_PURE_PYTHON=1: the
# Python hot path is the reference, and what runs where the C extension could not be built.
PURE_PYTHON_TESTS := tests/test_timings_*.py tests/test_trace_sampling.py \
  tests/test_on_thread_sampler.py tests/test_overhead_telemetry.py tests/test_anomaly_capture.py \
  tests/test_profiler.py
DEMO_ARGS ?=
# test-fast's worker processes (pytest-xdist): one per core of the 2-core development VM
FAST_WORKERS ?= 2
# make test's worker processes for the main pass (pytest-xdist; 0: all in pytest's own process)
TEST_WORKERS ?= 2

.PHONY: venv demo test test-fast docs collector prometheus shellcheck traceql-grammar lint bench bench-scale gpu-bundle gpu-check dashboards-png clean

venv: $(STAMP)

$(STAMP): $(INSTALL_INPUTS)
	@echo "make venv: creating $(VENV) and installing otelprof with PyTorch and the dev tools" \
	  "(several minutes and a few GB on a fresh machine; pip shows each package below)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install --progress-bar on -e '.[torch,dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@
	@echo "make venv: $(VENV) is ready"

## demo: train a small PyTorch model for ~30 s in detached mode and print the report
demo: venv
	$(VENV)/bin/otelprof demo $(DEMO_ARGS)

## collector: build otelcol-otelprof from collector-config/builder-config.yaml (cached)
collector:
	@scripts/build-collector.sh

## prometheus: install Debian's prometheus package when it is missing
prometheus:
	@command -v prometheus >/dev/null 2>&1 || { \
	  echo "installing Debian's prometheus package" >&2; \
	  apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >&2; }
	@command -v prometheus

## shellcheck: install Debian's shellcheck when it is missing (checks deploy/slurm/'s script)
shellcheck:
	@command -v shellcheck >/dev/null 2>&1 || { \
	  echo "installing Debian's shellcheck package" >&2; \
	  apt-get update -q >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q shellcheck >&2; }
	@command -v shellcheck

## traceql-grammar: Grafana's TraceQL parser from npm (cached), to check the docs' TraceQL queries
traceql-grammar:
	@scripts/traceql-grammar.sh

## test: set everything up and run the whole suite against the real collector and Prometheus
test: venv collector prometheus shellcheck traceql-grammar
	OTELPROF_COLLECTOR="$$(scripts/build-collector.sh | tail -n 1)" \
	OTELPROF_TRACEQL_GRAMMAR="$$(scripts/traceql-grammar.sh | tail -n 1)" \
	  $(VENV)/bin/pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)
	@echo "== the recorder's tests again on the pure-Python hot path (no C extension)"
	OTELPROF_COLLECTOR="$$(scripts/build-collector.sh | tail -n 1)" OTELPROF_PURE_PYTHON=1 \
	  $(VENV)/bin/pytest -q $(PURE_PYTHON_TESTS)

## test-fast: the unit and recorder tests, no collector, Prometheus or other process, on
## FAST_WORKERS processes (`pytest --fast`: tests/conftest.py marks the rest e2e or slow)
test-fast: venv
	$(VENV)/bin/pytest --fast -q -n $(FAST_WORKERS) $(PYTEST_ARGS)

## docs: the documentation site into site/ (strict: a broken link, page or snippet fails)
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: venv
	$(VENV)/bin/ruff check otelprof tests bench prometheus scripts docs/hooks
	$(VENV)/bin/ruff format --check otelprof tests bench prometheus scripts docs/hooks
	$(VENV)/bin/mypy

## bench: run the benchmarks (figures go to BENCHMARKS.md)
bench: venv
	@for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

## bench-scale: issue #25's figures at 64-1,024 ranks (about 1.5 h; 24 GB of temporary
## run files: set TMPDIR to a file system with room, or one that compresses)
bench-scale: venv collector
	$(PY) bench/scale_live.py
	$(PY) bench/scale_report.py --trace

## gpu-bundle: gpu-bundle/, what a lent GPU machine lacks to run scripts/gpu-check with no
## package index (docs/DEVELOPING.md says how to run it there in one call)
gpu-bundle: venv
	$(PY) scripts/gpu_bundle.py gpu-bundle

## gpu-check: on the GPU machine, with its own python3: scripts/gpu-check (needs gpu-bundle/)
gpu-check:
	scripts/gpu-check

## dashboards-png: render the dashboards' main panels from a real pipeline run to out/dashboards/
dashboards-png: venv collector prometheus
	OTELPROF_COLLECTOR="$$(scripts/build-collector.sh | tail -n 1)" \
	  $(PY) scripts/render_dashboards.py --out out/dashboards

clean:
	rm -rf $(VENV) otelprof-runs out site .pytest_cache .mypy_cache .ruff_cache
