"""benchmarks/grpo_vs_trl.py end to end on the tiny model: the agl sides (Trainer.fit, in process), and TRL's;
and its bookkeeping on hand-made rows: per-round ratios, the sample-count check, trained rollouts, variant names.

The TRL side runs only where ``scripts/setup_trl.sh`` made ``.venv-trl`` (or the venv ``AGL_TRL_VENV`` names);
without it the benchmark refuses the side by name and says how to get it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks._grpo_summary import (
    Seen,
    ratios,
    require_same_samples,
    sample_mismatches,
    split_steps,
    table,
    trained_rollouts,
    variant_name,
)

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "grpo_vs_trl.py"
TRL_PYTHON = Path(os.environ.get("AGL_TRL_VENV") or ROOT / ".venv-trl") / "bin" / "python"
# groups of 4: the tiny model's replies tie a group of 2 now and then, which the sample-count check refuses
SMALL = [
    "--model",
    "tiny",
    "--steps",
    "2",
    "--rounds",
    "1",
    "--prompts",
    "2",
    "--group",
    "4",
]
# a tiny model's group may tie on one side only; the check itself is tested on hand-made rows below
SMALL += ["--max-tokens", "8", "--skip-multi-turn", "--allow-unequal-samples"]


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
@pytest.mark.optional_dependency("trl")
def test_fit_in_process_and_trl_sides_run_on_the_tiny_model(tmp_path: Path) -> None:
    """One run of the three single-turn sides (TRL's in its own venv); without that venv, fit and in-process
    run and are checked, then the test skips for TRL's side."""
    out = tmp_path / "bench.jsonl"
    sides_flag = "fit,inproc,trl" if TRL_PYTHON.exists() else "fit,inproc"
    proc = _bench(*SMALL, "--sides", sides_flag, "--json", str(out), "--log-dir", str(tmp_path / "logs"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = _rows(out)
    sides = {r["side"]: r for r in rows if r["bench"] == "grpo_single_turn"}
    assert set(sides) == set(sides_flag.split(","))
    for row in sides.values():
        _check_side(row)
    assert sides["fit"]["gen_s"] > 0 and sides["inproc"]["gen_s"] > 0
    ratio_rows = {(r["side"], r["over"]): r for r in rows if r["bench"] == "grpo_single_turn_ratio"}
    ratio = ratio_rows[("fit", "inproc")]
    assert ratio["speedup_step"] > 0
    (one,) = ratio["speedup_step_rounds"]  # one round: its ratio is the median and both ends of the range
    assert ratio["speedup_step_median"] == one and ratio["speedup_step_range"] == [one, one]
    assert "| fit / inproc |" in proc.stdout and "(median of rounds, min-max)" in proc.stdout
    assert (tmp_path / "logs" / "fit-r0.log").exists()
    if not TRL_PYTHON.exists():
        pytest.skip("no .venv-trl: run `bash scripts/setup_trl.sh` (TRL's GRPOTrainer in its own venv)")
    trl = sides["trl"]
    assert trl["versions"]["trl"] == "1.16.0" and trl["precision"] == "fp32" and not trl["bf16"]
    # TRL trains every sample of the 2 x 4, and so did agl here
    assert trl["samples_per_step"] == sides["fit"]["samples_per_step"] == 8
    assert len(ratio_rows[("fit", "trl")]["speedup_step_rounds"]) == 1


def test_the_trl_side_without_its_interpreter_names_the_setup_script(
    tmp_path: Path,
) -> None:
    proc = _bench(*SMALL, "--trl-python", str(tmp_path / "absent" / "python"), timeout=120)
    assert proc.returncode != 0
    assert "scripts/setup_trl.sh" in proc.stderr and "--sides fit,inproc" in proc.stderr


@pytest.mark.parametrize(
    ("flag", "value", "named"),
    [
        ("--sides", "fit,vllm", "--sides"),
        ("--steps", "0", "--steps"),
        ("--pool-size", "1", "--pool-size"),
    ],
)
def test_bad_settings_are_refused_by_name(flag: str, value: str, named: str) -> None:
    proc = _bench("--model", "tiny", "--sides", "fit", flag, value, timeout=120)
    assert proc.returncode == 2 and named in proc.stderr, proc.stderr


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
    small = [a for a in SMALL if a != "--skip-multi-turn"] + [
        "--skip-multi-turn",
        "--warm-steps",
        "1",
    ]
    proc = _bench(*small, "--task", "tools", "--sides", "fit,trl", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    sides = {r["side"]: r for r in _rows(out) if r["bench"] == "grpo_tools"}
    assert set(sides) == {"fit", "trl"}
    for row in sides.values():
        _check_side(row)
    (ratio,) = [r for r in _rows(out) if r["bench"] == "grpo_tools_ratio"]
    assert (ratio["side"], ratio["over"]) == ("fit", "trl") and ratio["speedup_step"] > 0


def _side(step_s: float, tokens_per_s: float) -> dict[str, Any]:
    return {
        "bench": "b",
        "model": "m",
        "step_s": step_s,
        "wall_s": step_s,
        "trained_tokens_per_s": tokens_per_s,
    }


def test_ratios_give_each_rounds_ratio_their_median_and_range_beside_the_ratio_of_medians() -> None:
    per_round = [  # fit 1 s a step each round; TRL 2, 3 and 1.5 s: fit is 2x, 3x and 1.5x as fast
        {"fit": _side(1.0, 100.0), "trl": _side(2.0, 50.0)},
        {"fit": _side(1.0, 100.0), "trl": _side(3.0, 25.0)},
        {"fit": _side(1.0, 100.0), "trl": _side(1.5, 80.0)},
    ]
    overall = {"fit": _side(1.0, 100.0), "trl": _side(2.5, 40.0)}
    (q,) = ratios(overall, per_round)
    assert (q["side"], q["over"]) == ("fit", "trl")
    assert q["speedup_step_rounds"] == [2.0, 3.0, 1.5]
    assert q["speedup_step_median"] == 2.0 and q["speedup_step_range"] == [1.5, 3.0]
    assert q["speedup_step"] == 2.5  # the ratio of the medians, kept beside
    assert q["speedup_tokens_per_s_rounds"] == [2.0, 4.0, 1.25] and q["speedup_tokens_per_s_median"] == 2.0
    assert "| fit / trl | 2.0x (1.5-3.0x, 3 rounds; all steps 2.5x) |" in table(
        {
            s: {
                **r,
                "precision": "fp32",
                "samples_per_step": 8,
                "steps_without_update": 0,
                "updating_step_s": 1,
            }
            for s, r in overall.items()
        },
        [q],
    )


def test_a_round_where_one_side_failed_leaves_its_ratio_out() -> None:
    per_round = [
        {"fit": _side(1.0, 1.0), "trl": _side(2.0, 1.0)},
        {"fit": _side(1.0, 1.0)},
    ]
    (q,) = ratios({"fit": _side(1.0, 1.0), "trl": _side(2.0, 1.0)}, per_round)
    assert q["speedup_step_rounds"] == [2.0] and q["speedup_step_range"] == [2.0, 2.0]


def _run(round_: int, samples: list[float]) -> dict[str, Any]:
    return {"round": round_, "steps": [{"samples": n} for n in samples]}


def test_the_sample_check_names_each_round_and_step_where_the_sides_trained_different_counts() -> None:
    same = {
        "fit": [_run(0, [8, 8]), _run(1, [8, 8])],
        "trl": [_run(1, [8, 8]), _run(0, [8, 8])],
    }
    assert sample_mismatches(same) == []
    require_same_samples(same)  # equal counts pass
    # agl skipped a tied group of 4 in round 2's first step; TRL trained it
    differ = {
        "fit": [_run(0, [8, 8]), _run(1, [4, 8])],
        "trl": [_run(0, [8, 8]), _run(1, [8, 8])],
    }
    assert sample_mismatches(differ) == ["round 2, step 1: fit 4, trl 8"]
    with pytest.raises(SystemExit, match="different sample counts") as raised:
        require_same_samples(differ)
    assert "round 2, step 1: fit 4, trl 8" in str(raised.value)


def test_the_sample_check_counts_a_missing_step_as_a_difference() -> None:
    runs = {"fit": [_run(0, [8])], "trl": [_run(0, [8, 8])]}
    assert sample_mismatches(runs) == ["round 1, step 2: fit -, trl 8"]


def _seen(group: str, reward: float, tokens: int) -> Seen:
    return Seen(began=0.0, task_id=group, tokens=tokens, reward=reward, group_id=group, step=1)


def test_trained_rollouts_leave_groups_whose_rewards_tie_out() -> None:
    tied = [
        _seen("g1", 0.0990, 10),
        _seen("g1", 0.0990, 12),
    ]  # same reward to 9 places: nothing to learn
    varied = [_seen("g2", 1.0, 20), _seen("g2", 0.0995, 30)]
    trained = trained_rollouts(tied + varied)
    assert trained == varied and sum(s.tokens for s in trained) == 50


def test_rollouts_go_to_the_step_grpo_enqueued_them_for_not_their_finishing_order() -> None:
    # async GRPO enqueues two steps' rollouts at once: step 2's can finish before step 1's last
    finished = [Seen(0.0, f"t{i}", 1, 0.0, f"g{i}", step) for i, step in enumerate([1, 2, 1, 2])]
    assert [[s.task_id for s in chunk] for chunk in split_steps(finished, 2, 2)] == [
        ["t0", "t2"],
        ["t1", "t3"],
    ]
    unmarked = [Seen(0.0, f"t{i}", 1, 0.0, f"g{i}", None) for i in range(4)]  # no step recorded: in order
    assert [[s.task_id for s in chunk] for chunk in split_steps(unmarked, 2, 2)] == [
        ["t0", "t1"],
        ["t2", "t3"],
    ]


@pytest.mark.parametrize(
    ("precision", "trl_precision", "sides", "variant"),
    [
        ("fp32", "same", ["fit", "trl"], "smollm2-fp32"),
        ("fp32", "fp32", ["fit", "trl"], "smollm2-fp32"),
        ("fp32", "bf16", ["fit", "trl"], "smollm2-fp32-trl-bf16"),
        ("bf16", "same", ["fit", "trl"], "smollm2-bf16"),
        (
            "fp32",
            "bf16",
            ["fit", "inproc"],
            "smollm2-fp32",
        ),  # no TRL side: its precision is not in the name
    ],
)
def test_the_variant_names_each_sides_precision(
    precision: str, trl_precision: str, sides: list[str], variant: str
) -> None:
    args = argparse.Namespace(
        model="smollm2",
        task="sums",
        precision=precision,
        trl_precision=trl_precision,
        sides=sides,
        skip_single_turn=False,
    )
    assert variant_name(args) == variant
