"""``scripts/gpu_smoke.py`` refuses to run without a GPU unless ``--allow-cpu``; then it runs its GRPO loop, a
bf16 step and an FSDP2 step on the CPU, says so, and reports tokens/s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_smoke_script_runs_on_cpu_with_a_warning() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["--model", "tiny", "--steps", "2", "--tasks-per-step", "2", "--group-size", "4", "--runners", "8"]
    args += ["--allow-cpu", "--train-samples", "4", "--train-tokens", "64", "--train-steps", "1"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no CUDA device" in proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["device"] == "cpu" and report["steps"] == 2
    assert report["generated_tokens"] > 0 and report["generation_tokens_per_s"] > 0
    assert report["trained_steps"] >= 1 and report["training_tokens_per_s"] > 0
    assert len(report["rewards"]) == 2
    # a policy step under bf16 autocast, and one sharded by FSDP2 (one gloo rank)
    for part in ("bf16", "fsdp"):
        assert report[part]["steps"] == 1 and report[part]["tokens_per_s"] > 0, report[part]
    assert report["fsdp"]["ranks"] == 1 and report["fsdp"]["shard_gib_per_rank"][0] > 0


def test_gpu_smoke_script_refuses_to_run_without_a_gpu() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--model", "tiny"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode != 0
    assert "no CUDA device visible" in proc.stderr and "--allow-cpu" in proc.stderr
    assert proc.stdout.strip() == ""  # no figures printed


def test_gpu_smoke_script_rejects_an_unknown_model() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_smoke.py"), "--model", "no-such-model"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode != 0
    assert "--model must be tiny, smollm2 or a local model folder" in proc.stderr
