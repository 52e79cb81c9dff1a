"""APO vs DSPy's GEPA (and optionally MIPROv2) on the same simulated tasks at equal metric-call budgets.

Each optimizer starts from the same bland prompt, gets its own simulated-LM server (so LLM calls and
tokens are counted per optimizer), optimizes on a train and a validation split, and its chosen prompt
is then scored on a held-out test split it never saw. GEPA checks its budget only between iterations,
so it can overshoot; the table shows the metric calls each optimizer actually used. DSPy runs in its
own environment, offline:

    python3 -m venv .venv-dspy && .venv-dspy/bin/pip install dspy==3.4.1
    python benchmarks/apo_vs_gepa.py --variant hard --budgets 50,100,200,400 --seeds 0,1,2

``--variant hard`` adds two business rules that only some tasks exercise (bulk discount, sales tax),
so neither optimizer saturates at small budgets; the simulated LM's rules are the same for both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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
from benchmarks import _results  # noqa: E402
from examples.apo.agent import price_agent  # noqa: E402
from examples.apo.price_tasks import make_tasks  # noqa: E402
from examples.apo.simulated_lm import SimulatedLM, SimulatedLMServer  # noqa: E402

START_PROMPT = "You are a shopping assistant. Answer the question."


def splits(variant: str, sizes: tuple[int, int, int], seed: int) -> tuple[list[Any], list[Any], list[Any]]:
    """Train, validation and held-out test tasks; the DSPy side builds the same ones."""
    n_train, n_val, n_test = sizes
    return (
        [t.as_input() for t in make_tasks(n_train, seed=seed, variant=variant)],
        [t.as_input() for t in make_tasks(n_val, seed=seed + 1, variant=variant)],
        [t.as_input() for t in make_tasks(n_test, seed=seed + 2, variant=variant)],
    )


async def run_apo(
    budget: int, seed: int, variant: str, sizes: tuple[int, int, int], out: Path | None
) -> dict[str, Any]:
    model = SimulatedLM()
    train, val, test = splits(variant, sizes, seed)
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
            max_rollouts=budget,
            seed=seed,
            output_dir=str(out / f"apo-{variant}-b{budget}-s{seed}") if out else None,
            progress=False,
        )
        apo = APO(config)
        started = time.perf_counter()
        result = await apo.run(store, train, val)
        seconds = time.perf_counter() - started
        calls = dict(model.calls)
        test_score = await apo.evaluate(store, result.best.template, test)
        runner.stop()
        await runner_task
    return {
        "optimizer": "agl-apo",
        "best_val_score": result.best.score,
        "test_score": test_score,
        "metric_calls": result.rollouts_used,
        "validation_calls": result.rollouts_by_phase["validation"],
        "best_prompt": result.best.template,
        "seconds": round(seconds, 2),
        "optimizer_llm_calls": calls["critic"] + calls["editor"],
        "stop_reason": result.stop_reason,
    }


def run_dspy(
    optimizer: str, budget: int, seed: int, variant: str, sizes: tuple[int, int, int], python: Path
) -> dict[str, Any]:
    model = SimulatedLM()
    with SimulatedLMServer(model) as server:
        proc = subprocess.run(
            [
                str(python),
                str(ROOT / "benchmarks" / "_dspy_side.py"),
                *("--base-url", server.base_url, "--optimizer", optimizer, "--budget", str(budget)),
                *("--start-prompt", START_PROMPT, "--seed", str(seed), "--variant", variant),
                *("--sizes", ",".join(map(str, sizes))),
            ],
            capture_output=True,
            text=True,
            timeout=3600,
            env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
        )
    if proc.returncode != 0:
        return {"optimizer": optimizer, "error": proc.stderr[-2000:]}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["optimizer_llm_calls"] = model.calls["reflector"]
    return result


def table(results: list[dict[str, Any]]) -> str:
    """Median over seeds per (budget, optimizer), with the spread of the test score."""
    lines = [
        "| budget | optimizer | seeds | metric calls used | val (median) | test (median) | test min-max |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    keys = sorted({(r["budget"], r["optimizer"]) for r in results if "error" not in r})
    for budget, name in keys:
        rows = [r for r in results if r["budget"] == budget and r["optimizer"] == name and "error" not in r]
        tests = [r["test_score"] for r in rows]
        lines.append(
            f"| {budget} | {name} | {len(rows)} | {statistics.median(r['metric_calls'] for r in rows):.0f} "
            f"| {statistics.median(r['best_val_score'] for r in rows):.2f} | {statistics.median(tests):.2f} "
            f"| {min(tests):.2f}-{max(tests):.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budgets", default="50,100,200,400", help="comma-separated metric-call budgets")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (task splits and search)")
    parser.add_argument("--variant", choices=["basic", "hard"], default="hard")
    parser.add_argument("--sizes", default="30,30,60", help="train,val,test task counts")
    parser.add_argument("--optimizers", default="agl-apo,gepa", help="any of agl-apo, gepa, miprov2")
    parser.add_argument("--dspy-python", type=Path, default=ROOT / ".venv-dspy" / "bin" / "python")
    parser.add_argument("--out", type=Path, default=None, help="APO metrics and curves go here")
    parser.add_argument("--json", type=Path, default=None)
    _results.add_arguments(parser)
    args = parser.parse_args()
    recorder = _results.Recorder("apo_vs_gepa", args)
    names = args.optimizers.split(",")
    sizes = tuple(int(x) for x in args.sizes.split(","))
    assert len(sizes) == 3, "--sizes takes train,val,test"
    if any(n != "agl-apo" for n in names) and not args.dspy_python.exists():
        raise SystemExit(f"{args.dspy_python} not found: create the DSPy environment (see --help)")
    results = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for name in names:
                if name == "agl-apo":
                    r = asyncio.run(run_apo(budget, seed, args.variant, sizes, args.out))  # type: ignore[arg-type]
                else:
                    r = run_dspy(name, budget, seed, args.variant, sizes, args.dspy_python)  # type: ignore[arg-type]
                r.update(budget=budget, seed=seed, variant=args.variant)
                print(json.dumps(r), flush=True)
                results.append(r)
                if args.json:
                    args.json.parent.mkdir(parents=True, exist_ok=True)
                    args.json.write_text("\n".join(json.dumps(x) for x in results) + "\n")
    for r in results:
        if "error" in r:
            print(f"{r['budget']} {r['optimizer']} seed {r['seed']} error: {r['error'][-300:]!r}")
    print(table(results))
    ok = [r for r in results if "error" not in r]
    if not ok:
        return
    top = max(r["budget"] for r in ok)
    first = next(n for n in names if any(r["optimizer"] == n for r in ok))
    recorder.save(
        metric=f"{first} test_score at budget {top}",
        unit="held-out score, per seed",
        values=[r["test_score"] for r in ok if r["budget"] == top and r["optimizer"] == first],
        runs=results,
        summary={
            f"{name} {budget}": statistics.median(
                r["test_score"] for r in ok if r["budget"] == budget and r["optimizer"] == name
            )
            for budget, name in sorted({(r["budget"], r["optimizer"]) for r in ok})
        },
        variant=args.variant,
    )


if __name__ == "__main__":
    main()
