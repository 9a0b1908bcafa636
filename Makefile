# Two commands on a fresh machine:  `make run`  (the main job)  and  `make test`.
# `make run` installs the runtime only; `make test` adds the test extras (torch, transformers, ...).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
TESTENV := $(VENV)/.installed-test
NOTEBOOKENV := $(VENV)/.installed-notebooks
# day-to-day: model parity, kernels, pages, the snapshot store, the engine, the server (a few minutes)
QUICK_TESTS := tests/test_model.py tests/test_delta_rule.py tests/test_pages.py tests/test_prefix_cache.py \
               tests/test_engine.py tests/test_server.py

.PHONY: run test test-quick notebooks install install-test clean

$(RUNTIME): pyproject.toml setup.py hybridjax/cpu_kernels/matmul.cc
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# jax first: the C++ extension (hybridjax/cpu_kernels) compiles against jaxlib's FFI headers;
	# building in this venv skips an isolated build env with a jax of its own (~25 s)
	$(BIN)/pip install --quiet "setuptools>=68" "jax>=0.10,<0.11" "jaxlib>=0.10,<0.11"
	$(BIN)/pip install --quiet --no-build-isolation -e .
	touch $(RUNTIME)

$(TESTENV): $(RUNTIME)
	# torch first, pinned to the CPU wheel on disk, so nothing later asks for a CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet --no-build-isolation -e '.[test]'
	touch $(TESTENV)

$(NOTEBOOKENV): $(RUNTIME)
	$(BIN)/pip install --quiet --no-build-isolation -e '.[notebooks]'
	touch $(NOTEBOOKENV)

install: $(RUNTIME)

install-test: $(TESTENV)

# The main job: the OpenAI-compatible server on http://127.0.0.1:8000, serving the embedded
# default model (shipped in hybridjax/default_model/weights). MODEL=dir serves another model.
run: $(RUNTIME)
	$(BIN)/hybridjax serve $(if $(MODEL),--model $(MODEL))

test: $(TESTENV)
	$(BIN)/python -m pytest -q tests

test-quick: $(TESTENV)
	$(BIN)/python -m pytest -q -x $(QUICK_TESTS)

# Runs every notebook top to bottom and stores its outputs in place (no Jupyter needed). To open
# them interactively: .venv/bin/pip install jupyterlab && .venv/bin/jupyter lab notebooks/
notebooks: $(NOTEBOOKENV)
	$(BIN)/python notebooks/execute.py notebooks/*.ipynb

clean:
	rm -rf $(VENV) .pytest_cache
