"""MetricsLogger: a console line per step by default (no logging setup needed), CSV, curve plot, silence."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from agl.metrics import MetricsLogger, curve_panels


def test_a_fresh_process_shows_each_step_on_stderr_without_logging_setup(tmp_path: Path) -> None:
    code = (
        "from agl.metrics import MetricsLogger\n"
        f"m = MetricsLogger({str(tmp_path)!r}, total_steps=2, tensorboard=False)\n"
        "m.log(1, {'reward_mean': 0.25, 'loss': 1.5})\n"
        "m.log(2, {'reward_mean': 0.75, 'loss': 0.5})\n"
        "m.close()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step 1: reward_mean=0.250  loss=1.500" in proc.stderr
    assert "step 2: reward_mean=0.750  loss=0.500" in proc.stderr
    assert proc.stdout == ""  # the library never prints to stdout


def test_console_false_silences_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = MetricsLogger(tmp_path, console=False, progress=False, tensorboard=False)
    metrics.log(1, {"reward_mean": 0.5})
    metrics.close()
    assert capsys.readouterr().err == ""
    assert (tmp_path / "metrics.csv").exists()


def test_csv_and_curve_follow_the_chosen_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = MetricsLogger(
        tmp_path,
        total_steps=100,
        shown=("metric_calls", "best"),
        label="metric calls",
        progress_key="metric_calls",
        plot_x="metric_calls",
        plot_y=("best",),
        tensorboard=False,
    )
    for step, (calls, best) in enumerate([(10, 0.0), (40, 0.5), (90, 1.0)]):
        metrics.log(step, {"metric_calls": calls, "best": best, "note": "not a number"})
    metrics.close()
    err = capsys.readouterr().err
    assert "metric calls 2: metric_calls=90  best=1.000" in err
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [r["metric_calls"] for r in rows] == ["10", "40", "90"] and "note" not in rows[0]
    assert (tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"


def test_no_plot_without_data(tmp_path: Path) -> None:
    metrics = MetricsLogger(tmp_path, console=False, progress=False, tensorboard=False)
    metrics.log(1, {"other": 1.0})
    assert metrics.plot() is None


def test_the_line_says_what_went_wrong(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = MetricsLogger(tmp_path, progress=False, tensorboard=False)
    error = "OpenAIError: Missing credentials [set api_key]"
    metrics.log(
        1,
        {
            "reward_mean": 0.0,
            "samples": 0,
            "groups": 6,
            "zero_variance_groups": 6,
            "rollouts": 8,
            "failed_rollouts": 2,
            "first_error": error,
        },
    )
    metrics.log(2, {"reward_mean": 0.5, "loss": 0.0, "samples": 4, "groups": 2, "zero_variance_groups": 0})
    metrics.log(0, {"val_reward": 0.0, "val_rollouts": 4, "val_failed_rollouts": 4})
    metrics.close()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].endswith(
        f"step 1: reward_mean=0.000  no update  zero_var=6/6 groups  failed=2/8  first error: {error}"
    )  # the brackets are printed, not taken for console markup
    assert lines[1].endswith("step 2: reward_mean=0.500  loss=0.000")  # a real update, no trouble to report
    assert lines[2].endswith("step 0: val_reward=0.000  val_failed=4/4")
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert rows[0]["failed_rollouts"] == "2" and "first_error" not in rows[0]  # the CSV stays numeric


def test_the_line_counts_refill_rollouts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    metrics = MetricsLogger(tmp_path, progress=False, tensorboard=False)
    row = {"reward_mean": 0.5, "loss": 0.1, "samples": 8, "groups": 6, "zero_variance_groups": 2}
    metrics.log(1, {**row, "refill_rollouts": 16, "refill_rounds": 1, "groups_with_signal": 4})
    metrics.close()
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith("reward_mean=0.500  loss=0.100  zero_var=2/6 groups  refill=+16 rollouts")


def test_curve_keeps_seconds_and_gigabytes_off_the_reward_axis(tmp_path: Path) -> None:
    assert curve_panels(
        ["reward_mean", "val_reward", "loss", "step_time_s", "peak_rss_gb", "rollout_time_s"]
    ) == [
        ["reward_mean", "val_reward", "loss"],
        ["step_time_s", "rollout_time_s"],
        ["peak_rss_gb"],
    ]
    assert curve_panels(["reward_mean"]) == [["reward_mean"]]

    def height(png: Path) -> int:
        return int.from_bytes(png.read_bytes()[20:24], "big")  # the IHDR chunk's height

    heights = []
    for shown in (("reward_mean",), ("reward_mean", "step_time_s")):
        metrics = MetricsLogger(tmp_path / str(len(shown)), console=False, progress=False, tensorboard=False)
        for step in (1, 2):
            metrics.log(step, {"reward_mean": 0.1 * step, "step_time_s": 40.0 * step})
        metrics.plot_y = shown
        heights.append(height(metrics.plot() or Path("missing")))
    assert heights[1] == 2 * heights[0]  # durations drawn on a panel of their own
