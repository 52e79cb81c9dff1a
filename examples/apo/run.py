"""Prompt optimization of a tool-using agent against the simulated LM, offline, in well under a minute.

    python -m examples.apo.run [--rounds 3] [--beam 2] [--branch 2] [--out results/apo]

It starts the simulated OpenAI-compatible server, a store and in-process runners, runs APO from a
bland prompt, then writes ``curve.png`` (best validation score per round) and ``summary.json``.
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
from agl.testing.simulated_lm import SimulatedLM, SimulatedLMServer, make_tasks
from examples.apo.agent import price_agent

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
            minibatch_size=args.minibatch,
            seed=args.seed,
        )
        train = [t.as_input() for t in make_tasks(24, seed=args.seed)]
        val = [t.as_input() for t in make_tasks(15, seed=args.seed + 1)]
        started = time.perf_counter()
        result = await APO(config).run(store, train, val)
        elapsed = time.perf_counter() - started
        runner.stop()
        await runner_task
    return {
        "start_prompt": START_PROMPT,
        "start_score": result.history[0].score,
        "best_prompt": result.best.template,
        "best_score": result.best.score,
        "scores_by_round": result.scores_by_round,
        "candidates": len(result.history),
        "rollouts": result.rollouts_used,
        "llm_calls": result.llm_calls_used,
        "task_model_calls": model.calls["task"],
        "tokens": model.tokens,
        "seconds": round(elapsed, 2),
    }


def plot(scores: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(range(len(scores)), scores, marker="o")
    ax.set_xticks(range(len(scores)))
    ax.set_xlabel("round")
    ax.set_ylabel("best validation score")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("APO on the price agent")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--beam", type=int, default=2)
    parser.add_argument("--branch", type=int, default=2)
    parser.add_argument("--minibatch", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/apo"))
    args = parser.parse_args()
    summary = asyncio.run(optimize(args))
    args.out.mkdir(parents=True, exist_ok=True)
    plot(summary["scores_by_round"], args.out / "curve.png")  # type: ignore[arg-type]
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out / 'curve.png'} and {args.out / 'summary.json'}")


if __name__ == "__main__":
    main()
