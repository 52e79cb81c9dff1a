#!/usr/bin/env bash
# Create .venv-trl: TRL and datasets for benchmarks/grpo_vs_trl.py, kept apart so they never move .venv's
# torch or transformers. Pins: the exact versions the benchmark was tested with; transformers and accelerate
# match .venv's, so both sides run the same model code. Idempotent (scripts/side_venv.sh).
#   usage: scripts/setup_trl.sh [--force]     env: AGL_TRL_VENV (target), PYTHON (base interpreter)
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/side_venv.sh"
VENV="${AGL_TRL_VENV:-$ROOT/.venv-trl}"
# torch pinned exactly: a loose torch pulls a multi-GB CUDA wheel; 2.13.0 is the local +cpu wheel, as in .venv
PINS=(torch==2.13.0 trl==1.16.0 datasets==5.2.0 transformers==5.25.0 accelerate==1.16.0)
side_venv_begin trl "$VENV" "${PINS[*]}" "${1:-}"

echo "setup_trl.sh: installing ${PINS[0]} first, then the rest (~1-2 min)"
side_pip "${PINS[0]}"
side_pip "${PINS[@]}"

"$VENV/bin/python" - "${PINS[@]}" <<'PY' || side_fail "trl does not import in $VENV, or a pin did not hold (see above)"
import importlib.metadata as md
import sys

from trl import GRPOConfig, GRPOTrainer  # noqa: F401  (what benchmarks/_trl_side.py uses)

for pin in sys.argv[1:]:
    name, version = pin.split("==")
    got = md.version(name)
    assert got.split("+")[0] == version, f"{name} {got} installed, {version} pinned"
print("setup_trl.sh:", ", ".join(f"{p.split('==')[0]} {md.version(p.split('==')[0])}" for p in sys.argv[1:]))
PY
side_venv_done "benchmarks/grpo_vs_trl.py finds $VENV/bin/python"
