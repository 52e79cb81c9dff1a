"""Per-step training metrics: a CSV file, a curve PNG, TensorBoard, wandb when configured, a progress bar
and a one-line console summary per step (visible without any logging setup; ``console=False`` silences it).
"""

from __future__ import annotations

import csv
import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SHOWN = ("reward_mean", "val_reward", "loss", "sft_loss", "step_time_s")


class MetricsLogger:
    """``log(step, {name: value})`` writes ``metrics.csv`` and TensorBoard events under ``out_dir``.

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
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.out_dir / "tensorboard"))
            except Exception as exc:  # TensorBoard is optional
                log.info("TensorBoard logging off: %s", exc)
        self._wandb: Any = None
        if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE"):
            try:
                import wandb

                self._wandb = wandb.init(
                    project=os.environ.get("WANDB_PROJECT", "agl"), dir=str(self.out_dir)
                )
            except Exception as exc:
                log.warning("wandb is configured but could not start: %s", exc)
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

    def summary(self, row: dict[str, Any]) -> str:
        """The compact text shown per step: the ``shown`` metrics present in ``row``."""
        return "  ".join(f"{k}={_fmt(row[k])}" for k in self.shown if k in row)

    def log(self, step: int, values: dict[str, Any]) -> None:
        row = {"step": step, **{k: v for k, v in values.items() if isinstance(v, (int, float))}}
        self.rows.append(row)
        self._write_csv()
        for key, value in row.items():
            if key != "step" and self._tb is not None and math.isfinite(float(value)):
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        summary = self.summary(row)
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
            log.info("no curve plot: matplotlib is not installed (pip install 'agl[train]')")
            return None
        target = Path(path) if path is not None else self.out_dir / "curve.png"
        fig, ax = plt.subplots(figsize=(5.5, 3.4))
        for name, points in series.items():
            ax.plot([x for x, _ in points], [y for _, y in points], marker="o", markersize=3, label=name)
        ax.set_xlabel(self.plot_x)
        ax.set_title(self.title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(target, dpi=110)
        plt.close(fig)
        return target

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        self.plot()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _fmt(value: Any) -> str:
    return str(value) if isinstance(value, int) else f"{float(value):.3f}"
