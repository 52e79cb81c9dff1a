"""benchmarks/memory_table.py's framework-agent row: the SQL recipe's LangGraph agent through fit on the tiny
model with many runners, its memory read by /usr/bin/time and per step; it guards against a climb across steps
(garbage of finished rollouts, frameworks' per-rollout clients: about 15 MB a step here before they were freed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_langgraph_agent_with_32_runners_does_not_climb_across_steps(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/memory_table.py", "--model", "tiny", "--agent", "langgraph"]
        + ["--runners", "32", "--steps", "8", "--test", "4", "--out", str(tmp_path / "run")]
        + ["--results-dir", str(tmp_path / "results")],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (path,) = (tmp_path / "results" / "memory_table").glob("*-tiny-langgraph-32-runners-fp32.json")
    (row,) = json.loads(path.read_text())["runs"]
    assert row["precision"] == "fp32"  # the suite's "auto" (tests/conftest.py), as the run resolved it
    assert len(row["step_peaks_gb"]) == 9  # step 0 (validations), then the 8 GRPO steps
    assert 0.3 < row["peak_rss_gb"] < 2.0 and row["peak_rss_gb"] >= max(row["step_peaks_gb"]) - 0.01, row
    # 8 steps of 8 rollouts; the climb was 0.11-0.13 GB before, 0.02-0.03 GB after
    assert row["climb_gb"] < 0.06, row
