# Two commands on a fresh machine: `make demo` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch lies on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pipeline.cli demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: $(STAMP) lint
	$(PY) -m pytest -q --durations=20

clean:
	rm -rf $(VENV) build *.egg-info
