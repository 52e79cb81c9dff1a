"""The main demo: teach SmolLM2-135M-Instruct to solve word problems with a calculator tool, on 2 CPU cores.

    python -m examples.calc.train                 # SmolLM2, about 15 minutes
    python -m examples.calc.train --model tiny    # a fast smoke run of the whole loop

The agent (``examples/calc/agent.py``) is plain openai-SDK code. The loop: measure held-out accuracy;
a short SFT warm start on generated tool-use traces; GRPO through the store, runners, gateway and
engine; measure again. Writes ``results/calc/curve.png`` and ``results/calc/summary.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import agl
from agl.algorithm.base import Algorithm, TrainingContext
from agl.algorithm.grpo import GRPO, GRPOConfig, LossConfig
from agl.algorithm.sft import samples_from_messages
from agl.models import smollm2, tiny_model
from examples.calc.agent import CALCULATOR, SYSTEM, calc_agent, calculate
from examples.calc.tasks import make_tasks


def tool_use_trace(task: dict[str, Any]) -> list[dict[str, Any]]:
    """A correct conversation for ``task``, shaped exactly as the agent sends it."""
    expression = task["expression"]
    arguments = json.dumps({"expression": expression})
    call = {"id": "call-0", "type": "function", "function": {"name": "calculator", "arguments": arguments}}
    result = calculate(expression)
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-0", "content": result},
        {"role": "assistant", "content": f"Answer: {result}"},
    ]


class WarmStartThenGRPO(Algorithm):
    """A custom algorithm: SFT warm start on generated traces, then GRPO; accuracy measured after each phase."""

    def __init__(self, grpo: GRPO, warm_tasks: list[dict[str, Any]], sft_steps: int, sft_batch: int) -> None:
        self.grpo, self.warm_tasks, self.sft_steps, self.sft_batch = grpo, warm_tasks, sft_steps, sft_batch
        self.phases: dict[str, float] = {}

    @property
    def model_path(self) -> str | None:
        return self.grpo.model_path

    async def run(self, ctx: TrainingContext, train: Any, val: Any) -> dict[str, Any]:
        grpo = self.grpo
        grpo.policy = await asyncio.to_thread(grpo._make_policy)
        resources_id = await grpo._publish(ctx, "v0")
        self.phases["base"] = await grpo.evaluate(ctx, val, resources_id)
        print(f"held-out accuracy, base model: {self.phases['base']:.3f}", flush=True)
        if self.sft_steps:
            traces = [tool_use_trace(t) for t in self.warm_tasks]
            samples = samples_from_messages(grpo.policy.tokenizer, traces, [CALCULATOR])
            rng = random.Random(0)
            for step in range(self.sft_steps):
                batch = rng.sample(samples, min(self.sft_batch, len(samples)))
                stats = await asyncio.to_thread(grpo.policy.sft_step, batch)
                print(f"sft step {step + 1}/{self.sft_steps}: loss {stats['sft_loss']:.3f}", flush=True)
            assert ctx.sync_weights is not None
            grpo.version = await ctx.sync_weights(await asyncio.to_thread(grpo.policy.engine_weights))
            resources_id = await grpo._publish(ctx, grpo.version)
            self.phases["after_sft"] = await grpo.evaluate(ctx, val, resources_id)
            print(f"held-out accuracy after SFT warm start: {self.phases['after_sft']:.3f}", flush=True)
        grpo.initial_val = self.phases.get("after_sft", self.phases["base"])
        result: dict[str, Any] = await grpo.run(ctx, train, val)
        self.phases["after_grpo"] = result["val_reward_after"]
        print(f"held-out accuracy after GRPO: {self.phases['after_grpo']:.3f}", flush=True)
        return result


def plot(history: list[dict[str, float]], phases: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    steps = list(range(1, len(history) + 1))
    ax.plot(steps, [h.get("reward_mean", float("nan")) for h in history], label="train reward (mean)")
    start = phases.get("after_sft", phases["base"])
    val = [(0, start)] + [(i + 1, h["val_reward"]) for i, h in enumerate(history) if "val_reward" in h]
    ax.plot([v[0] for v in val], [v[1] for v in val], marker="o", label="held-out accuracy")
    ax.axhline(phases["base"], ls="--", color="gray", label="base model")
    ax.set_xlabel("GRPO step (0: after the SFT warm start)")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("calc agent: SmolLM2 + calculator tool")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="GRPO steps (default: 8, tiny: 2)")
    parser.add_argument(
        "--sft-steps", type=int, default=None, help="SFT warm-start steps (default: 8, tiny: 2)"
    )
    parser.add_argument("--val", type=int, default=None, help="held-out tasks (default: 24, tiny: 8)")
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="sampling temperature of training rollouts"
    )
    parser.add_argument("--out", type=Path, default=Path("results/calc"))
    args = parser.parse_args()
    tiny = args.model == "tiny"
    steps = args.steps if args.steps is not None else (2 if tiny else 8)
    sft_steps = args.sft_steps if args.sft_steps is not None else (2 if tiny else 8)
    n_val = args.val if args.val is not None else (8 if tiny else 24)
    model_path = tiny_model(seed=args.seed) if tiny else smollm2()
    train, val = make_tasks(200, seed=args.seed), make_tasks(n_val, seed=10_000 + args.seed)
    warm = make_tasks(64, seed=20_000 + args.seed)
    config = GRPOConfig(
        model_path=str(model_path),
        steps=steps,
        tasks_per_step=2 if tiny else 4,
        group_size=4,
        lr=1e-4 if tiny else 1e-5,
        eval_every=max(steps // 2, 1),
        loss=LossConfig(aggregation="token_mean"),
        micro_batch_tokens=4096,
        seed=args.seed,
    )
    algorithm = WarmStartThenGRPO(GRPO(config), warm, sft_steps, sft_batch=8)
    started = time.perf_counter()
    trainer = agl.Trainer(
        algorithm=algorithm,
        n_runners=16,
        output_dir=str(args.out),
        sampling={"temperature": args.temperature},
    )
    result = trainer.fit(calc_agent, train, val)
    wall = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    phases = algorithm.phases
    plot(result["history"], phases, args.out / "curve.png")
    summary = {
        "model": "tiny" if tiny else "SmolLM2-135M-Instruct",
        "val_accuracy_before": phases["base"],
        "val_accuracy_after_sft": phases.get("after_sft"),
        "val_accuracy_after": phases["after_grpo"],
        "grpo_steps": steps,
        "sft_steps": sft_steps,
        "val_tasks": n_val,
        "wall_time_s": round(wall, 1),
        "seed": args.seed,
        "temperature": args.temperature,
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
