"""benchmarks/time_to_accuracy.py: both sides train and save on the tiny model and one evaluator scores every
saved model; the time-to-target bookkeeping on hand-made curves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.time_to_accuracy import RUN_SETTINGS, build_parser, compare, earlier_runs, reused_run, time_to

ROOT = Path(__file__).resolve().parents[2]
TRL_PYTHON = Path(os.environ.get("AGL_TRL_VENV") or ROOT / ".venv-trl") / "bin" / "python"


def _points(*rows: tuple[float, float, float]) -> list[dict[str, float]]:
    return [{"train_s": t, "cpu_s": c, "accuracy": a} for t, c, a in rows]


def test_time_to_a_target_is_the_first_evaluation_at_or_above_it() -> None:
    points = _points((0, 0, 0.1), (10, 20, 0.6), (20, 40, 0.5), (30, 60, 0.8))
    assert time_to(points, 0.5, "train_s") == 10 and time_to(points, 0.7, "cpu_s") == 60
    assert time_to(points, 0.9, "train_s") is None


def test_compare_times_each_target_and_the_best_both_sides_reached() -> None:
    curves = {
        "fit": _points((0, 0, 0.1), (10, 30, 0.6), (20, 60, 0.9)),
        "trl": _points((0, 0, 0.1), (40, 50, 0.5), (80, 100, 0.7)),
    }
    got = compare(curves, [0.5, 0.95])
    assert got["best_both"] == 0.7
    assert got["targets"]["0.500"]["train_s"] == {"fit": 10, "trl": 40, "fit_over_trl": 0.25}
    assert got["targets"]["0.500"]["cpu_s"]["fit_over_trl"] == pytest.approx(0.6)
    assert got["targets"]["0.950"]["train_s"] == {"fit": None, "trl": None, "fit_over_trl": None}
    assert got["targets"]["0.700 (best both)"]["train_s"]["fit_over_trl"] == pytest.approx(0.25)
    assert "fit_over_trl_at_most" not in got["targets"]["0.500"]["train_s"]  # both reached it: the ratio
    flat = {s: _points((0, 0, 0.2), (10, 10, 0.2)) for s in curves}  # nothing learned: no "best both" row
    assert list(compare(flat, [0.5])["targets"]) == ["0.500"]


def test_a_target_only_agl_reached_is_bounded_by_trls_whole_run() -> None:
    curves = {
        "fit": _points((0, 0, 0.0), (600, 1200, 0.56)),
        "trl": _points((0, 0, 0.0), (1200, 2000, 0.0), (2400, 4500, 0.0)),
    }
    row = compare(curves, [0.5])["targets"]["0.500"]
    assert row["train_s"] == {"fit": 600, "trl": None, "fit_over_trl": None, "fit_over_trl_at_most": 0.25}
    assert row["cpu_s"]["fit_over_trl_at_most"] == pytest.approx(1200 / 4500)


def test_a_finished_seed_is_reused_only_with_the_same_settings(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    assert reused_run(path, {"steps": "20"}) is None  # not run yet: run it
    path.write_text(json.dumps({"settings": {"steps": "20"}, "run": {"seed": 0, "best_both": 0.5}}))
    assert reused_run(path, {"steps": "20"}) == {"seed": 0, "best_both": 0.5}
    with pytest.raises(SystemExit, match="other settings.*'steps': \\('20', '12'\\)"):
        reused_run(path, {"steps": "12"})


def test_a_committed_seed_joins_only_with_the_same_settings(tmp_path: Path) -> None:
    defaults = build_parser().parse_args([])
    settings = {name: str(getattr(defaults, name)) for name in RUN_SETTINGS}
    path = tmp_path / "seed0.json"
    command = "python benchmarks/time_to_accuracy.py --seeds 0 --out /tmp/runs --no-save"
    runs = [{"seed": 0, "best_both": 0.5}]
    path.write_text(json.dumps({"command": command, "machine": {"cores": 2}, "runs": runs}))
    (joined,) = earlier_runs([path], settings, seeds=[1])
    assert joined == {"seed": 0, "best_both": 0.5, "from": str(path), "machine": {"cores": 2}}
    assert earlier_runs([path], settings, seeds=[0, 1]) == []  # run again now: this report's own
    with pytest.raises(SystemExit, match="other settings.*'steps': \\('20', '12'\\)"):
        earlier_runs([path], {**settings, "steps": "12"}, seeds=[1])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.optional_dependency("trl")
def test_both_sides_save_on_schedule_and_one_evaluator_scores_them(tmp_path: Path) -> None:
    if not TRL_PYTHON.exists():
        pytest.skip("no .venv-trl: run `bash scripts/setup_trl.sh` (TRL's GRPOTrainer in its own venv)")
    small = ["--model", "tiny", "--steps", "2", "--eval-every", "1", "--test", "2", "--seeds", "0"]
    # two groups a step: TRL trains them one at a time, its gradients accumulated over the step
    small += ["--prompts", "2", "--group", "2", "--max-tokens", "8", "--warm-steps", "1"]
    proc = subprocess.run(
        [sys.executable, "benchmarks/time_to_accuracy.py", *small, "--out", str(tmp_path / "runs")]
        + ["--results-dir", str(tmp_path / "results")],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (path,) = (tmp_path / "results" / "time_to_accuracy").glob("*-tiny.json")
    (run,) = json.loads(path.read_text())["runs"]
    for side in ("fit", "trl"):
        curve = run["curves"][side]
        assert [p["step"] for p in curve] == [0, 1, 2]  # the shared start, then each saved model
        assert curve[0]["accuracy"] == run["curves"]["fit"][0]["accuracy"]  # one start, scored once
        assert 0 < curve[1]["train_s"] < curve[2]["train_s"] and 0 < curve[1]["cpu_s"] < curve[2]["cpu_s"]
        assert all(p["rollouts"] == 2 and 0 <= p["accuracy"] <= 1 for p in curve)
    assert (tmp_path / "runs" / "seed-0" / "trl" / "step-2" / "config.json").exists()
    assert (tmp_path / "runs" / "time_to_accuracy.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "runs" / "seed-0" / "run.json").read_text())
    assert saved["run"] == run and saved["settings"]["steps"] == "2"  # what --reuse reads back
