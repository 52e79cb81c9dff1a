"""Per-step training metrics: a CSV file, a curve PNG, a progress bar and a one-line console summary per
step (visible without any logging setup; ``console=False`` silences it), forwarded to the experiment
trackers of :mod:`agl.trackers` (TensorBoard, wandb, MLflow).
"""

from __future__ import annotations

import csv
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape

from agl.errors import install_command
from agl.failures import FAILURE_CLASSES as _FAILURE_CLASSES
from agl.trackers import Tracker, check_names, close_trackers, default_trackers, log_all, start_trackers

log = logging.getLogger(__name__)

_SHOWN = ("reward_mean", "val_reward", "loss", "sft_loss", "step_time_s", "peak_rss_gb")
_LOSSES = ("loss", "sft_loss")


class MetricsLogger:
    """``log(step, {name: value})`` writes ``metrics.csv`` under ``out_dir`` and sends the step to ``trackers``.

    ``trackers`` names :mod:`agl.trackers` ones (None: those of ``agl.Trainer(trackers=...)`` or the
    defaults); ``tensorboard=False`` leaves TensorBoard out of the defaults.

    ``total_steps`` and ``progress_key`` drive the progress bar: by default it counts steps; with
    ``progress_key`` it shows that value (e.g. metric calls spent of a budget), labelled ``label``.
    The console line names the step ``step_name`` (default ``label``).
    ``plot_x``/``plot_y`` name the columns :meth:`close` draws into ``curve.png`` (matplotlib, if installed).
    """

    def __init__(
        self,
        out_dir: str | Path,
        total_steps: int | None = None,
        progress: bool = True,
        resume: bool = False,
        *,
        console: bool = True,
        shown: Sequence[str] = _SHOWN,
        label: str = "step",
        step_name: str | None = None,
        progress_key: str | None = None,
        plot_x: str = "step",
        plot_y: Sequence[str] | None = None,
        title: str = "training",
        tensorboard: bool = True,
        trackers: Sequence[str] | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        self.shown, self.label, self.progress_key = tuple(shown), label, progress_key
        self.step_name = step_name or label
        self.plot_x, self.plot_y, self.title = plot_x, tuple(plot_y or shown), title
        existing = self.out_dir / "metrics.csv"
        if resume and existing.exists():  # keep the earlier run's rows
            with existing.open() as f:
                self.rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
        names = check_names(trackers) if trackers is not None else default_trackers(tensorboard=tensorboard)
        self.trackers: list[Tracker] = start_trackers(names, self.out_dir)
        self._console: Any = None
        if console:
            from rich.console import Console

            self._console = Console(stderr=True)
        self._progress: Any = None
        if progress and total_steps:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn(f"[bold]{label} " + "{task.completed:.0f}/{task.total:.0f}"),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[summary]}"),
                console=self._console,
            )
            self._task = self._progress.add_task(title, total=total_steps, summary="")
            self._progress.start()

    def summary(self, row: Mapping[str, Any]) -> str:
        """The compact text shown per step: the ``shown`` metrics present in ``row``, then what went wrong.

        A step that trained nothing (``samples`` 0) reads ``no update`` where its loss would be; groups
        whose rollouts all scored alike read ``zero_var=N/M groups`` (``refill=+N rollouts`` when more
        tasks were drawn in their place); failed rollouts ``failed=N/M``
        (``val_failed`` for validation) with their classes (``failed_infra`` ...) and the ``first_error``
        text when the row carries them.
        """
        no_update = row.get("samples") == 0
        parts: list[str] = []
        for key in self.shown:
            if no_update and key in _LOSSES:
                if "no update" not in parts:
                    parts.append("no update")
            elif isinstance(row.get(key), (int, float)):
                parts.append(f"{key}={_fmt(row[key])}")
        if row.get("zero_variance_groups") and row.get("groups"):
            parts.append(f"zero_var={row['zero_variance_groups']:.0f}/{row['groups']:.0f} groups")
        if row.get("refill_rollouts"):  # GRPOConfig(refill=True) drew tasks in place of flat groups
            parts.append(f"refill=+{row['refill_rollouts']:.0f} rollouts")
        for prefix in ("", "val_"):
            failed, total = row.get(f"{prefix}failed_rollouts"), row.get(f"{prefix}rollouts")
            if failed:
                classes = [
                    f"{c} {n:.0f}" for c in _FAILURE_CLASSES if (n := row.get(f"{prefix}failed_{c}") or 0)
                ]
                parts.append(
                    f"{prefix}failed={failed:.0f}"
                    + (f"/{total:.0f}" if total else "")
                    + (f" ({', '.join(classes)})" if classes else "")
                )
        if row.get("first_error"):
            parts.append(f"first error: {row['first_error']}")
        return "  ".join(parts)

    def log(self, step: int, values: dict[str, Any]) -> None:
        row = {"step": step, **{k: v for k, v in values.items() if isinstance(v, (int, float))}}
        self.rows.append(row)
        self._write_csv()
        log_all(self.trackers, step, row)
        summary = escape(self.summary({**values, **row}))  # an error text may hold [brackets]
        if self._progress is not None:
            done = row.get(self.progress_key, step) if self.progress_key else step
            self._progress.update(self._task, completed=done, summary=summary)
        if self._console is not None:
            self._console.print(
                f"[dim]{self.title}[/dim] {self.step_name} {step}: {summary}", highlight=False, soft_wrap=True
            )
        log.info("step %d: %s", step, row)

    def _write_csv(self) -> None:
        columns = sorted({k for r in self.rows for k in r}, key=lambda k: (k != "step", k))
        with open(self.out_dir / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)

    def plot(self, path: str | Path | None = None) -> Path | None:
        """Draw ``plot_y`` against ``plot_x`` into ``curve.png``; None if matplotlib or the data is missing."""
        series = {
            y: [(r[self.plot_x], r[y]) for r in self.rows if self.plot_x in r and y in r] for y in self.plot_y
        }
        series = {k: v for k, v in series.items() if v}
        if not series:
            return None
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log.info("no curve plot: matplotlib is not installed (%s)", install_command("train"))
            return None
        target = Path(path) if path is not None else self.out_dir / "curve.png"
        panels = curve_panels(list(series))
        fig, axes = plt.subplots(len(panels), 1, figsize=(5.5, 3.4 * len(panels)), sharex=True, squeeze=False)
        for ax, names in zip(axes[:, 0], panels, strict=True):
            for name in names:
                points = series[name]
                ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=name)
            ax.grid(alpha=0.3)
            ax.legend()
            ax.set_ylabel(_unit(names[0]) or "")
        axes[0, 0].set_title(self.title)
        axes[-1, 0].set_xlabel(self.plot_x)
        fig.tight_layout()
        fig.savefig(target, dpi=110)
        plt.close(fig)
        return target

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self.plot()
        close_trackers(self.trackers)


_UNITS = {"_s": "seconds", "_gb": "GB"}  # a metric's name suffix and the axis label of its own panel


def curve_panels(names: Sequence[str]) -> list[list[str]]:
    """The curve's panels, top to bottom: rewards, losses and counts; then durations (``*_s``) and memory
    (``*_gb``), each on an axis of its own, whose scale would otherwise flatten the rewards."""
    panels = [[n for n in names if _unit(n) is None]]
    panels += [[n for n in names if _unit(n) == unit] for unit in _UNITS.values()]
    return [p for p in panels if p]


def _unit(name: str) -> str | None:
    return next((unit for suffix, unit in _UNITS.items() if name.endswith(suffix)), None)


def _fmt(value: Any) -> str:
    return str(value) if isinstance(value, int) else f"{float(value):.3f}"
