# Two entry points (see README): `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Triton's python-backend stub links the system libpython3.11: its environment must be a venv of
# the system python3.11 (docs/triton.md). The real-server tests and examples/triton use it.
TRITON_PYTHON ?= /usr/bin/python3.11
TRITON_VENV ?= .venv-triton

.PHONY: demo test triton-env clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0

# Compile the quickstart recipe (SmolLM2-135M drafted by prompt lookup, ONNX Runtime),
# generate with speculation, and benchmark speculative vs target-only on the same prompts.
demo: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[gguf,bench]'
	$(BIN)/specc compile recipes/quickstart.yaml
	$(BIN)/specc generate bundles/quickstart --chat --stream --max-new-tokens 96 \
		--prompt "Write a Python function that checks whether a string is a palindrome."
	$(BIN)/specc bench bundles/quickstart --prompts examples/prompts/quickstart-8.jsonl \
		--max-new-tokens 64 --json bench-results/quickstart.json

# --dist loadfile: a test file's tests share one worker, so its module fixtures (compiled bundles) are built once
test: $(BIN)/python
	$(BIN)/python -m pip install -q -e '.[test]'
	# xgrammar's own dependencies include triton (about 1 GB) for its GPU kernels, which the CPU tests never load
	$(BIN)/python -m pip install -q --no-deps 'xgrammar>=0.2,<0.3'
	$(BIN)/python -m ruff check .
	-$(MAKE) --no-print-directory triton-env
	$(BIN)/python -m pytest -q -n auto --dist loadfile --durations=15

triton-env: $(TRITON_VENV)/.installed

$(TRITON_VENV)/.installed: pyproject.toml
	$(TRITON_PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q --upgrade pip
	$(TRITON_VENV)/bin/python -m pip install -q torch==2.13.0
	$(TRITON_VENV)/bin/python -m pip install -q -e '.[triton-server]'
	touch $@

clean:
	rm -rf bundles bench-results
