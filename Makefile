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
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-all: setup-test
	$(BIN)/python -m pytest -q -m "" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
