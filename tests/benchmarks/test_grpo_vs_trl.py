"""benchmarks/grpo_vs_trl.py end to end on the tiny model: the agl sides (Trainer.fit, in process), and TRL's.

The TRL side runs only where ``scripts/setup_trl.sh`` made ``.venv-trl``; without it the benchmark refuses the
side by name and says how to get it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "grpo_vs_trl.py"
TRL_PYTHON = ROOT / ".venv-trl" / "bin" / "python"
SMALL = ["--model", "tiny", "--steps", "2", "--rounds", "1", "--prompts", "2", "--group", "2"]
SMALL += ["--max-tokens", "8", "--skip-multi-turn"]


def _bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--no-save"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check_side(row: dict[str, Any]) -> None:
    assert row["same_prompts"], row  # the side trained on the tasks fit draws, step by step
    assert row["steady_steps"] == 1 and row["step_s"] > 0 and row["wall_s"] > 0, row
    assert row["tokens_per_step"] > 2 * 2 and row["trained_tokens_per_s"] > 0, row


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fit_and_in_process_sides_run_on_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    proc = _bench(*SMALL, "--sides", "fit,inproc", "--json", str(out), "--log-dir", str(tmp_path / "logs"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = _rows(out)
    sides = {r["side"]: r for r in rows if r["bench"] == "grpo_single_turn"}
    assert set(sides) == {"fit", "inproc"}
    for row in sides.values():
        _check_side(row)
        assert row["gen_s"] > 0, row
    (ratio,) = [r for r in rows if r["bench"] == "grpo_single_turn_ratio"]
    assert (ratio["side"], ratio["over"]) == ("fit", "inproc") and ratio["speedup_step"] > 0
    assert "| fit / inproc |" in proc.stdout  # the ratio table
    assert (tmp_path / "logs" / "fit-r0.log").exists()


def test_the_trl_side_without_its_interpreter_names_the_setup_script(tmp_path: Path) -> None:
    proc = _bench(*SMALL, "--trl-python", str(tmp_path / "absent" / "python"), timeout=120)
    assert proc.returncode != 0
    assert "scripts/setup_trl.sh" in proc.stderr and "--sides fit,inproc" in proc.stderr


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [("--sides", "fit,vllm", "--sides"), ("--steps", "0", "--steps"), ("--pool-size", "1", "--pool-size")],
)
def test_bad_settings_are_refused_by_name(flag: str, value: str, named: str) -> None:
    proc = _bench("--model", "tiny", "--sides", "fit", flag, value, timeout=120)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.optional_dependency("trl")
def test_trl_side_runs_in_its_own_venv_on_the_tiny_model(tmp_path: Path) -> None:
    if not TRL_PYTHON.exists():
        pytest.skip("no .venv-trl: run `bash scripts/setup_trl.sh` (TRL's GRPOTrainer in its own venv)")
    out = tmp_path / "bench.jsonl"
    proc = _bench(*SMALL, "--sides", "trl", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (row,) = [r for r in _rows(out) if r["bench"] == "grpo_single_turn"]
    assert row["side"] == "trl" and row["versions"]["trl"] == "1.16.0"
    _check_side(row)
    assert row["samples_per_step"] == 4  # TRL trains every sample of the 2 x 2


def test_the_tool_task_refuses_the_in_process_side() -> None:
    proc = _bench("--model", "tiny", "--task", "tools", "--sides", "fit,inproc", timeout=120)
    assert proc.returncode == 2 and "--task tools" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.optional_dependency("trl")
def test_tool_task_runs_fit_and_trl_on_one_warm_started_model(tmp_path: Path) -> None:
    """--task tools: the model gets TRL's Qwen 2.5 template and a warm start, then both sides train on it."""
    if not TRL_PYTHON.exists():
        pytest.skip("no .venv-trl: run `bash scripts/setup_trl.sh` (TRL's GRPOTrainer in its own venv)")
    out = tmp_path / "bench.jsonl"
    small = [a for a in SMALL if a != "--skip-multi-turn"] + ["--skip-multi-turn", "--warm-steps", "1"]
    proc = _bench(*small, "--task", "tools", "--sides", "fit,trl", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    sides = {r["side"]: r for r in _rows(out) if r["bench"] == "grpo_tools"}
    assert set(sides) == {"fit", "trl"}
    for row in sides.values():
        _check_side(row)
    (ratio,) = [r for r in _rows(out) if r["bench"] == "grpo_tools_ratio"]
    assert (ratio["side"], ratio["over"]) == ("fit", "trl") and ratio["speedup_step"] > 0
