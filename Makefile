# Two commands on a fresh machine:  `make run`  (the main job)  and  `make test`.
# `make run` installs the runtime only; `make test` adds the test extras (torch, transformers, ...).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
RUNTIME := $(VENV)/.installed-runtime
TESTENV := $(VENV)/.installed-test

.PHONY: run test install install-test clean

$(RUNTIME): pyproject.toml setup.py hybridjax/cpu_kernels/matmul.cc
	@echo "make: installing the runtime into $(VENV) (first time only, about a minute)"
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

install: $(RUNTIME)

install-test: $(TESTENV)

# The main job: the OpenAI-compatible server on http://127.0.0.1:8000, serving the embedded
# default model (shipped in hybridjax/default_model/weights). MODEL=dir serves another model.
# It says what it does: loading, compiling n/N (a first run; later runs load the compiled
# programs), ready; its last line at start-up is the URL, printed once the server answers.
run: $(RUNTIME)
	@echo "make: starting the server (a first run compiles for a while; later runs are ready in seconds)"
	$(BIN)/hybridjax serve $(if $(MODEL),--model $(MODEL))

test: $(TESTENV)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
