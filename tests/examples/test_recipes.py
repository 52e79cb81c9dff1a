"""The three recipes (LangGraph SQL agent, Agents-SDK coding agent, two-agent LangGraph team) run end to end on
the tiny model: base, warm start, GRPO, a summary and a curve; the coding reward runs hidden tests in the
sandbox; the team's checker calls are recorded but never trainable, unless both agents train (an adapter each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from examples.coding_agent.agent import extract_code, pass_fraction
from examples.coding_agent.tasks import make_tasks
from examples.heldout import split_by_template

ROOT = Path(__file__).resolve().parents[2]


def test_coding_tasks_have_hidden_tests_their_reference_passes() -> None:
    tasks = make_tasks()
    assert len(tasks) >= 200
    train, test = split_by_template(tasks, test=64, key="spec")
    assert len(test) == 64 and not {t["spec"] for t in train} & {t["spec"] for t in test}
    task = test[0]
    assert pass_fraction(task["reference"], task) == 1.0
    wrong = f"def {task['function']}(x):\n    return None\n"
    assert pass_fraction(wrong, task) == 0.0
    # a partly right answer gets partial credit: right on the first hidden case only
    case, expected = task["tests"][0]
    partial = f"def {task['function']}(x):\n    return {expected} if x == {case} else None\n"
    assert 0.0 < pass_fraction(partial, task) < 1.0


@pytest.mark.parametrize(
    "code",
    [
        "while True:\n    pass",
        "import os\nwhile True:\n    os.fork()",
        "x = bytearray(4 * 1024**3)",
        "print(open('/etc/passwd').read())",
        "import socket\nsocket.create_connection(('127.0.0.1', 5432), timeout=1)",
        "import json\nprint(json.dumps([True] * 99))",  # forging the harness's output line
    ],
    ids=["loop", "fork-bomb", "allocation", "host-file", "network", "forged-output"],
)
def test_misbehaving_solutions_score_zero(code: str) -> None:
    task = make_tasks()[0]
    assert pass_fraction(code, task) == 0.0


def test_code_is_taken_from_the_first_fence() -> None:
    assert (
        extract_code("Here:\n```python\ndef f(x):\n    return x\n```\nDone.") == "def f(x):\n    return x\n"
    )
    assert extract_code("def f(x): return x") == "def f(x): return x"


def _smoke(module: str, out: Path, *options: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", module, "--model", "tiny", "--out", str(out), *options],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    assert summary["test_tasks"] == 4
    for key in ("test_base", "test_after_warm_start", "test_after_grpo"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["gain_from_grpo"] == summary["test_after_grpo"] - summary["test_after_warm_start"]
    assert (out / "curve.png").stat().st_size > 1000
    cut_off = summary["held_out_cut_off_rate"]  # per phase, from the held-out rollouts' recorded calls
    assert set(cut_off) == {"base", "after_warm_start", "after_grpo"}
    assert all(0.0 <= v <= 1.0 for v in cut_off.values()), cut_off
    return summary


@pytest.mark.slow
def test_sql_recipe_smoke_run(tmp_path: Path) -> None:
    summary = _smoke("examples.sql_agent.train", tmp_path)
    assert summary["framework"] == "LangGraph" and (tmp_path / "shop.db").exists()
    assert set(summary["recursion_limit_share"]) >= {"train", "base", "after_warm_start", "after_grpo"}
    # the tiny model's random replies seldom end before the agent's max_tokens
    assert summary["held_out_cut_off_rate"]["base"] > 0.5, summary["held_out_cut_off_rate"]


@pytest.mark.slow
def test_coding_recipe_smoke_run(tmp_path: Path) -> None:
    summary = _smoke("examples.coding_agent.train", tmp_path)
    assert summary["framework"] == "OpenAI Agents SDK"


@pytest.mark.slow
def test_multi_agent_recipe_trains_only_the_solver(tmp_path: Path) -> None:
    summary = _smoke("examples.multi_agent.train", tmp_path)
    calls = summary["training_calls"]
    assert calls["recorded"].get("checker", 0) > 0 and calls["recorded"].get("solver", 0) > 0
    assert set(calls["trainable"]) == {"solver"}  # the checker's calls never enter a batch


@pytest.mark.slow
def test_multi_agent_recipe_trains_an_adapter_per_agent(tmp_path: Path) -> None:
    summary = _smoke("examples.multi_agent.train", tmp_path, "--agents", "solver,checker")
    assert summary["agents"] == ["solver", "checker"] and summary["lora_rank"] == 16
    calls = summary["training_calls"]
    assert calls["trainable"] == calls["recorded"] and calls["recorded"].get("checker", 0) > 0
    for agent in ("solver", "checker"):  # the exported team: the base with each agent's adapter merged in
        assert (tmp_path / "model" / agent / "model.safetensors").is_file()


def test_teacher_options_replace_the_gold_warm_start(tmp_path: Path) -> None:
    """``--teacher`` makes a recipe warm-start from a stronger model's rollouts instead of gold traces."""
    import agl
    from agl.algorithm.grpo import WarmStart
    from agl.errors import ConfigError
    from examples.recipe import Recipe, recipe_args, warm_start

    recipe = Recipe(
        "r", "none", agent=None, train=[], test=[], warm_start=[[{"role": "user", "content": "x"}]]
    )
    base = ["--model", "tiny", "--out", str(tmp_path)]
    gold = warm_start(recipe, recipe_args("doc", "r", argv=base))
    assert isinstance(gold, WarmStart) and gold.conversations == recipe.warm_start
    local = warm_start(
        recipe, recipe_args("doc", "r", argv=[*base, "--teacher", "/models/big", "--teacher-samples", "2"])
    )
    assert isinstance(local, agl.Teacher) and local.path == "/models/big" and local.samples_per_task == 2
    assert (local.max_tasks, local.keep) == (32, None)  # the recipes' defaults (the calc demo has its own)
    url = [*base, "--teacher", "http://127.0.0.1:9/v1", "--teacher-model", "big", "--teacher-tasks", "8"]
    remote = warm_start(recipe, recipe_args("doc", "r", argv=url))
    assert isinstance(remote, agl.Teacher) and (remote.endpoint, remote.model, remote.max_tasks) == (
        "http://127.0.0.1:9/v1",
        "big",
        8,
    )
    with pytest.raises(ConfigError, match="model="):  # an endpoint needs the model name it serves
        warm_start(recipe, recipe_args("doc", "r", argv=[*base, "--teacher", "http://127.0.0.1:9/v1"]))
    assert warm_start(recipe, recipe_args("doc", "r", argv=[*base, "--sft-steps", "0"])) is None
