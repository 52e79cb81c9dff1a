"""APO vs DSPy's GEPA and MIPROv2 on the same simulated tasks with the same budget of metric calls.

Each optimizer starts from the same bland prompt and gets its own simulated-LM server, so LLM calls
and tokens are counted per optimizer. DSPy runs in its own environment (``.venv-dspy``; create it with
``python -m venv .venv-dspy && .venv-dspy/bin/pip install dspy==3.4.1 optuna``), offline
(``LITELLM_LOCAL_MODEL_COST_MAP=True``).

    python benchmarks/apo_vs_gepa.py --budget 150
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import agl  # noqa: E402
from agl.algorithm.apo import APO, APOConfig  # noqa: E402
from agl.schemas import LLM, PromptTemplate  # noqa: E402
from agl.store import InMemoryLightningStore  # noqa: E402
from agl.testing.price_tasks import make_tasks  # noqa: E402
from agl.testing.simulated_lm import SimulatedLM, SimulatedLMServer  # noqa: E402
from examples.apo.agent import price_agent  # noqa: E402

START_PROMPT = "You are a shopping assistant. Answer the question."


async def run_apo(
    budget: int, seed: int, beam: int = 1, branch: int = 2, minibatch: int = 3
) -> dict[str, Any]:
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
            rounds=10,
            beam_width=beam,
            branch_factor=branch,
            minibatch_size=minibatch,
            max_rollouts=budget,
            seed=seed,
        )
        started = time.perf_counter()
        result = await APO(config).run(
            store,
            [t.as_input() for t in make_tasks(24, seed=seed)],
            [t.as_input() for t in make_tasks(15, seed=seed + 1)],
        )
        runner.stop()
        await runner_task
    return {
        "optimizer": "agl-apo",
        "best_val_score": result.best.score,
        "metric_calls": result.rollouts_used,
        "best_prompt": result.best.template,
        "seconds": round(time.perf_counter() - started, 2),
        "llm_calls": sum(model.calls.values()),
        "optimizer_llm_calls": model.calls["critic"] + model.calls["editor"],
        "tokens": model.tokens,
    }


def run_dspy(optimizer: str, budget: int, seed: int, python: Path) -> dict[str, Any]:
    model = SimulatedLM()
    with SimulatedLMServer(model) as server:
        proc = subprocess.run(
            [
                str(python),
                str(ROOT / "benchmarks" / "_dspy_side.py"),
                "--base-url",
                server.base_url,
                "--optimizer",
                optimizer,
                "--budget",
                str(budget),
                "--start-prompt",
                START_PROMPT,
                "--seed",
                str(seed),
            ],
            capture_output=True,
            text=True,
            timeout=1800,
            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        )
    if proc.returncode != 0:
        return {"optimizer": optimizer, "error": proc.stderr[-2000:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(
        llm_calls=sum(model.calls.values()),
        optimizer_llm_calls=model.calls["reflector"],
        tokens=model.tokens,
    )
    return dict(result)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--budgets",
        default="40,80,150",
        help="comma-separated metric-call budgets (graded task runs) per optimizer",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dspy-python", type=Path, default=ROOT / ".venv-dspy" / "bin" / "python")
    parser.add_argument("--skip-dspy", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if not args.skip_dspy and not args.dspy_python.exists():
        raise SystemExit(
            f"{args.dspy_python} not found: create the DSPy environment (see --help) or pass --skip-dspy"
        )
    results = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        round_results = [asyncio.run(run_apo(budget, args.seed))]
        if not args.skip_dspy:
            round_results += [
                run_dspy(name, budget, args.seed, args.dspy_python) for name in ("gepa", "miprov2")
            ]
        for r in round_results:
            r["budget"] = budget
            print(json.dumps(r), flush=True)
        results += round_results
    print(
        f"{'budget':>6} {'optimizer':>9} {'val':>5} {'metric':>6} {'LLM calls':>9} {'opt. calls':>10} {'tokens':>7}"
    )
    for r in results:
        if "error" in r:
            print(f"{r['budget']:>6} {r['optimizer']:>9} error: {r['error'][-120:]!r}")
            continue
        print(
            f"{r['budget']:>6} {r['optimizer']:>9} {r['best_val_score']:>5.2f} {r['metric_calls']:>6} "
            f"{r['llm_calls']:>9} {r['optimizer_llm_calls']:>10} {r['tokens']:>7}"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("\n".join(json.dumps(r) for r in results) + "\n")


if __name__ == "__main__":
    main()
