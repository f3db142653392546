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
	$(BIN)/pip install -q -e '.[test,hf-test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests

demo: $(STAMP)
	mkdir -p out && rm -f out/demo.jsonl
	$(BIN)/mtp-infer --model=pretrained/demo --input=infer/demo_prompts.jsonl --output=out/demo.jsonl --max_new_tokens=96
	$(BIN)/python -m infer.demo --model=pretrained/demo

clean:
	rm -rf $(VENV) build *.egg-info
