# The two commands of the README. Both create .venv when it is missing and install the package:
# `make demo` the package alone, `make test` with the test extras (pytest, torch, transformers).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.installed
TEST := $(VENV)/.installed-test

.PHONY: test test-slow demo install clean

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

# `make test` leaves out the tests marked slow (about 13 minutes on 2 cores); CI runs both.
test: $(TEST)
	$(BIN)/python -m pytest -q -n 2 -m 'not slow' tests

test-slow: $(TEST)
	$(BIN)/python -m pytest -q -n 2 -m slow tests

demo: $(BASE)
	$(BIN)/python -m infer.demo --model=pretrained/demo

clean:
	rm -rf $(VENV) build *.egg-info
