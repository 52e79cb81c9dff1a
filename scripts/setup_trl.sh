#!/usr/bin/env bash
# Create .venv-trl: TRL and datasets for benchmarks/grpo_vs_trl.py, kept apart so they never move .venv's
# torch or transformers. Pins: the exact versions the benchmark was tested with; transformers and accelerate
# match .venv's, so both sides run the same model code. Idempotent: a stamp marks a finished, verified install.
#   usage: scripts/setup_trl.sh [--force]     env: AGL_TRL_VENV (target), PYTHON (base interpreter)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${AGL_TRL_VENV:-$ROOT/.venv-trl}"
PYTHON="${PYTHON:-python3}"
# torch pinned exactly: a loose torch pulls a multi-GB CUDA wheel; 2.13.0 is the local +cpu wheel, as in .venv
PINS=(torch==2.13.0 trl==1.16.0 datasets==5.2.0 transformers==5.25.0 accelerate==1.16.0)
STAMP="$VENV/.agl-trl-setup"
WANT="${PINS[*]}"

fail() { echo "setup_trl.sh: FAILED: $*" >&2; exit 1; }
trap 'fail "command \"$BASH_COMMAND\" exited with $? (line $LINENO); rerun with --force after fixing"' ERR

if [[ "${1:-}" == "--force" ]]; then rm -f "$STAMP"; fi
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" && -x "$VENV/bin/python" ]]; then
    echo "setup_trl.sh: $VENV already complete ($WANT); nothing to do"
    exit 0
fi

start=$(date +%s)
command -v "$PYTHON" >/dev/null || fail "base interpreter '$PYTHON' not found; set PYTHON=/path/to/python3.11"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "setup_trl.sh: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
echo '*' > "$VENV/.gitignore"  # git never sees the venv, wherever it lies in the work tree
pip_install() {  # minus the per-package warnings about this machine's empty file:// index folders
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2 || true)
}
echo "setup_trl.sh: installing ${PINS[0]} first, then the rest (~1-2 min)"
pip_install "${PINS[0]}"
pip_install "${PINS[@]}"

"$VENV/bin/python" - "${PINS[@]}" <<'PY' || fail "trl does not import in $VENV, or a pin did not hold (see above)"
import importlib.metadata as md
import sys

from trl import GRPOConfig, GRPOTrainer  # noqa: F401  (what benchmarks/_trl_side.py uses)

for pin in sys.argv[1:]:
    name, version = pin.split("==")
    got = md.version(name)
    assert got.split("+")[0] == version, f"{name} {got} installed, {version} pinned"
print("setup_trl.sh:", ", ".join(f"{p.split('==')[0]} {md.version(p.split('==')[0])}" for p in sys.argv[1:]))
PY
echo "$WANT" > "$STAMP"
echo "setup_trl.sh: done in $(( $(date +%s) - start ))s; benchmarks/grpo_vs_trl.py finds $VENV/bin/python"
