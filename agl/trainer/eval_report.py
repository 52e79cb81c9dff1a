"""How ``agl eval`` shows an :class:`~agl.trainer.evaluation.EvalResult`: rich tables, ``eval.json`` and
``eval.png`` (a bar per model with its confidence interval as whiskers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agl.failures import FAILURE_CLASSES
from agl.trainer.evaluation import CONFIDENCE, Comparison, EvalResult

CHANGED_ROWS = 20  # tasks the comparison table lists (largest change first); eval.json keeps all


def _f(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.3f}"


def _ci(interval: tuple[float, float]) -> str:
    return "-" if any(math.isnan(v) for v in interval) else f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def print_result(result: EvalResult, console: Console | None = None) -> None:
    """The per-model table and, when there is one, the comparison."""
    console = console or Console()
    table = Table(
        title=f"agl eval: k={result.k}, pass@{result.pass_k} (reward >= {result.pass_threshold:g} passes)",
        caption=f"CI: {result.ci_method}; failed rollouts are counted by class, not scored",
    )
    for column in (
        "model",
        "mean reward",
        f"mean@{result.k}",
        "CI",
        f"pass@{result.pass_k}",
        "CI",
        "rollouts",
    ):
        table.add_column(column, justify="left" if column == "model" else "right")
    table.add_column("failed (infra/agent/reward)", justify="right")
    for m in result.models:
        by_class = "/".join(str(m.failures.by_class.get(c, 0)) for c in FAILURE_CLASSES)
        table.add_row(
            escape(m.label),
            _f(m.mean_reward),
            _f(m.mean_at_k),
            _ci(m.mean_at_k_ci),
            _f(m.pass_at_k),
            _ci(m.pass_at_k_ci),
            str(m.failures.total),
            f"{m.failures.failed} ({by_class})",
        )
    console.print(table)
    for m in result.models:
        if m.failures.first_error:
            console.print(f"[red]{escape(m.label)}: first error[/] {escape(m.failures.first_error[:200])}")
    if result.comparison is not None:
        print_comparison(result.comparison, console)


def print_comparison(comparison: Comparison, console: Console) -> None:
    """The tasks whose mean reward changed from A to B, and the mean change with its CI."""
    changed = comparison.changed
    table = Table(title=f"{escape(comparison.b)} vs {escape(comparison.a)}: {len(changed)} tasks changed")
    for column in ("task", "#", escape(comparison.a), escape(comparison.b), "change"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for t in changed[:CHANGED_ROWS]:
        table.add_row(
            escape(json.dumps(t.task, default=str)[:50]), str(t.index), _f(t.a), _f(t.b), f"{t.diff:+.3f}"
        )
    if changed:
        console.print(table)
    else:
        console.print(f"{escape(comparison.b)} vs {escape(comparison.a)}: no task's mean reward changed")
    if len(changed) > CHANGED_ROWS:
        console.print(f"... {len(changed) - CHANGED_ROWS} more in eval.json")
    console.print(
        f"mean change over {len(comparison.tasks)} tasks: {_f(comparison.mean_diff)} CI {_ci(comparison.ci)}"
    )


def write_json(result: EvalResult, out: Path) -> Path:
    """``out/eval.json``: every number of the result, NaN as null."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "eval.json"
    path.write_text(json.dumps(result.to_json(), indent=2, default=str) + "\n")
    return path


def write_plot(result: EvalResult, out: Path) -> Path:
    """``out/eval.png``: per model, mean@k and pass@k bars with their CI as whiskers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [m.label for m in result.models]
    width = 0.38
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 * len(labels) + 2), 3.6))
    for offset, name, values, cis in (
        (
            -width / 2,
            f"mean@{result.k}",
            [m.mean_at_k for m in result.models],
            [m.mean_at_k_ci for m in result.models],
        ),
        (
            width / 2,
            f"pass@{result.pass_k}",
            [m.pass_at_k for m in result.models],
            [m.pass_at_k_ci for m in result.models],
        ),
    ):
        heights = [0.0 if math.isnan(v) else v for v in values]
        low = [
            0.0 if math.isnan(v) or math.isnan(c[0]) else v - c[0] for v, c in zip(values, cis, strict=True)
        ]
        high = [
            0.0 if math.isnan(v) or math.isnan(c[1]) else c[1] - v for v, c in zip(values, cis, strict=True)
        ]
        xs = [i + offset for i in range(len(labels))]
        ax.bar(xs, heights, width, yerr=[low, high], capsize=4, label=name)
    ax.set_xticks(list(range(len(labels))), [label[-30:] for label in labels], rotation=15, ha="right")
    ax.set_ylabel("score")
    ax.set_title(f"agl eval (whiskers: {CONFIDENCE:.0%} bootstrap CI over tasks)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "eval.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


__all__ = ["print_comparison", "print_result", "write_json", "write_plot"]
