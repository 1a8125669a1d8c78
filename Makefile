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
	$(PY) -m pip install -q -e '.[worker,test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m pipeline.cli demo

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# One pytest-xdist worker per core, at most 8 (tests/e2e own one Redis database per worker). loadgroup, as
# tests/scheduling.py makes it: tests spread one by one, the fuzz folder (whose total is counted in one
# process) whole on one worker.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 8 ? n : 8 )))

test: $(STAMP) lint
	$(PY) -m pytest -q --durations=20 -n $(TEST_WORKERS) --dist loadgroup

clean:
	rm -rf $(VENV) build *.egg-info
