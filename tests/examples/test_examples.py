"""The examples run: the custom-algorithm example, the APO example and a tiny smoke run of the calc demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import cast

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 240) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_custom_algorithm_example_picks_the_best_prompt() -> None:
    out = _run("examples.custom_algorithm")
    assert "best: End with 'ANSWER: <number>'. Use the lookup tool" in out


def test_apo_example_writes_curve_and_summary(tmp_path: Path) -> None:
    _run("examples.apo.run", "--rounds", "3", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["best_score"] > summary["start_score"] and (tmp_path / "curve.png").stat().st_size > 1000


@pytest.mark.slow
def test_calc_demo_smoke_run_on_the_tiny_model(tmp_path: Path) -> None:
    _run(
        "examples.calc.train",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--sft-steps",
        "1",
        "--val",
        "4",
        "--out",
        str(tmp_path),
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {"val_accuracy_before", "val_accuracy_after", "grpo_steps", "wall_time_s", "model"} <= set(summary)
    assert 0.0 <= summary["val_accuracy_after"] <= 1.0
    # the three phases of GRPOConfig(warm_start=...): base, after the warm start, after GRPO
    assert summary["val_accuracy_after_sft"] is not None and summary["val_tasks"] == 4
    assert summary["grpo_gain"] == summary["val_accuracy_after"] - summary["val_accuracy_after_sft"]
    assert (tmp_path / "curve.png").stat().st_size > 1000 and (tmp_path / "metrics.csv").exists()
    assert summary["refill"] is True  # the demo's default: dynamic sampling (--no-refill turns it off)
    assert summary["precision"] == "fp32"  # the demo's default on every CPU (it learns more than bf16)


@pytest.mark.slow
def test_iterated_sft_example_smoke_run(tmp_path: Path) -> None:
    _run("examples.sft.run", "--model", "tiny", "--iterations", "1", "--val", "2", "--out", str(tmp_path))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {"val_accuracy_before", "val_accuracy_after", "iterations"} <= set(summary)
    assert summary["warm_start_samples"] == 16  # 8 traces x 2 assistant turns, trained before iterating
    assert (tmp_path / "sft-iteration-1.jsonl").exists()


def _private_uses(path: Path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        own = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not own:  # an example's own helpers may be private; agl's may not
                found.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agl"):
            parts = node.module.split(".") + [a.name for a in node.names]
            found |= {p for p in parts if p.startswith("_") and not p.startswith("__")}
    return found


def test_examples_use_only_public_agl_names() -> None:
    used = {
        (str(path.relative_to(ROOT)), name)
        for path in sorted((ROOT / "examples").rglob("*.py"))
        for name in _private_uses(path)
    }
    assert not used, f"examples reach into private agl names: {sorted(used)}"


def test_calc_agent_reads_only_an_expression_object_from_a_tool_call() -> None:
    from types import SimpleNamespace

    from examples.calc.agent import expression_of

    def call(arguments: str) -> SimpleNamespace:
        return SimpleNamespace(function=SimpleNamespace(arguments=arguments))

    assert expression_of(call('{"expression": "3 * 4"}')) == "3 * 4"
    assert expression_of(call("5")) == expression_of(call("[1]")) == expression_of(call("{oops")) == ""


def test_calc_demo_teacher_option_replaces_the_gold_traces(tmp_path: Path) -> None:
    """``--teacher`` gives the demo a warm start from a stronger model's rollouts: no gold trace used."""
    import agl
    from agl.algorithm.grpo import WarmStart
    from examples.calc.agent import CALCULATOR
    from examples.calc.train import calc_tasks, parse_args, tool_use_trace, warm_start

    _, _, warm_tasks = calc_tasks(0, 4)
    base = ["--model", "tiny", "--out", str(tmp_path)]
    gold = warm_start(parse_args(base), warm_tasks, 8, 1e-5)
    assert isinstance(gold, WarmStart) and len(gold.conversations) == len(warm_tasks)
    taught = warm_start(parse_args([*base, "--teacher", "/models/big", "--seed", "2"]), warm_tasks, 8, 1e-5)
    assert isinstance(taught, agl.Teacher) and (taught.path, taught.steps, taught.lr, taught.seed) == (
        "/models/big",
        8,
        1e-5,
        2,
    )
    assert warm_start(parse_args([*base, "--teacher", "/models/big"]), warm_tasks, 0, 1e-5) is None
    # the demo's own teacher budget: 2 rollouts on each of 128 tasks, keeping those that call the calculator
    assert (taught.samples_per_task, taught.max_tasks) == (2, 128)
    assert taught.keep is agl.Teacher.calls_a_tool
    any_kept = parse_args([*base, "--teacher", "/models/big", "--teacher-keep", "any"])
    assert cast(agl.Teacher, warm_start(any_kept, warm_tasks, 8, 1e-5)).keep is None
    # an earlier run's kept traces: the same lesson, the teacher not called again
    traces = tmp_path / "teacher_traces.jsonl"
    traces.write_text(json.dumps({"messages": tool_use_trace(warm_tasks[0]), "tools": [CALCULATOR]}) + "\n")
    reused = warm_start(parse_args([*base, "--teacher", str(traces), "--seed", "1"]), warm_tasks, 8, 1e-5)
    assert isinstance(reused, WarmStart) and (len(reused.conversations), reused.seed) == (1, 1)
    assert reused.conversations[0] == tool_use_trace(warm_tasks[0])
