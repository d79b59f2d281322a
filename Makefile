# One entry point. Every target does the set-up it needs on a fresh Debian 12 machine as root, idempotently.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

# Debian's interpreter when there is one: Airflow runs as an unprivileged service user, which cannot run a venv
# whose interpreter lives under /root (pyenv).
PYTHON ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
VENV := .venv
SERVING_VENV := .venv-serving
MLFLOW_VENV := .venv-mlflow
PY := $(VENV)/bin/python
STACK := $(PYTHON) scripts/localstack.py
PYTEST_ARGS ?=
BENCH ?=

.PHONY: help system-deps venv venv-interpreter up down status demo test test-serial test-unit test-integration bench lint clean

help:
	@echo "make demo    run the whole nightly pipeline on the local stack (sets everything up)"
	@echo "make test    run the test suite (sets everything up)"
	@echo "make up | down | status    the local stack of real services on 127.0.0.1"
	@echo "make bench [BENCH=name]    run the benchmarks (all, or one)"

# Python's venv module and a JDK for Spark; Debian's python3 lacks ensurepip without python3-venv.
system-deps:
	@if ! $(PYTHON) -c 'import ensurepip, venv' 2>/dev/null || ! command -v java >/dev/null; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
			python3-venv python3-dev openjdk-17-jre-headless make git; \
	fi

venv: system-deps venv-interpreter $(VENV)/.installed $(SERVING_VENV)/.installed $(MLFLOW_VENV)/.installed

# A venv built by an older version from another interpreter is built again from $(PYTHON).
venv-interpreter:
	@home=$$(dirname "$$(readlink -f "$$(command -v $(PYTHON))")"); \
	if [ -f $(VENV)/pyvenv.cfg ] && ! grep -qx "home = $$home" $(VENV)/pyvenv.cfg; then \
		echo "$(VENV) was built from another interpreter; building it again from $(PYTHON)"; rm -rf $(VENV); \
	fi

# torch first: the CPU build on local disk; the later resolve then keeps it instead of pulling a CUDA build.
# pyspark last: the Spark provider's pyspark-client overwrites pyspark's files with older ones (shared/notes).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --force-reinstall --no-deps pyspark==4.3.0
	$(PY) -m pip check
	touch $@

# Triton's bundled server and python backend need numpy<2, which Airflow's environment cannot have.
$(SERVING_VENV)/.installed: include/serving/requirements.txt
	test -x $(SERVING_VENV)/bin/python || $(PYTHON) -m venv $(SERVING_VENV)
	$(SERVING_VENV)/bin/python -m pip install -q --disable-pip-version-check -r include/serving/requirements.txt
	touch $@

# The MLflow tracking server pulls numpy 2.x, which Airflow's environment cannot have. Every package is pinned in the
# file (--no-deps installs exactly that set); its own user runs it, so it is built from $(PYTHON) like the others.
$(MLFLOW_VENV)/.installed: include/mlflow/requirements.txt
	test -x $(MLFLOW_VENV)/bin/python || $(PYTHON) -m venv $(MLFLOW_VENV)
	$(MLFLOW_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -r include/mlflow/requirements.txt
	$(MLFLOW_VENV)/bin/python -m pip check
	touch $@

up: venv
	$(STACK) up

down:
	$(STACK) down

status:
	$(STACK) status

demo: up
	$(PY) scripts/demo.py

# The whole suite in lanes that run side by side (scripts/test_lanes.py says which run beside which).
test: up
	$(PY) scripts/test_lanes.py $(PYTEST_ARGS)

# The same tests in one pytest process, one after another.
test-serial: up
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: venv
	$(PY) -m pytest tests/unit tests/dags $(PYTEST_ARGS)

bench: up
	$(PY) benchmarks/run.py $(BENCH)

lint: venv
	$(PY) -m pip install -q ruff
	$(VENV)/bin/ruff check plugins dags jobs tests benchmarks scripts

clean: down
	rm -rf .state
