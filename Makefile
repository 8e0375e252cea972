# Every target bootstraps itself: .venv, pinned dependencies and the default model are made if missing.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvyard-installed
MODEL ?= smollm2-135m
PROMPT ?= Explain in two sentences what a KV cache is.
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: test serve generate lint model bench clean

$(PY):
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)

# torch first, pinned to the CPU build on this disk, so nothing later pulls a CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

model: $(STAMP)
	$(VENV)/bin/kvyard fetch $(MODEL)

lint: $(STAMP)
	$(VENV)/bin/ruff check kvyard tests

test: $(STAMP) model lint
	$(PY) -m pytest -q

serve: $(STAMP) model
	$(VENV)/bin/kvyard serve --model $(MODEL) --host $(HOST) --port $(PORT)

generate: $(STAMP) model
	$(VENV)/bin/kvyard generate --model $(MODEL) "$(PROMPT)"

bench: $(STAMP) model
	$(VENV)/bin/kvyard bench offline --model $(MODEL) --peers hf

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
