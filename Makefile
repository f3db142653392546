# The two commands of the README. Both create .venv when it is missing and install the package:
# `make demo` the package alone, `make test` with the test extras (pytest, torch, transformers).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.installed
TEST := $(VENV)/.installed-test

.PHONY: test demo install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(BASE): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $(BASE)

$(TEST): $(BASE)
	$(BIN)/pip install -q -e '.[test,hf-test]'
	touch $(TEST)

install: $(BASE)

test: $(TEST)
	$(BIN)/python -m pytest -q -n 2 tests

demo: $(BASE)
	$(BIN)/python -m infer.demo --model=pretrained/demo

clean:
	rm -rf $(VENV) build *.egg-info
