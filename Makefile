# The two commands of the README. Both create .venv when it is missing and install the package.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

demo: $(STAMP)
	$(BIN)/python -m infer.demo --model=pretrained/demo

clean:
	rm -rf $(VENV) build *.egg-info
