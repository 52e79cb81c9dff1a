#!/usr/bin/env bash
# Create .venv-agentlightning: agentlightning 0.3.0 for benchmarks/store_user_path.py --agentlightning, with
# the dependencies of its release date (2025-12-24): installed fresh today, its newer dependencies break it.
# Kept apart from .venv. Idempotent (scripts/side_venv.sh).
#   usage: scripts/setup_agentlightning.sh [--force]     env: AGL_AGENTLIGHTNING_VENV (target), PYTHON
set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/side_venv.sh"
VENV="${AGL_AGENTLIGHTNING_VENV:-$ROOT/.venv-agentlightning}"
PIN="agentlightning==0.3.0"
RELEASED="2025-12-25T00:00:00Z"  # a day after 0.3.0's upload: pip takes nothing uploaded later
side_venv_begin agentlightning "$VENV" "$PIN before $RELEASED" "${1:-}"

# PyPI itself, without this machine's pip config: --uploaded-prior-to needs the index's upload times,
# which local wheel folders lack; pip learned the option in 25.x
pypi() { PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check \
    --index-url https://pypi.org/simple "$@"; }
pypi 'pip>=26'
echo "setup_agentlightning.sh: installing $PIN with what PyPI held before $RELEASED (~1-2 min)"
pypi --uploaded-prior-to "$RELEASED" "$PIN"

"$VENV/bin/python" - <<'PY' || side_fail "agentlightning does not import in $VENV (see above)"
import importlib.metadata as md

import agentlightning  # noqa: F401  (what benchmarks/_agentlightning_side.py uses)
from agentlightning.execution.events import MultiprocessingEvent  # noqa: F401

print("setup_agentlightning.sh:", ", ".join(f"{n} {md.version(n)}" for n in ("agentlightning", "opentelemetry-sdk", "pydantic")))
PY
side_venv_done "benchmarks/store_user_path.py --agentlightning finds $VENV/bin/python"
