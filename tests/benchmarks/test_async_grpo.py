"""benchmarks/async_grpo.py: sync and async GRPO side by side on the tiny model; the pinned setup's cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from benchmarks.async_grpo import cores_for, setups_of

ROOT = Path(__file__).resolve().parents[2]


def test_setups_are_named_from_the_known_ones() -> None:
    assert setups_of("builtin, vllm-pinned") == ["builtin", "vllm-pinned"]
    with pytest.raises(SystemExit, match="--setups: \\['vllm-pined'\\] not among builtin, vllm, vllm-pinned"):
        setups_of("builtin,vllm-pined")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs two cores")
def test_the_pinned_setup_puts_every_thread_on_one_core_and_back() -> None:
    cores, threads = sorted(os.sched_getaffinity(0)), torch.get_num_threads()
    seen: list[set[int]] = []
    waiting = threading.Event()

    def later() -> None:
        waiting.wait()
        seen.append(os.sched_getaffinity(0))

    other = threading.Thread(target=later)
    other.start()  # started before pinning: moved all the same
    with cores_for("vllm-pinned") as engine_cpus:
        assert os.sched_getaffinity(0) == {cores[0]} and torch.get_num_threads() == 1
        assert engine_cpus == (str(cores[1]),)
        waiting.set()
        other.join()
    assert seen == [{cores[0]}]
    assert sorted(os.sched_getaffinity(0)) == cores and torch.get_num_threads() == threads
    with cores_for("vllm") as engine_cpus:  # shared cores: nothing moves
        assert sorted(os.sched_getaffinity(0)) == cores and engine_cpus == ()


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
    (path,) = (tmp_path / "async_grpo").glob("*-tiny-builtin.json")
    record = json.loads(path.read_text())
    sync, asynchronous = record["runs"]
    assert sync["mode"] == "sync" and asynchronous["mode"].startswith("async")
    for row in (sync, asynchronous):
        assert row["setup"] == "builtin" and row["round"] == 0
        assert row["rollouts_per_s"] > 0 and row["cpu_s"] > 0 and 0 <= row["idle_share"] <= 1
    (ratio,) = record["values"]
    assert record["summary"]["setups"]["builtin"]["step_time_ratio_sync_over_async"] == ratio > 0
