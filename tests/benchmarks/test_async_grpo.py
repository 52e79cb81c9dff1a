"""benchmarks/async_grpo.py: sync and async GRPO side by side on the tiny model, and ``--pin``'s refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.async_grpo import pin_cores

ROOT = Path(__file__).resolve().parents[2]


def test_pin_needs_an_engine_in_its_own_process() -> None:
    before = os.sched_getaffinity(0)
    with pytest.raises(SystemExit, match="--pin needs --engine vllm"):
        pin_cores("builtin")
    assert os.sched_getaffinity(0) == before  # refused before touching this process


@pytest.mark.timeout(300)
def test_sync_and_async_rows_on_the_tiny_model(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/async_grpo.py", "--steps", "2", "--runners", "8"]
        + ["--group-size", "4", "--tasks-per-step", "2", "--results-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (path,) = (tmp_path / "async_grpo").glob("*-tiny.json")
    record = json.loads(path.read_text())
    sync, asynchronous = record["runs"]
    assert sync["mode"] == "sync" and asynchronous["mode"].startswith("async")
    for row in (sync, asynchronous):
        assert row["engine"] == "builtin" and row["pinned"] is False
        assert row["rollouts_per_s"] > 0 and row["cpu_s"] > 0 and 0 <= row["idle_share"] <= 1
    assert record["summary"]["step_time_ratio_sync_over_async"] == record["values"][0] > 0
