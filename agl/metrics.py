"""Per-step training metrics: a CSV file, TensorBoard, wandb when installed and configured, and a progress bar."""

from __future__ import annotations

import csv
import logging
import math
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_SHOWN = ("reward_mean", "val_reward", "loss", "step_time_s")


class MetricsLogger:
    """``log(step, {name: value})`` writes ``metrics.csv`` and TensorBoard events under ``out_dir``."""

    def __init__(
        self, out_dir: str | Path, total_steps: int | None = None, progress: bool = True, resume: bool = False
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rows: list[dict[str, Any]] = []
        existing = self.out_dir / "metrics.csv"
        if resume and existing.exists():  # keep the earlier run's rows
            with existing.open() as f:
                self.rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
        self._tb: Any = None
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
        self._progress: Any = None
        if progress and total_steps:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]step {task.completed}/{task.total}"),
                BarColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[summary]}"),
            )
            self._task = self._progress.add_task("train", total=total_steps, summary="")
            self._progress.start()

    def log(self, step: int, values: dict[str, Any]) -> None:
        row = {"step": step, **{k: v for k, v in values.items() if isinstance(v, (int, float))}}
        self.rows.append(row)
        self._write_csv()
        for key, value in row.items():
            if key != "step" and self._tb is not None and math.isfinite(float(value)):
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log(row, step=step)
        if self._progress is not None:
            summary = "  ".join(f"{k}={row[k]:.3f}" for k in _SHOWN if k in row)
            self._progress.update(self._task, completed=step, summary=summary)
        log.info("step %d: %s", step, row)

    def _write_csv(self) -> None:
        columns = sorted({k for r in self.rows for k in r}, key=lambda k: (k != "step", k))
        with open(self.out_dir / "metrics.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
