"""Trackers: TensorBoard, wandb (offline) and MLflow runs written through MetricsLogger and read back; a
tracker that cannot start warns on stderr; Trainer(trackers=...) reaches the algorithm's logger."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

import agl
from agl.errors import ConfigError, install_command
from agl.metrics import MetricsLogger
from agl.trackers import TrackerWarning, default_trackers, use_trackers

STEPS = [(1, {"reward_mean": 0.25, "loss": 1.5}), (2, {"reward_mean": 0.75, "loss": float("nan")})]


def _log(out: Path, trackers: tuple[str, ...]) -> MetricsLogger:
    metrics = MetricsLogger(out, console=False, progress=False, trackers=trackers)
    for step, values in STEPS:
        metrics.log(step, {**values, "note": "text is not a scalar"})
    metrics.close()
    return metrics


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = _log(tmp_path, ("tensorboard",))
    assert [t.name for t in metrics.trackers] == ["tensorboard"]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {"reward_mean", "loss"}
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.5)]  # NaN is left out


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a wandb ``.wandb`` file: a 7-byte header, then LevelDB-log style 32 KiB blocks of
    chunks (crc32c:4, length:2, type:1 = full/first/middle/last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # block trailer padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def test_wandb_offline_run_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from wandb.proto import wandb_internal_pb2

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "agl-test")
    metrics = _log(tmp_path, ("wandb",))
    assert [t.name for t in metrics.trackers] == ["wandb"]
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    records = _wait_for_exit_record(run_file, wandb_internal_pb2.Record)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "agl-test"
    history = [
        {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(row["_step"], row["reward_mean"]) for row in history] == [(1, 0.25), (2, 0.75)]
    assert history[0]["loss"] == 1.5 and math.isnan(history[1]["loss"])


def _wait_for_exit_record(path: Path, record_type: Any, timeout_s: float = 60.0) -> list[Any]:
    """The file's records once wandb's service has written the run's exit record (it writes in the
    background after ``finish`` returns)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = []
        for raw in _wandb_records(path):
            record = record_type()
            record.ParseFromString(raw)
            records.append(record)
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


@pytest.mark.slow
def test_mlflow_run_reads_back_from_its_local_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    metrics = _log(tmp_path, ("mlflow",))
    (tracker,) = metrics.trackers
    assert (tmp_path / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    run = client.get_run(tracker.run_id)  # type: ignore[attr-defined]
    assert run.info.status == "FINISHED"
    rewards = client.get_metric_history(run.info.run_id, "reward_mean")
    assert sorted((m.step, m.value) for m in rewards) == [(1, 0.25), (2, 0.75)]
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [(1, 1.5)]


def test_a_tracker_that_cannot_start_warns_once_on_stderr_and_the_run_goes_on(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['wandb'] = None  # as if wandb were not installed\n"
        "from agl.metrics import MetricsLogger\n"
        f"m = MetricsLogger({str(tmp_path)!r}, progress=False, console=False, trackers=('wandb',))\n"
        "for step in range(3):\n"
        "    m.log(step, {'reward_mean': 0.5})\n"
        "m.close()\n"
        "print(len(m.trackers))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "0"
    assert proc.stderr.count("the wandb tracker could not start") == 1, proc.stderr
    assert "ModuleNotFoundError" in proc.stderr and install_command("trackers") in proc.stderr
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 4  # the CSV does not depend on it


def test_chosen_trackers_replace_the_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert default_trackers() == ("tensorboard",)
    assert default_trackers(tensorboard=False) == ()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert default_trackers() == ("tensorboard", "wandb")
    with use_trackers(["tensorboard"]):
        assert default_trackers(tensorboard=False) == ("tensorboard",)  # chosen beats a caller's default
        metrics = MetricsLogger(tmp_path, console=False, progress=False, tensorboard=False)
        assert [t.name for t in metrics.trackers] == ["tensorboard"]
        metrics.close()
    with use_trackers(()):
        assert default_trackers() == ()
    with pytest.raises(ConfigError, match=r"unknown tracker\(s\) \['tensorbord'\]; choose from"):
        agl.Trainer(trackers=("tensorbord",))
    assert agl.Trainer(trackers="wandb").trackers == ("wandb",)


class _Broken:
    """A tracker whose backend goes away after the first step."""

    name = "broken"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if self.steps:
            raise ConnectionError("backend went away")
        self.steps.append(step)

    def close(self) -> None:
        pass


def test_a_tracker_that_fails_mid_run_is_dropped_with_a_warning(tmp_path: Path) -> None:
    metrics = MetricsLogger(tmp_path, console=False, progress=False, trackers=())
    broken = _Broken()
    metrics.trackers.append(broken)
    with pytest.warns(
        TrackerWarning, match=r"broken tracker failed at step 2 .*ConnectionError: backend went away"
    ):
        for step in (1, 2, 3):
            metrics.log(step, {"reward_mean": 0.5})
    metrics.close()
    assert broken.steps == [1] and metrics.trackers == []
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 4
