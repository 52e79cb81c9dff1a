"""MetricsLogger: a console line per step by default (no logging setup needed), CSV, curve plot, silence."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from agl.metrics import MetricsLogger


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
