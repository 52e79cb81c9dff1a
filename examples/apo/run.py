"""Prompt optimization of a tool-using agent against the simulated LM, offline, in well under a minute.

    python -m examples.apo.run [--budget 150] [--variant hard] [--out results/apo]

It starts the simulated OpenAI-compatible server, a store and in-process runners, runs APO from a
bland prompt within a budget of metric calls (with a progress bar), scores the best prompt on held-out
test tasks, and writes ``curve.png`` (score against metric calls), ``metrics.csv`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import agl
from agl.algorithm.apo import APO, APOConfig
from agl.schemas import LLM, PromptTemplate
from agl.store import InMemoryLightningStore
from examples.apo.agent import price_agent
from examples.apo.simulated_lm import SimulatedLM, SimulatedLMServer, make_tasks

START_PROMPT = "You are a shopping assistant. Answer the question."


async def optimize(args: argparse.Namespace) -> dict[str, object]:
    model = SimulatedLM()
    with SimulatedLMServer(model) as server:
        store = InMemoryLightningStore()
        await store.add_resources(
            {
                "llm": LLM(endpoint=server.base_url, model="task"),
                "prompt": PromptTemplate(template=START_PROMPT),
            }
        )
        runner = agl.Runner(price_agent, store, max_concurrency=8, poll_interval_s=0.01)
        runner_task = asyncio.create_task(runner.run())
        config = APOConfig(
            critic=LLM(endpoint=server.base_url, model="critic"),
            editor=LLM(endpoint=server.base_url, model="editor"),
            beam_width=args.beam,
            branch_factor=args.branch,
            rounds=args.rounds,
            max_rollouts=args.budget,
            minibatch_size=args.minibatch,
            output_dir=str(args.out),
            seed=args.seed,
        )
        train = [t.as_input() for t in make_tasks(24, seed=args.seed, variant=args.variant)]
        val = [t.as_input() for t in make_tasks(15, seed=args.seed + 1, variant=args.variant)]
        test = [t.as_input() for t in make_tasks(60, seed=args.seed + 2, variant=args.variant)]
        apo = APO(config)
        started = time.perf_counter()
        result = await apo.run(store, train, val)
        elapsed = time.perf_counter() - started
        test_score = await apo.evaluate(store, result.best.template, test)
        runner.stop()
        await runner_task
    return {
        "start_prompt": START_PROMPT,
        "start_score": result.history[0].score,
        "best_prompt": result.best.template,
        "best_score": result.best.score,
        "test_score": test_score,
        "curve": result.curve,
        "stop_reason": result.stop_reason,
        "candidates": len(result.history),
        "rollouts": result.rollouts_used,
        "rollouts_by_phase": result.rollouts_by_phase,
        "llm_calls": result.llm_calls_used,
        "task_model_calls": model.calls["task"],
        "tokens": model.tokens,
        "seconds": round(elapsed, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=int, default=150, help="metric calls (graded task runs)")
    parser.add_argument("--rounds", type=int, default=None, help="default: until the budget is spent")
    parser.add_argument("--variant", choices=["basic", "hard"], default="basic")
    parser.add_argument("--beam", type=int, default=1)
    parser.add_argument("--branch", type=int, default=2)
    parser.add_argument("--minibatch", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/apo"))
    args = parser.parse_args()
    summary = asyncio.run(optimize(args))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'curve.png'} and {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
