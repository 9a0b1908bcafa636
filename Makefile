# Two commands on a fresh machine:  `make run`  (the main job)  and  `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned to the CPU wheel on disk, so nothing later asks for a CUDA build
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job: the OpenAI-compatible server on http://127.0.0.1:8000, serving the embedded
# default model (tiny, built deterministically on first use). MODEL=dir serves another model.
run: $(STAMP)
	$(BIN)/hybridjax serve $(if $(MODEL),--model $(MODEL))

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
