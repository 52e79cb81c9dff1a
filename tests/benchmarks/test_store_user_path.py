"""benchmarks/store_user_path.py at a small size: agl's side stores every OTel span and reward it made.

agentlightning's side runs where ``scripts/setup_agentlightning.sh`` made ``.venv-agentlightning`` (``make
test`` does; it installs from PyPI); without it the benchmark refuses the flag and says how to get it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "store_user_path.py"
AGENTLIGHTNING_PYTHON = ROOT / ".venv-agentlightning" / "bin" / "python"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tasks",
            "24",
            "--runners",
            "4",
            "--processes",
            "2",
            "--no-save",
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(300)
def test_every_otel_span_and_reward_reaches_the_store() -> None:
    proc = _bench("--backend", "sqlite")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run, summary = (json.loads(line) for line in proc.stdout.splitlines())
    assert run["side"] == "agl" and run["tasks"] == 24
    assert run["otel_spans"] >= 24 * 4  # 1 to 6 rounds of 3 spans, and a final span, per rollout
    assert run["stored_spans"] == run["otel_spans"] + 24  # and one reward span each
    assert run["runner_cpu_ms_per_otel_span"] > run["agent_own_cpu_ms_per_otel_span"] > 0
    assert summary["median_rollouts_per_s"] == run["rollouts_per_s"] > 0
    assert "vs_agentlightning_same_run" not in summary


def test_agentlightning_without_its_interpreter_names_the_setup_script(tmp_path: Path) -> None:
    proc = _bench("--agentlightning", "--agentlightning-python", str(tmp_path / "absent" / "python"))
    assert proc.returncode == 2
    assert "scripts/setup_agentlightning.sh" in proc.stderr


@pytest.mark.timeout(600)
@pytest.mark.optional_dependency("agentlightning")
def test_both_sides_run_the_same_agent_work() -> None:
    if not AGENTLIGHTNING_PYTHON.exists():
        pytest.skip(
            "no .venv-agentlightning: run `bash scripts/setup_agentlightning.sh` (it installs from PyPI)"
        )
    # smaller than the agl-only run: agentlightning's side is mostly its processes' imports, ~10 s each
    proc = _bench("--agentlightning", "--tasks", "8", "--runners", "2", "--processes", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, theirs, summary = (json.loads(line) for line in proc.stdout.splitlines())
    assert (ours["side"], theirs["side"]) == ("agl", "agentlightning 0.3.0")
    assert ours["otel_spans"] == theirs["otel_spans"]  # the same rounds for the same tasks
    assert ours["stored_spans"] == theirs["stored_spans"]  # and neither lost a span
    assert summary["vs_agentlightning_same_run"] == round(
        ours["rollouts_per_s"] / theirs["rollouts_per_s"], 2
    )
