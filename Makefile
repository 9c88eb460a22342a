# Two entry points for a fresh clone (see README.md):
#   make train   set up .venv, tokenize the demo corpus, run a 2-rank CPU pretraining run
#   make test    set up .venv and run the test suite
PYTHON ?= python3
VENV ?= .venv
# CPU-only machines: the CPU build. On GPU machines use e.g. TORCH='torch>=2.11'.
TORCH ?= torch==2.13.0
NPROC ?= 2
CONFIG ?= tiny_dense.yaml
DATA ?= data/pystdlib
PYTEST_ARGS ?=
# `make test` runs the suite in this many pytest-xdist workers, a whole test file to each (`--dist loadfile`: a file's
# module fixtures are made once): one a core, at most 4; 0 runs it in pytest's own process. Most of the suite is one
# thread at a time (compiling, Python start-ups), so a 2-core machine's second core idled in a serial run.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; n = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') \
	else os.cpu_count() or 1; print(min(4, n) if n > 1 else 0)")
BIN := $(VENV)/bin

.PHONY: setup setup-test train data test test-all clean
# setup: torch and megafp8, what `make train` needs; setup-test adds the test extra (pytest, transformers, ...).
setup: $(VENV)/.installed
setup-test: $(VENV)/.installed-test

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q -e ".[test]"
	touch $@

data: $(DATA)/meta.json

$(DATA)/meta.json: | $(VENV)/.installed
	$(BIN)/python tools/preprocess_data.py --input stdlib --output $(DATA) --overwrite

train: setup data
	$(BIN)/torchrun --nproc_per_node=$(NPROC) launch/pretrain.py --config $(CONFIG) data.path=$(DATA)

test: setup-test
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

test-all: setup-test
	$(BIN)/python -m pytest -q -m "" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
