"""What every recipe's ``train.py`` shares: its command line, the GRPO run with an SFT warm start, the curve
and ``summary.json``. Each recipe supplies its agent, its train/test split and its warm-start traces."""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import agl
from agl.algorithm.grpo import GRPO, GRPOConfig, LossConfig, WarmStart
from agl.models import smollm2, tiny_model


def recipe_args(
    doc: str, name: str, *, steps: int = 10, sft_steps: int = 12, test: int = 64
) -> argparse.Namespace:
    """The recipes' common options; ``--model tiny`` shrinks every default to a smoke run."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--seed", type=int, default=0)
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
        "--lr", type=float, default=None, help="GRPO learning rate (default: 2e-5; tiny: 1e-4)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature of training rollouts"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help=f"output folder (default: results/{name}[-tiny])"
    )
    args = parser.parse_args()
    tiny = args.model == "tiny"
    args.out = args.out or Path(f"results/{name}-tiny" if tiny else f"results/{name}")
    args.steps = args.steps if args.steps is not None else (1 if tiny else steps)
    args.sft_steps = args.sft_steps if args.sft_steps is not None else (1 if tiny else sft_steps)
    args.test = args.test if args.test is not None else (4 if tiny else test)
    args.tasks_per_step = args.tasks_per_step or (2 if tiny else 6)
    args.lr = args.lr or (1e-4 if tiny else 2e-5)
    args.sft_lr = 1e-4 if tiny else 2e-5
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("agl.algorithm.grpo").setLevel(logging.INFO)  # phase results and warm-start losses
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
    grpo: dict[str, Any] = field(default_factory=dict)  # extra GRPOConfig fields (e.g. agent=...)
    report: Callable[[Path, int], dict[str, Any]] | None = None  # extra summary fields from the run's store


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
        seed=args.seed,
        warm_start=WarmStart(
            conversations=recipe.warm_start,
            tools=recipe.tools,
            steps=args.sft_steps,
            batch_size=8,
            lr=args.sft_lr,
            seed=args.seed,
        )
        if args.sft_steps
        else None,
        **recipe.grpo,
    )
    started = time.perf_counter()
    trainer = agl.Trainer(
        algorithm=GRPO(config),
        n_runners=32,
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
        "wall_time_s": round(wall, 1),
        "seed": args.seed,
    }
    if recipe.report is not None:
        summary.update(recipe.report(args.out / "store.db", len(recipe.test)))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return summary


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
