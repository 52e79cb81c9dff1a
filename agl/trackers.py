"""Experiment trackers that :class:`agl.metrics.MetricsLogger` forwards each step's scalars to.

``tensorboard`` (event files under ``OUT/tensorboard``), ``wandb`` (``WANDB_PROJECT``, default ``agl``;
``WANDB_MODE=offline`` needs no network) and ``mlflow`` (``MLFLOW_TRACKING_URI``, default a SQLite
store at ``OUT/mlflow.db``). Choose them with ``agl.Trainer(trackers=(...))`` or
``MetricsLogger(trackers=(...))``. Unchosen, TensorBoard is on when installed and wandb when
``WANDB_API_KEY`` or ``WANDB_MODE`` is set. A chosen tracker that cannot start warns once on stderr,
naming the error and the fix, and the run goes on without it.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from agl.errors import ConfigError, install_command


class TrackerWarning(UserWarning):
    """A chosen tracker could not start; the run continues without it."""


class Tracker(Protocol):
    """Receives every logged step; ``close`` flushes and ends the run."""

    name: str

    def log(self, step: int, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars as TensorBoard event files under ``out_dir/tensorboard``."""

    name = "tensorboard"

    def __init__(self, out_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = out_dir / "tensorboard"
        self._writer = SummaryWriter(str(self.log_dir))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            if math.isfinite(value):  # TensorBoard rejects NaN/Inf scalars
                self._writer.add_scalar(key, value, step)

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A wandb run in project ``WANDB_PROJECT`` (default ``agl``) with its files under ``out_dir/wandb``."""

    name = "wandb"

    def __init__(self, out_dir: Path) -> None:
        import wandb

        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT", "agl"), dir=str(out_dir))

    def log(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class MLflowTracker:
    """An MLflow run in experiment ``MLFLOW_EXPERIMENT_NAME`` (default ``agl``).

    The store is ``MLFLOW_TRACKING_URI``, else SQLite at ``out_dir/mlflow.db`` (MLflow's file store is
    in maintenance mode and refuses new runs by default).
    """

    name = "mlflow"

    def __init__(self, out_dir: Path) -> None:
        from mlflow.tracking import MlflowClient

        self.tracking_uri = (
            os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out_dir.resolve()}/mlflow.db"
        )
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "agl")
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self._client.create_experiment(
                name, artifact_location=str(out_dir.resolve() / "mlartifacts")
            )
        )
        self.run_id: str = self._client.create_run(experiment_id, run_name=out_dir.name).info.run_id

    def log(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items() if math.isfinite(v)]
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


# name -> (class, what fixes a failed start)
TRACKERS: dict[str, tuple[Callable[[Path], Tracker], str]] = {
    "tensorboard": (TensorBoardTracker, f"{install_command('train')} (torch and tensorboard)"),
    "wandb": (
        WandbTracker,
        f"{install_command('trackers')} and set WANDB_API_KEY (or WANDB_MODE=offline to log locally)",
    ),
    "mlflow": (
        MLflowTracker,
        f"{install_command('trackers')}; check MLFLOW_TRACKING_URI (unset: SQLite under the output dir)",
    ),
}

_chosen: contextvars.ContextVar[tuple[str, ...] | None] = contextvars.ContextVar("agl_trackers", default=None)


@contextlib.contextmanager
def use_trackers(names: Sequence[str] | None) -> Iterator[None]:
    """Within the block, MetricsLoggers that are not told otherwise use ``names`` (None: the defaults)."""
    token = _chosen.set(None if names is None else check_names(names))
    try:
        yield
    finally:
        _chosen.reset(token)


def check_names(names: Sequence[str]) -> tuple[str, ...]:
    """``names`` as a tuple; an unknown name is a ``ConfigError`` listing the known ones."""
    if isinstance(names, str):  # trackers="wandb" means one tracker, not five letters
        names = (names,)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"unknown tracker(s) {unknown}; choose from {sorted(TRACKERS)}")
    return tuple(dict.fromkeys(names))


def default_trackers(tensorboard: bool = True) -> tuple[str, ...]:
    """The trackers of ``use_trackers``, else TensorBoard if installed (and ``tensorboard``) and wandb if
    its env is set."""
    chosen = _chosen.get()
    if chosen is not None:
        return chosen
    names = []
    if tensorboard and importlib.util.find_spec("torch") and importlib.util.find_spec("tensorboard"):
        names.append("tensorboard")
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
        names.append("wandb")
    return tuple(names)


def start_trackers(names: Sequence[str], out_dir: Path) -> list[Tracker]:
    """Start each named tracker; one that fails warns (name, error, fix) and is left out."""
    started: list[Tracker] = []
    for name in check_names(names):
        factory, fix = TRACKERS[name]
        try:
            started.append(factory(out_dir))
        except Exception as exc:
            # a warning, not a log record: it reaches stderr without any logging setup
            warnings.warn(
                f"agl: the {name} tracker could not start, so this run logs nothing to {name} "
                f"({type(exc).__name__}: {exc}). Fix: {fix}; or leave {name!r} out of trackers.",
                TrackerWarning,
                stacklevel=3,
            )
    return started


def close_trackers(trackers: Sequence[Tracker]) -> None:
    """Close every tracker; one that fails to close does not keep the others open."""
    errors: list[tuple[str, BaseException]] = []
    for tracker in trackers:
        try:
            tracker.close()
        except Exception as exc:
            errors.append((tracker.name, exc))
    for name, error in errors:
        warnings.warn(f"agl: the {name} tracker failed to close: {error}", TrackerWarning, stacklevel=3)


def log_all(trackers: list[Tracker], step: int, values: Mapping[str, Any]) -> None:
    """Send the numeric ``values`` of ``step`` to every tracker; one that fails (a lost connection) warns
    and is dropped from ``trackers``, so training goes on."""
    scalars = {k: float(v) for k, v in values.items() if k != "step" and isinstance(v, (int, float))}
    for tracker in list(trackers):
        try:
            tracker.log(step, scalars)
        except Exception as exc:
            trackers.remove(tracker)
            warnings.warn(
                f"agl: the {tracker.name} tracker failed at step {step} and is off for the rest of this run "
                f"({type(exc).__name__}: {exc})",
                TrackerWarning,
                stacklevel=3,
            )
