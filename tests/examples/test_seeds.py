"""The examples' seeds: ``--seed`` varies training while ``--split-seed`` fixes the tasks and held-out set;
``--seeds`` runs one process per seed and summarises them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from examples.calc.train import calc_tasks, parse_args
from examples.recipe import _seed_list, _without, recipe_args, spread

ROOT = Path(__file__).resolve().parents[2]


def _recipe_args(name: str, out: Path, *extra: str) -> argparse.Namespace:
    return recipe_args("", name, argv=["--model", "tiny", "--out", str(out), *extra])


def test_calc_held_out_set_follows_the_split_seed_only() -> None:
    def held_out(*argv: str) -> list[dict[str, Any]]:
        args = parse_args(["--model", "tiny", *argv])
        return calc_tasks(args.split_seed, 8)[1]

    assert held_out("--seed", "0") == held_out("--seed", "1") == held_out("--seed", "7", "--split-seed", "0")
    assert held_out("--seed", "0") != held_out("--split-seed", "1")


def test_coding_and_multi_agent_held_out_sets_follow_the_split_seed_only(tmp_path: Path) -> None:
    from examples.coding_agent.train import split as coding_split
    from examples.multi_agent.train import split as multi_split

    for split in (coding_split, multi_split):
        tests = [split(_recipe_args("x", tmp_path, "--seed", s))[1] for s in ("0", "1", "2")]
        assert tests[0] == tests[1] == tests[2] and len(tests[0]) == 4
        assert split(_recipe_args("x", tmp_path, "--split-seed", "1"))[1] != tests[0]


def test_sql_held_out_questions_follow_the_split_seed_only(tmp_path: Path) -> None:
    from examples.sql_agent.train import split

    def questions(out: Path, *argv: str) -> list[str]:
        return [q["question"] for q in split(_recipe_args("sql_agent", out, *argv))[2]]

    first = questions(tmp_path / "a", "--seed", "0")
    assert first == questions(tmp_path / "b", "--seed", "1") and len(first) == 4
    assert first != questions(tmp_path / "c", "--split-seed", "1")


def test_seed_options_parse_and_name_the_bad_value() -> None:
    assert _seed_list("0,1,2") == [0, 1, 2] and _seed_list("5") == [5]
    for bad in ("a,b", "1,1", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="--seeds"):
            _seed_list(bad)
    assert _without(
        ["--model", "tiny", "--seeds", "0,1", "--seed=3", "--out", "x", "--lr", "1"],
        ["--seeds", "--seed", "--out"],
    ) == [
        "--model",
        "tiny",
        "--lr",
        "1",
    ]
    runs: list[dict[str, Any]] = [{"a": 0.5, "b": None}, {"a": 1.0, "b": None}, {"a": 0.0}]
    assert spread(runs, ["a", "b"]) == {
        "mean": {"a": 0.5, "b": None},
        "min": {"a": 0.0, "b": None},
        "max": {"a": 1.0, "b": None},
    }


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_calc_seeds_run_each_seed_and_write_the_spread(tmp_path: Path) -> None:
    result = tmp_path / "result.json"
    command = [
        sys.executable,
        "-m",
        "examples.calc.train",
        "--model",
        "tiny",
        "--steps",
        "1",
        "--sft-steps",
        "1",
    ]
    command += [
        "--val",
        "4",
        "--precision",
        "fp32",
        "--seeds",
        "0,1",
        "--out",
        str(tmp_path),
        "--result",
        str(result),
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(result.read_text())
    assert summary["seeds"] == [0, 1] and summary["split_seed"] == 0 and "--seeds" in summary["command"]
    assert [r["seed"] for r in summary["runs"]] == [0, 1]
    for run in summary["runs"]:
        per_seed = json.loads((tmp_path / f"seed-{run['seed']}" / "summary.json").read_text())
        assert per_seed["seed"] == run["seed"] and per_seed["precision"] == "fp32"
        assert run["cpu_s"] > 0 and 0.05 < run["peak_rss_gb"] < 16
        assert all(0.0 <= run[k] <= 1.0 for k in ("before", "after_warm_start", "after_grpo"))
    for key in ("before", "after_grpo", "cpu_s", "peak_rss_gb"):
        values = [r[key] for r in summary["runs"]]
        assert summary["min"][key] == min(values) and summary["max"][key] == max(values)
        assert summary["mean"][key] == pytest.approx(sum(values) / 2)
