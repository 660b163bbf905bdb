# `make demo` and `make test` set everything up on a fresh machine: .venv, torch (CPU build from the
# local disk where pip's constraints point at it), the project with its test extras.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.r3trace-installed
PYTEST_ARGS ?= -m "not gpu and not slow"
# one worker per core (pytest-xdist), each file's tests on one worker: module-scoped fixtures (checkpoints, engines,
# tests/bench/test_smoke.py's pool of scripts) are built once as in a serial run, session-scoped ones once a worker
XDIST ?= -n auto --dist loadfile

.PHONY: setup demo test test-all lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 resolves to the local CPU wheel; an open range would fetch a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m r3trace.demo

# The `pytest` script, not `python -m pytest` (which puts the checkout first on sys.path: pyproject's addopts say why).
# Kernels run in Triton's interpreter on CPU; the dashboard's browser test needs Debian's chromium
# (installed when missing, as root; the test skips and says why if that fails).
test: $(STAMP)
	bash tests/dashboard/ensure_chromium.sh
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q $(XDIST) $(PYTEST_ARGS)

test-all: $(STAMP)
	bash tests/dashboard/ensure_chromium.sh
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q $(XDIST)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy r3trace engine kernels dashboards bench  # tests/: ruff only (shared helpers live in bench/)

clean:
	rm -rf $(VENV) build *.egg-info
