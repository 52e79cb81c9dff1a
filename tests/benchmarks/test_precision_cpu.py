"""benchmarks/precision_cpu.py on the tiny model: both precisions timed, log-prob gaps measured, bad input refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "precision_cpu.py"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_the_benchmark_times_both_precisions_and_measures_the_logprob_gap(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    small = ["--model", "tiny", "--repeats", "1", "--batch", "2", "--length", "16", "--new-tokens", "6"]
    run = _bench(*small, "--json", str(out), "--results-dir", str(tmp_path))
    assert run.returncode == 0, run.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    for key in ("update", "update_ckpt", "generate_tok_per_s"):
        assert row[key]["fp32"] > 0 and row[key]["bf16"] > 0 and row[key]["speedup"] > 0
    gaps = row["logprob_diff"]
    assert 0 < gaps["trainer_bf16_vs_fp32_mean"] < 0.5  # bf16 ran, and stayed near fp32
    assert 0 <= gaps["engine_bf16_vs_trainer_bf16_mean"] < 0.05


def test_a_bad_size_is_named() -> None:
    run = _bench("--model", "tiny", "--repeats", "0", "--no-save")
    assert run.returncode == 2 and "--repeats must be >= 1, got 0" in run.stderr
