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
               tests/test_scheduler.py tests/test_engine.py tests/test_server.py

# The second JAX line: Python 3.12 + JAX 0.11.2, what the accelerator machines carry (pyenv's 3.12
# on this image). It installs the torch-free test extra only; tests needing torch skip there.
PYTHON312 ?= PYENV_VERSION=3.12.1 python3
VENV312 := .venv312
BIN312  := $(VENV312)/bin
JAX011  := $(VENV312)/.installed-jax011
JAX011_VERSION := 0.11.2

.PHONY: run test test-jax010 test-jax011 test-quick notebooks install install-test gpu-check gpu-check-dry-run clean

# The runtime goes in with uv where it can: one resolve, parallel downloads and unpacking, so the
# ~50 packages take seconds where pip took about a minute (benchmarks/README.md, issue 23). The
# extension then builds on one core (~25 s, the critical path) while every module's bytecode
# compiles beside it at a lower priority. Where uv is not at hand or cannot reach the index (a
# mirror only pip is set up for), pip does it all (`make install UV_INSTALL=false` forces that).
UV_INSTALL := $(BIN)/uv pip install --quiet --python $(BIN)/python
JAX010 := "jax>=0.10,<0.11" "jaxlib>=0.10,<0.11"

$(RUNTIME): pyproject.toml setup.py hybridjax/cpu_kernels/matmul.cc
	@echo "make: installing the runtime into $(VENV) (first time only, under a minute)"
	$(PYTHON) -m venv $(VENV)
	# jax before the project: the C++ extension (hybridjax/cpu_kernels) compiles against jaxlib's
	# FFI headers; building in this venv skips an isolated build env with a jax of its own (~25 s)
	if $(BIN)/pip install --quiet uv && $(UV_INSTALL) "setuptools>=68" $(JAX010) -r pyproject.toml; then \
	  nice -n 10 $(BIN)/python -m compileall -q -j0 $(VENV)/lib > /dev/null & \
	  $(UV_INSTALL) --no-deps --no-build-isolation -e .; built=$$?; wait; exit $$built; \
	else \
	  echo "make: installing with pip instead of uv (slower)"; \
	  $(BIN)/pip install --quiet --upgrade pip && \
	  $(BIN)/pip install --quiet "setuptools>=68" $(JAX010) && \
	  $(BIN)/pip install --quiet --no-build-isolation -e .; \
	fi
	touch $(RUNTIME)

$(TESTENV): $(RUNTIME)
	# torch first, pinned to the CPU wheel on disk, so nothing later asks for a CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet --no-build-isolation -e '.[test]'
	touch $(TESTENV)

$(NOTEBOOKENV): $(RUNTIME)
	$(BIN)/pip install --quiet --no-build-isolation -e '.[notebooks]'
	touch $(NOTEBOOKENV)

$(JAX011): pyproject.toml setup.py hybridjax/cpu_kernels/matmul.cc
	$(PYTHON312) -m venv $(VENV312)
	$(BIN312)/pip install --quiet --upgrade pip
	$(BIN312)/pip install --quiet "setuptools>=68" "jax==$(JAX011_VERSION)" "jaxlib==$(JAX011_VERSION)"
	$(BIN312)/pip install --quiet --no-build-isolation -e '.[test-core]'
	touch $(JAX011)

install: $(RUNTIME)

install-test: $(TESTENV)

# The main job: the OpenAI-compatible server on http://127.0.0.1:8000, serving the embedded
# default model (shipped in hybridjax/default_model/weights). MODEL=dir serves another model.
# It says what it does: loading, compiling n/N (a first run; later runs load the compiled
# programs), ready; its last line at start-up is the URL, printed once the server answers.
run: $(RUNTIME)
	@echo "make: starting the server (a first run compiles for a while; later runs are ready in seconds)"
	$(BIN)/hybridjax serve $(if $(MODEL),--model $(MODEL))

# Both JAX lines: the full suite on Python 3.11 + JAX 0.10, then the torch-free tests that catch
# JAX-version drift on Python 3.12 + JAX 0.11.
test: test-jax010 test-jax011

# One pytest worker per core, each taking whole test files (modules share compiled programs and
# servers); TEST_WORKERS=0 runs in this process.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test-jax010: $(TESTENV)
	$(BIN)/python $(PYTEST) tests

test-quick: $(TESTENV)
	$(BIN)/python -m pytest -q -x $(QUICK_TESTS)

# Runs every notebook top to bottom and stores its outputs in place (no Jupyter needed). To open
# them interactively: .venv/bin/pip install jupyterlab && .venv/bin/jupyter lab notebooks/
notebooks: $(NOTEBOOKENV)
	$(BIN)/python notebooks/execute.py notebooks/*.ipynb

# What JAX-version drift breaks: the kernels (Pallas interpret mode, CUDA lowering, Mosaic GPU),
# the delta rule's XLA paths, the default model and the engine's jitted steps, and the GPU check's
# dry run (the GPU image is this line). Not the server (pure Python over the engine) nor the
# torch/transformers parity tests (3.11 lane only): the whole `.ci/run` stays under 30 minutes.
# All torch-free tests on this line: `make test-jax011 JAX011_TESTS=tests`.
JAX011_TESTS ?= tests/test_pallas.py tests/test_paged_kernel.py tests/test_grouped_matmul.py \
	tests/test_delta_rule.py tests/test_default_model.py tests/test_scheduler.py tests/test_engine.py \
	tests/test_gpu_check.py tests/test_mosaic.py
test-jax011: $(JAX011)
	$(BIN312)/python $(PYTEST) $(JAX011_TESTS)

# On a GPU machine from a plain checkout (nothing installed): every kernel against its reference,
# kernel timings, generate and serve figures; OUT=folder for the JSON and the markdown table.
OUT ?= gpu-check
gpu-check:
	PYTHONPATH=$(CURDIR) python3 benchmarks/gpu_check.py $(OUT)

gpu-check-dry-run:
	PYTHONPATH=$(CURDIR) $(BIN)/python benchmarks/gpu_check.py --dry-run $(OUT)

clean:
	rm -rf $(VENV) $(VENV312) .pytest_cache
