"""Iterated SFT (expert iteration) of the calc agent: the model learns from its own successful rollouts.

    python -m examples.sft.run                  # SmolLM2: writes results/sft/
    python -m examples.sft.run --model tiny     # a fast smoke run: results/sft-tiny/

SmolLM2 never uses the tool on its own, so a first iteration trains on a few generated tool-use traces;
each later iteration keeps the agent's rollouts that earned reward 1 and fine-tunes on their engine
token ids (loss on model tokens only). Accuracy on held-out tasks is reported before and after.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import agl
from agl.algorithm.base import Algorithm, TrainingContext
from agl.algorithm.sft import SFT, SFTConfig
from agl.models import smollm2, tiny_model
from examples.calc.agent import CALCULATOR, calc_agent
from examples.calc.tasks import make_tasks
from examples.calc.train import default_out, fresh_store, tool_use_trace


class SeededExpertIteration(Algorithm):
    """A warm start on ``seed_traces`` generated traces, then the SFT algorithm's expert iterations."""

    def __init__(self, sft: SFT, seed_traces: int) -> None:
        self.sft, self.seed_traces = sft, seed_traces

    def model_spec(self) -> agl.ModelSpec:
        return self.sft.model_spec()  # fit serves the model SFT trains

    async def run(self, ctx: TrainingContext, train: Any, val: Any) -> dict[str, Any]:
        ctx.tools = [CALCULATOR]  # the warm-start traces render with the agent's tool schema
        base = await self.sft.evaluate(ctx, val, await ctx.publish({"llm": ctx.llm}))  # type: ignore[dict-item]
        result: dict[str, Any] = await self.sft.run(ctx, train, val, warm_start=self._traces())
        result["val_reward_base"] = base
        return result

    def _traces(self) -> list[list[dict[str, Any]]]:
        return [tool_use_trace(t) for t in make_tasks(self.seed_traces, seed=777)]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--val", type=int, default=16)
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default: results/sft, tiny: results/sft-tiny)"
    )
    args = parser.parse_args()
    tiny = args.model == "tiny"
    args.out = args.out or default_out("sft", args.model)
    fresh_store(args.out)
    path = tiny_model() if tiny else smollm2()
    config = SFTConfig(
        model_path=str(path),
        iterations=args.iterations,
        tasks_per_iteration=4 if tiny else 16,
        samples_per_task=2 if tiny else 4,
        lr=1e-4 if tiny else 1e-5,
    )
    algorithm = SeededExpertIteration(SFT(config), seed_traces=8 if tiny else 64)
    trainer = agl.Trainer(
        algorithm=algorithm,
        n_runners=16,
        output_dir=str(args.out),
        serving=agl.Serving(sampling={"temperature": 0.7}),
    )
    result = trainer.fit(calc_agent, make_tasks(200, seed=1), make_tasks(args.val, seed=10_001))
    summary = {
        "model": args.model,
        "val_accuracy_before": result["val_reward_base"],
        "val_accuracy_after_warm_start": result["val_reward_before"],
        "warm_start_samples": result["warm_start_samples"],
        "val_accuracy_after": result["val_reward_after"],
        "iterations": result["history"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
