"""``grpo_vs_trl.py``'s bookkeeping: which rollouts agl trains, each side's medians, the speed-up ratios (per
round and of medians), the sample-count check between the sides, precisions and the result's variant name.

Apart from the benchmark's script so its tests can call these on hand-made rows without running a side.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from typing import Any

from agl.schemas import Rollout

SIDES = ("fit_async", "fit", "inproc", "trl")


# ----- which rollouts agl trains ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Seen:
    """One rollout of the fit side as its agent saw it: when it began, its task, tokens, reward, group, step."""

    began: float
    task_id: str
    tokens: int
    reward: float
    group_id: str
    step: int | None

    @classmethod
    def of(cls, rollout: Rollout, began: float, task_id: str, tokens: int, reward: float) -> Seen:
        step = rollout.metadata.get("step")
        group = rollout.group_id or rollout.rollout_id
        return cls(began, task_id, tokens, reward, group, step if isinstance(step, int) else None)


def split_steps(seen: list[Seen], per_step: int, steps: int) -> list[list[Seen]]:
    """The rollouts of each step: by the step GRPO enqueued them for, else (no step recorded) finishing order."""
    if all(s.step is not None for s in seen):
        found = sorted({s.step for s in seen if s.step is not None})
        return [[s for s in seen if s.step == step] for step in found]
    return [seen[i * per_step : (i + 1) * per_step] for i in range(steps)]


def trained_rollouts(chunk: list[Seen]) -> list[Seen]:
    """The rollouts agl trains on: those of groups whose rewards differ (``build_batch`` skips tied groups)."""
    rewards: dict[str, set[float]] = {}
    for s in chunk:
        rewards.setdefault(s.group_id, set()).add(round(s.reward, 9))
    return [s for s in chunk if len(rewards[s.group_id]) > 1]


# ----- precision -------------------------------------------------------------------------------------------------
def agl_precision(args: argparse.Namespace) -> str:
    """agl's precision on the CPU: ``--precision`` (``auto`` resolves as agl does: bf16 on a CPU with native
    bf16, else fp32; AGL_PRECISION overrides)."""
    from agl.compute.precision import resolve_precision

    return resolve_precision(args.precision, "cpu")


def trl_precision(args: argparse.Namespace) -> str:
    """TRL's precision: ``bf16`` is its ``bf16=True`` (autocast, as agl's bf16; TRL's own default)."""
    return agl_precision(args) if args.trl_precision == "same" else str(args.trl_precision)


def variant_name(args: argparse.Namespace) -> str:
    """The result file's variant: model, task, agl's precision, and TRL's where it differs (``smollm2-fp32``,
    ``smollm2-fp32-trl-bf16``)."""
    name = str(args.model) + ("-tools" if args.task == "tools" else "") + f"-{agl_precision(args)}"
    trl_ran = "trl" in args.sides and not args.skip_single_turn
    return name + (
        f"-trl-{trl_precision(args)}" if trl_ran and trl_precision(args) != agl_precision(args) else ""
    )


# ----- summary ------------------------------------------------------------------------------------------------
def _median(values: list[Any]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def summarize(
    side: str, args: argparse.Namespace, runs: list[dict[str, Any]], plan: list[Any]
) -> dict[str, Any]:
    """Medians over every round's steps but the first (warm-up); counts what differs between the sides."""
    # fit_async: its last step overlaps nothing, and a step that finds its rollouts done is short while the
    # next waits longer, so its per-step figure is the mean period (total time / steps), not a median
    end = -1 if side == "fit_async" and args.steps > 2 else None
    steady = [s for run in runs for s in run["steps"][1:end]] or [s for run in runs for s in run["steps"]]
    expected = [sorted(t["id"] for t in step) for step in plan]
    row: dict[str, Any] = {
        "bench": bench_name(args),
        "side": side,
        "model": args.model,
        "prompts_per_step": args.prompts,
        "group_size": args.group,
        "max_tokens": args.max_tokens,
        "rounds": len(runs),
        "steps_per_round": args.steps,
        "steady_steps": len(steady),
        "step_s": _median([s["step_s"] for s in steady])
        if end is None
        else _mean([s["step_s"] for s in steady]),
        "wall_s": _median([s.get("wall_s") for s in steady]),
        "trained_tokens_per_s": _median([s["tokens"] / s["step_s"] for s in steady])
        if end is None
        else round(sum(s["tokens"] for s in steady) / sum(s["step_s"] for s in steady), 3),
        "tokens_per_step": _median([s["tokens"] for s in steady]),
        "samples_per_step": _median([s["samples"] for s in steady]),
        "steps_without_update": sum(1 for s in steady if s["samples"] == 0),
        # agl skips a step whose groups all tied (TRL trains it): the steps that trained, alone
        "updating_step_s": _median([s["step_s"] for s in steady if s["samples"] > 0]),
        "first_step_s": _median([run["steps"][0]["step_s"] for run in runs if run["steps"]]),
        "setup_s": _median([run.get("setup_s") for run in runs]),
        "reward_first": _median([run["steps"][0]["reward"] for run in runs if run["steps"]]),
        "reward_last": _median([run["steps"][-1]["reward"] for run in runs if run["steps"]]),
        "same_prompts": all([s.get("task_ids") for s in run["steps"]] == expected for run in runs),
        "threads": args.threads,
    }
    if side.startswith("fit"):
        row["agent_client"] = args.agent_client
    for key in ("gen_s", "update_s", "sync_s"):
        if any(key in s for s in steady):
            row[key] = _median([s.get(key) for s in steady])
    if side == "trl":
        row["versions"] = runs[0].get("versions")
        row["gradient_checkpointing"] = args.trl_gradient_checkpointing
        row["precision"] = trl_precision(args)
        row["bf16"] = row["precision"] == "bf16"
    else:
        row["precision"] = agl_precision(args)
    return row


def bench_name(args: argparse.Namespace) -> str:
    return "grpo_tools" if args.task == "tools" else "grpo_single_turn"


RATIOS = {  # ratio name -> (the side row's figure, True where lower is faster)
    "speedup_step": ("step_s", True),
    "speedup_wall": ("wall_s", True),
    "speedup_tokens_per_s": ("trained_tokens_per_s", False),
}


def _ratio(fast: dict[str, Any], slow: dict[str, Any], name: str) -> float | None:
    """How many times faster ``fast`` is than ``slow`` in the figure ``name`` reads (None when one is missing)."""
    key, lower = RATIOS[name]
    a, b = (slow[key], fast[key]) if lower else (fast[key], slow[key])
    return round(a / b, 2) if a and b else None


def ratios(
    rows: dict[str, dict[str, Any]], per_round: list[dict[str, dict[str, Any]]] | None = None
) -> list[dict[str, Any]]:
    """Speed-up of each side over each later one: per step (step_s, wall_s) and in trained tokens/s.

    ``speedup_*`` is the ratio of the medians over every round; with ``per_round`` (each round's side rows,
    the sides run back to back) also each round's own ratio, and their median and range (min, max).
    """
    out = []
    names = [s for s in SIDES if s in rows]
    for i, fast in enumerate(names):
        for slow in names[i + 1 :]:
            a = rows[fast]
            row: dict[str, Any] = {
                "bench": f"{a['bench']}_ratio",
                "model": a["model"],
                "side": fast,
                "over": slow,
            }
            for name in RATIOS:
                row[name] = _ratio(rows[fast], rows[slow], name)
                got = [_ratio(r[fast], r[slow], name) for r in per_round or [] if fast in r and slow in r]
                present = [g for g in got if g is not None]
                row[f"{name}_rounds"] = got
                row[f"{name}_median"] = round(statistics.median(present), 2) if present else None
                row[f"{name}_range"] = [min(present), max(present)] if present else None
            out.append(row)
    return out


def _spread(q: dict[str, Any], name: str) -> str:
    """A ratio cell: the median of the rounds' ratios and their range, or the ratio of medians alone."""
    median, span = q.get(f"{name}_median"), q.get(f"{name}_range")
    if median is None or span is None:
        return f"{q[name]}x" if q[name] else "-"
    return f"{median}x ({span[0]}-{span[1]}x, {len(q[f'{name}_rounds'])} rounds; all steps {q[name]}x)"


def table(rows: dict[str, dict[str, Any]], ratio_rows: list[dict[str, Any]]) -> str:
    lines = [
        "| side | precision | s/step (median) | wall s/step | trained tok/s | gen s | update s | samples/step "
        "| no-update steps | s/updating step |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for side, r in rows.items():
        cells = [r["precision"], r["step_s"], r["wall_s"], r["trained_tokens_per_s"], r.get("gen_s")]
        cells += [r.get("update_s"), r["samples_per_step"], r["steps_without_update"], r["updating_step_s"]]
        lines.append(f"| {side} | " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    lines += [
        "",
        "| ratio (median of rounds, min-max) | per step | per wall step | trained tokens/s |",
        "|---|---:|---:|---:|",
    ]
    for q in ratio_rows:
        lines.append(f"| {q['side']} / {q['over']} | " + " | ".join(_spread(q, n) for n in RATIOS) + " |")
    return "\n".join(lines)


def sample_mismatches(runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Each (round, step) where the sides trained different sample counts, as a line naming each side's count.

    Sides that train different samples do different work, so their speed ratio would not compare like with like.
    """
    by_round: dict[int, dict[str, list[float]]] = {}
    for side, got in runs.items():
        for i, run in enumerate(got):
            by_round.setdefault(run.get("round", i), {})[side] = [s["samples"] for s in run["steps"]]
    out = []
    for round_, sides in sorted(by_round.items()):
        for step in range(max(len(v) for v in sides.values())):
            counts = {side: v[step] if step < len(v) else None for side, v in sides.items()}
            if len(sides) > 1 and len(set(counts.values())) > 1:
                shown = ", ".join(f"{side} {'-' if c is None else f'{c:g}'}" for side, c in counts.items())
                out.append(f"round {round_ + 1}, step {step + 1}: {shown}")
    return out


def require_same_samples(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Exit with each (round, step) named when the sides trained different sample counts: a speed ratio between
    sides that did different work would mislead."""
    mismatches = sample_mismatches(runs)
    if mismatches:
        raise SystemExit(
            "the sides trained different sample counts (agl skips groups whose rewards tie, TRL trains them), "
            "so their speeds are not comparable; no result saved:\n  " + "\n  ".join(mismatches)
        )
