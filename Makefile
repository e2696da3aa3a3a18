# Fresh machine: `make run` (install what serving needs, serve the embedded default model on
# http://127.0.0.1:8000/v1), `make test` (that plus the test extra, then the suite).
# The steps, their timings and what a failed one means: scripts/install.py.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
INSTALL := $(PY) scripts/install.py --venv $(VENV)

.PHONY: setup run test bench format clients

setup: $(VENV)/.installed-serve

# CPU torch, ember's runtime dependencies, its C++ kernels, the default model and its compiled graphs
$(VENV)/.installed-serve: pyproject.toml setup.py scripts/install.py
	$(INSTALL) serve

# the test extra on top (llama-cpp-python compiles llama.cpp: minutes)
$(VENV)/.installed-test: $(VENV)/.installed-serve
	$(INSTALL) test

# the bench extra on top (the llama.cpp peer)
$(VENV)/.installed-bench: $(VENV)/.installed-serve
	$(INSTALL) bench

# the agent CLIs tests/scripts/test_agent_clients.py runs against ember (Claude Code, Codex), pinned, from
# npm into .clients/ (~660 MB); without npm the test says it cannot run, and why
.clients/.installed: scripts/agent_clients.py
	@if command -v npm > /dev/null; then $(PY) scripts/agent_clients.py --install && touch $@; \
	else echo "npm not found: the agent CLI check (scripts/agent_clients.py) cannot run here"; fi

clients: .clients/.installed

run: $(VENV)/.installed-serve
	$(BIN)/ember serve

test: $(VENV)/.installed-test .clients/.installed
	$(BIN)/pytest -q -n 2 --dist loadfile

bench: $(VENV)/.installed-bench
	$(BIN)/ember bench latency
	$(BIN)/ember bench throughput
	$(BIN)/ember bench serve --launch --max-num-seqs 32

# ruff's format and import sorting (pyproject.toml [tool.ruff]); tests/test_formatting.py checks both
format: $(VENV)/.installed-test
	$(BIN)/ruff check --fix ember tests scripts setup.py
	$(BIN)/ruff format ember tests scripts setup.py
