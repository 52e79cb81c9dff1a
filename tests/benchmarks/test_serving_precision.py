"""benchmarks/serving_precision.py: a fit run's saved model scored when served in fp32 and in bf16, and a
``--runs`` argument that is not PRECISION:DIR refused with what to give."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from agl.models import tiny_model

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "serving_precision.py"


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_a_saved_model_is_scored_in_both_serving_precisions(tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tiny_model(seed=0), run / "model")
    summary = {"seed": 3, "grpo_steps": 2, "val_accuracy_after_sft": 0.0, "val_accuracy_after": 0.125}
    (run / "summary.json").write_text(json.dumps(summary))
    done = _bench("--runs", f"bf16:{run}", "--model", "tiny", "--results-dir", str(tmp_path / "res"))
    assert done.returncode == 0, done.stderr[-2000:]
    [path] = (tmp_path / "res" / "serving_precision").glob("*-tiny-runs.json")
    result = json.loads(path.read_text())
    [record] = result["runs"]
    assert record["trained"] == "bf16" and record["seed"] == 3 and record["phase"] == "after_grpo"
    assert record["reported_by_fit"] == 0.125
    for served in ("served_fp32", "served_bf16"):  # the tiny model answers none of the 8 held-out tasks
        assert record[served] == 0.0
    assert result["values"] == [0.0] and result["summary"]["trained_fp32_after_grpo"]["served_fp32"] is None
    assert result["summary"]["trained_bf16_after_grpo"]["reported_by_fit"] == {
        "mean": 0.125,
        "min": 0.125,
        "max": 0.125,
    }


def test_a_runs_argument_without_its_precision_is_refused(tmp_path: Path) -> None:
    done = _bench("--runs", str(tmp_path), "--no-save")
    assert done.returncode == 2 and "give PRECISION:DIR" in done.stderr
    done = _bench("--no-save")
    assert done.returncode == 2 and "give --warm-start, --runs or both" in done.stderr
