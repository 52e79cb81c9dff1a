"""What every recipe's ``train.py`` shares: its command line, the GRPO run with an SFT warm start, the curve
and ``summary.json``. Each recipe supplies its agent, its train/test split and its warm-start traces."""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import agl
from agl.algorithm.grpo import GRPO, GRPOConfig, LossConfig, WarmStart
from agl.models import qwen_coder, smollm2, tiny_model


def recipe_args(
    doc: str,
    name: str,
    *,
    steps: int = 10,
    sft_steps: int = 12,
    test: int = 64,
    argv: Sequence[str] | None = None,
    options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The recipes' common options (and a recipe's own, which ``options`` adds to the parser); ``--model
    tiny`` shrinks every default to a smoke run. With ``--seeds`` it runs ``examples.<name>.train`` once
    per seed (:func:`run_seeds`) and exits."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if options is not None:
        options(parser)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    add_seed_options(parser)
    parser.add_argument("--steps", type=int, default=None, help=f"GRPO steps (default: {steps}; tiny: 1)")
    parser.add_argument(
        "--sft-steps", type=int, default=None, help=f"SFT warm-start steps (default: {sft_steps}; tiny: 1)"
    )
    parser.add_argument("--test", type=int, default=None, help=f"held-out tasks (default: {test}; tiny: 4)")
    parser.add_argument(
        "--tasks-per-step", type=int, default=None, help="GRPO tasks per step (default: 6; tiny: 2)"
    )
    parser.add_argument("--group-size", type=int, default=4, help="rollouts per task in a GRPO group")
    parser.add_argument(
        "--runners", type=int, default=32, help="rollouts run at once (runner slots; default: 32)"
    )
    parser.add_argument(
        "--lr", type=float, default=None, help="GRPO learning rate (default: 2e-5; tiny: 1e-4)"
    )
    parser.add_argument(
        "--sft-lr", type=float, default=None, help="warm-start learning rate (default: 2e-5; tiny: 1e-4)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature of training rollouts"
    )
    add_refill_option(parser)
    parser.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default: results/{name}[-tiny])"
    )
    add_teacher_options(parser)
    args = parser.parse_args(argv)
    tiny = args.model == "tiny"
    args.out = args.out or Path(f"results/{name}-tiny" if tiny else f"results/{name}")
    if args.seeds:  # one process per seed, each parsing its own options: nothing else to do here
        run_seeds(f"examples.{name}.train", args, recipe_phases)
        raise SystemExit(0)
    args.steps = args.steps if args.steps is not None else (1 if tiny else steps)
    args.sft_steps = args.sft_steps if args.sft_steps is not None else (1 if tiny else sft_steps)
    args.test = args.test if args.test is not None else (4 if tiny else test)
    args.tasks_per_step = args.tasks_per_step or (2 if tiny else 6)
    args.lr = args.lr or (1e-4 if tiny else 2e-5)
    args.sft_lr = args.sft_lr or (1e-4 if tiny else 2e-5)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    for name in ("agl.algorithm.grpo", "agl.algorithm.teacher"):  # phase results, warm-start losses
        logging.getLogger(name).setLevel(logging.INFO)
    return args


@dataclass
class Recipe:
    """One recipe run: the agent, its tasks and warm-start traces, and how to report it."""

    name: str
    framework: str
    agent: Any
    train: list[dict[str, Any]]
    test: list[dict[str, Any]]
    warm_start: list[list[dict[str, Any]]]
    tools: list[dict[str, Any]] | None = None
    metric: str = "accuracy"
    grpo: dict[str, Any] = field(default_factory=dict)  # extra GRPOConfig fields (e.g. agents=(...))
    report: Callable[[Path, int], dict[str, Any]] | None = None  # extra summary fields from the run's store


def add_seed_options(parser: argparse.ArgumentParser, *, precision: str = "auto") -> None:
    """``--seed`` (training), ``--split-seed`` (the data and held-out split), ``--seeds``/``--result`` (one
    run per seed and their spread), ``--precision`` (default ``precision``, as the script measured best)."""
    parser.add_argument(
        "--seed", type=int, default=0, help="training seed: sampling, task order, model init (tiny)"
    )
    parser.add_argument(
        "--split-seed",
        type=int,
        default=0,
        help="seed of the tasks and the held-out split, fixed while --seed varies (default: 0)",
    )
    parser.add_argument(
        "--seeds",
        type=_seed_list,
        default=None,
        help="run each of these training seeds in turn (e.g. 0,1,2) into OUT/seed-N/ and summarise them",
    )
    parser.add_argument(
        "--result",
        type=Path,
        default=None,
        help="with --seeds: where the summary JSON goes (default: OUT/seeds.json)",
    )
    parser.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default=precision,
        help=f"policy and engine matmul precision (default: {precision}; auto: bf16 on a CPU with native "
        "bf16, else fp32, and AGL_PRECISION overrides it)",
    )


def add_refill_option(parser: argparse.ArgumentParser, *, default: bool = False) -> None:
    """``--refill`` / ``--no-refill``: ``GRPOConfig(refill=...)``, on or off by default as the script chose."""
    parser.add_argument(
        "--refill",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="dynamic sampling: set aside groups whose rewards tie and draw more tasks until a step has signal "
        f"(default: {'on' if default else 'off'})",
    )


def add_teacher_options(
    parser: argparse.ArgumentParser, *, samples: int = 4, tasks: int = 32, keep: str = "any"
) -> None:
    """``--teacher`` and its sampling budget: a warm start from a stronger model, no gold traces used.
    ``samples``, ``tasks`` and ``keep`` are the recipe's defaults for it."""
    teacher = parser.add_argument_group("warm start from a teacher instead of the gold-derived traces")
    teacher.add_argument(
        "--teacher",
        default=None,
        help="a stronger model: a local Hugging Face folder, an OpenAI-compatible base URL (http...), "
        "qwen-coder (Qwen2.5-Coder-0.5B-Instruct; make teacher-model installs it) or qwen-coder-1.5b "
        "(make teacher-model SIZE=1.5b); or the teacher_traces.jsonl an earlier --teacher run wrote, to "
        "learn from its kept conversations without calling the teacher again",
    )
    teacher.add_argument("--teacher-model", default=None, help="the model name a --teacher URL serves")
    teacher.add_argument(
        "--teacher-samples",
        type=int,
        default=samples,
        help=f"teacher rollouts per train task (default: {samples})",
    )
    teacher.add_argument(
        "--teacher-tasks",
        type=int,
        default=tasks,
        help=f"train tasks the teacher runs on (default: {tasks})",
    )
    teacher.add_argument(
        "--teacher-keep",
        choices=("any", "tool-calls"),
        default=keep,
        help="which rewarded conversations the student learns from: any, or only those that call a tool "
        f"(a right answer reached without the agent's tools teaches the student to skip them; default: {keep})",
    )


def _seed_list(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds takes comma-separated integers such as 0,1,2, got {text!r}"
        ) from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"--seeds needs distinct integers such as 0,1,2, got {text!r}")
    return seeds


def _without(argv: Sequence[str], options: Sequence[str]) -> list[str]:
    """``argv`` less ``options`` and their values (``--opt value`` or ``--opt=value``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not any(arg.startswith(f"{o}=") for o in options):
            out.append(arg)
    return out


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


#: the held-out phases a seeds summary reports, in order
PHASES = ("before", "after_warm_start", "after_grpo")


def run_seeds(
    module: str, args: argparse.Namespace, phases: Callable[[dict[str, Any]], dict[str, float | None]]
) -> dict[str, Any]:
    """Run ``python -m module`` once per ``args.seeds`` into ``OUT/seed-N/`` (one process each, so CPU
    time and peak RSS are its own); write the per-seed held-out scores (``phases`` reads them from a
    run's ``summary.json``), CPU seconds, peak RSS, and their mean and min-max to ``args.result``."""
    passed = _without(sys.argv[1:], ["--seeds", "--result", "--seed", "--out"])
    runs = []
    for seed in args.seeds:
        out = args.out / f"seed-{seed}"
        command = [sys.executable, "-m", module, *passed, "--seed", str(seed), "--out", str(out)]
        print(f"seed {seed}: {' '.join(command[1:])}", flush=True)
        started = time.perf_counter()
        proc = subprocess.Popen(command)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"seed {seed} failed (exit {proc.returncode}): {' '.join(command)}")
        summary = json.loads((out / "summary.json").read_text())
        runs.append(
            {
                "seed": seed,
                "out": str(out),
                **phases(summary),
                "cpu_s": round(usage.ru_utime + usage.ru_stime, 1),
                "peak_rss_gb": round(usage.ru_maxrss / 1024**2, 3),  # Linux reports KiB
                "wall_s": round(time.perf_counter() - started, 1),
            }
        )
    taught = ["teacher"] if any(r.get("teacher") is not None for r in runs) else []  # its own score
    result = {
        "command": [Path(sys.executable).name, "-m", module, *sys.argv[1:]],
        "commit": _commit(),
        "seeds": list(args.seeds),
        "split_seed": args.split_seed,
        "runs": runs,
        **spread(runs, [*PHASES, *taught, "cpu_s", "peak_rss_gb", "wall_s"]),
    }
    path = args.result or args.out / "seeds.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("seeds", "mean", "min", "max")}, indent=2))
    print(f"wrote {path}")
    return result


def spread(runs: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[str, dict[str, float | None]]:
    """``{"mean": ..., "min": ..., "max": ...}`` of each key over the runs that have a number for it."""
    out: dict[str, dict[str, float | None]] = {"mean": {}, "min": {}, "max": {}}
    for key in keys:
        values = [float(r[key]) for r in runs if isinstance(r.get(key), (int, float))]
        out["mean"][key] = statistics.fmean(values) if values else None
        out["min"][key] = min(values, default=None)
        out["max"][key] = max(values, default=None)
    return out


def recipe_phases(summary: dict[str, Any]) -> dict[str, float | None]:
    """A recipe's held-out scores from its ``summary.json``."""
    return {
        "before": summary["test_base"],
        "after_warm_start": summary["test_after_warm_start"],
        "after_grpo": summary["test_after_grpo"],
        "teacher": summary.get("test_teacher"),
    }


def run_recipe(recipe: Recipe, args: argparse.Namespace) -> dict[str, Any]:
    """Base model, SFT warm start on train traces, GRPO; held-out score at each phase; curve and summary."""
    tiny = args.model == "tiny"
    config = GRPOConfig(
        model_path=str(tiny_model(seed=args.seed) if tiny else smollm2()),
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        lr=args.lr,
        eval_every=args.steps,  # held-out score after the warm start and at the end
        loss=LossConfig(aggregation="token_mean"),
        activation_checkpointing=True,
        precision=args.precision,
        seed=args.seed,
        warm_start=warm_start(recipe, args),
        refill=args.refill,
        **recipe.grpo,
    )
    started = time.perf_counter()
    trainer = agl.Trainer(
        algorithm=GRPO(config),
        n_runners=args.runners,
        output_dir=str(args.out),
        serving=agl.Serving(sampling={"temperature": args.temperature}),
    )
    result = trainer.fit(recipe.agent, recipe.train, recipe.test)
    wall = time.perf_counter() - started
    phases = result["phases"]
    plot(
        result["history"],
        phases,
        args.out / "curve.png",
        f"{recipe.name} ({recipe.framework})",
        recipe.metric,
    )
    base, warm, final = phases["base"], phases.get("after_warm_start", phases["base"]), phases["after_grpo"]
    summary: dict[str, Any] = {
        "recipe": recipe.name,
        "framework": recipe.framework,
        "model": "tiny" if tiny else "SmolLM2-135M-Instruct",
        "metric": recipe.metric,
        "test_base": base,
        "test_after_warm_start": warm,
        "test_after_grpo": final,
        "test_teacher": phases.get("teacher"),  # the teacher's own held-out score (a teacher warm start)
        "gain_total": final - base,
        "gain_from_grpo": final - warm,
        "train_tasks": len(recipe.train),
        "test_tasks": len(recipe.test),
        "grpo_steps": args.steps,
        "tasks_per_step": args.tasks_per_step,
        "group_size": args.group_size,
        "grpo_lr": args.lr,
        "sft_steps": args.sft_steps,
        "sft_lr": args.sft_lr,
        "temperature": args.temperature,
        "refill": args.refill,
        "warm_start_from": args.teacher or ("gold-derived traces" if args.sft_steps else None),
        "teacher_rollouts": result.get("teacher"),  # a --teacher run's rollouts, kept ones, samples
        "wall_time_s": round(wall, 1),
        "seed": args.seed,
        "split_seed": args.split_seed,
        "precision": result.get("precision", args.precision),  # "auto" resolved
        # held-out replies cut off at the agent's max_tokens (a reply that loops never ends), per phase
        "held_out_cut_off_rate": {
            phase: behaviour.get("val_behaviour_cut_off_rate")
            for phase, behaviour in result["phase_behaviour"].items()
        },
    }
    if recipe.report is not None:
        summary.update(recipe.report(args.out / "store.db", len(recipe.test)))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


def warm_start(recipe: Recipe, args: argparse.Namespace) -> WarmStart | agl.Teacher | None:
    """The SFT warm start: the teacher's best rollouts when ``--teacher`` names one (no gold traces
    used), else the recipe's gold-derived conversations; none with ``--sft-steps 0``."""
    if not args.sft_steps:
        return None
    schedule = {"steps": args.sft_steps, "batch_size": 8, "lr": args.sft_lr, "seed": args.seed}
    if args.teacher:
        return teacher_warm_start(args, **schedule)
    return WarmStart(conversations=recipe.warm_start, tools=recipe.tools, **schedule)


def teacher_warm_start(args: argparse.Namespace, **schedule: Any) -> agl.Teacher | WarmStart:
    """The ``agl.Teacher`` that ``--teacher`` names, with the student's SFT ``schedule``; for a
    ``.jsonl`` file, the warm start on the traces it holds."""
    if args.teacher.endswith(".jsonl"):
        return WarmStart.from_jsonl(args.teacher, **schedule)
    if args.teacher.startswith(("http://", "https://")):
        where = {"endpoint": args.teacher}
    elif args.teacher in ("qwen-coder", "qwen-coder-1.5b"):
        where = {"path": str(qwen_coder(size="1.5b" if args.teacher.endswith("1.5b") else "0.5b"))}
    else:
        where = {"path": args.teacher}
    return agl.Teacher(
        **where,
        model=args.teacher_model,
        samples_per_task=args.teacher_samples,
        max_tasks=args.teacher_tasks,
        keep=agl.Teacher.calls_a_tool if args.teacher_keep == "tool-calls" else None,
        **schedule,
    )


def plot(
    history: list[dict[str, Any]], phases: dict[str, float], path: Path, title: str, metric: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    steps = list(range(1, len(history) + 1))
    ax.plot(steps, [h.get("reward_mean", float("nan")) for h in history], label="train reward (mean)")
    start = phases.get("after_warm_start", phases["base"])
    val = [(0, start)] + [(i + 1, h["val_reward"]) for i, h in enumerate(history) if "val_reward" in h]
    ax.plot([v[0] for v in val], [v[1] for v in val], marker="o", label=f"held-out {metric}")
    ax.axhline(phases["base"], ls="--", color="gray", label="base model")
    ax.set_xlabel("GRPO step (0: after the SFT warm start)")
    rewards = [h["reward_mean"] for h in history if "reward_mean" in h]
    ax.set_ylim(min([-0.05, *(r - 0.05 for r in rewards)]), 1.05)  # room for penalties below 0
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
