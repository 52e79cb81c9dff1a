"""Synchronous vs asynchronous GRPO through ``Trainer.fit``, side by side: same seed, tasks and steps.

For each mode: median wall time per step, median trainer idle time per step (waiting for rollouts),
rollout throughput (train rollouts / loop seconds) and the final reward (mean of the last steps'
``reward_mean``). Async runs with ``GRPOConfig(async_rollouts=True, max_staleness=N)``.

    .venv/bin/python benchmarks/async_grpo.py --steps 6
    .venv/bin/python benchmarks/async_grpo.py --steps 6 --tool-latency-s 0.5   # agents that wait on tools
    .venv/bin/python benchmarks/async_grpo.py --model smollm2 --steps 4 --json results/async_grpo.jsonl

The tiny model's task rewards completion tokens with ids below 512 (learnable in a few steps); SmolLM2's
is small sums. ``--tool-latency-s`` makes each rollout sleep that long after its model call, like an
agent waiting on a tool or an environment: time the runners spend not generating.

On a CPU the built-in engine generates in the trainer's process, on the cores the policy update uses, so
async has little to overlap. ``--setups`` runs the pair (sync, async) for each way of serving, side by side:
``builtin`` (in process), ``vllm`` (a vLLM server of its own, ``scripts/setup_vllm.sh``, the cores shared) and
``vllm-pinned`` (the trainer's threads on core 0 with one torch thread, the vLLM server on core 1:
``VllmEngine(cpu_cores=("1",))``), ``--rounds`` times, alternating which mode goes first.
The headline is the last setup's sync-over-async step-time ratio, per round:

    .venv/bin/python benchmarks/async_grpo.py --model smollm2 --lora-rank 16 --setups builtin,vllm,vllm-pinned \
        --rounds 3 --steps 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: ``benchmarks`` is imported from the checkout
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import openai  # noqa: E402

import agl  # noqa: E402
from agl.algorithm.grpo import GRPO, GRPOConfig  # noqa: E402
from benchmarks import _results  # noqa: E402

TARGET = 512


@agl.rollout
async def bench_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["prompt"]}],
            max_tokens=task["max_tokens"],
        )
    finally:
        await client.close()
    if task["latency_s"]:
        await asyncio.sleep(task["latency_s"])
    choice = reply.choices[0]
    if task["kind"] == "low_ids":
        ids: list[int] = (choice.model_extra or {}).get("token_ids") or []
        return sum(t < TARGET for t in ids) / max(len(ids), 1)
    numbers = re.findall(r"-?\d+", choice.message.content or "")
    return 1.0 if task["answer"] in numbers else (0.1 if numbers else 0.0)


def make_tasks(model: str, n: int, latency_s: float, max_tokens: int) -> list[dict[str, Any]]:
    rng = random.Random(0)
    tasks = []
    for i in range(n):
        a, b = rng.randrange(1, 20), rng.randrange(1, 20)
        if model == "tiny":
            prompt, answer, kind = f"Say something about {a} and {b} (#{i}).", "", "low_ids"
        else:
            prompt, answer, kind = f"What is {a} + {b}? Reply with the number only.", str(a + b), "sum"
        tasks.append(
            {
                "prompt": prompt,
                "answer": answer,
                "kind": kind,
                "latency_s": latency_s,
                "max_tokens": max_tokens,
            }
        )
    return tasks


SETUPS = ("builtin", "vllm", "vllm-pinned")


def run_mode(
    args: argparse.Namespace,
    model_path: str,
    tasks: list[dict[str, Any]],
    asynchronous: bool,
    setup: str = "builtin",
    engine_cpus: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One ``fit`` run, sync or async; ``engine_cpus``: the vLLM server's CPUs (``VllmEngine.cpu_cores``)."""
    config = GRPOConfig(
        model_path=model_path,
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        lr=args.lr,
        eval_every=0,
        seed=0,
        async_rollouts=asynchronous,
        max_staleness=args.max_staleness,
        lora_rank=args.lora_rank,
    )
    serving = agl.Serving()
    if setup != "builtin":
        from agl.compute.precision import resolve_precision

        dtype = "bfloat16" if resolve_precision(config.precision, "cpu") == "bf16" else "float32"
        engine = agl.engines.VllmEngine(dtype=dtype, max_model_len=512, kv_cache_gib=1, cpu_cores=engine_cpus)
        serving = agl.Serving(engine=engine)
    with tempfile.TemporaryDirectory() as out:
        started, cpu = time.perf_counter(), os.times()
        result = agl.Trainer(
            algorithm=GRPO(config), n_runners=args.runners, output_dir=out, serving=serving
        ).fit(bench_agent, tasks, [])
        wall, cpu_end = time.perf_counter() - started, os.times()
    history = result["history"]
    loop_s = sum(row["step_time_s"] for row in history)
    tail = history[-args.final_steps :]
    return {
        "mode": f"async(max_staleness={args.max_staleness})" if asynchronous else "sync",
        "step_s_median": statistics.median(row["step_time_s"] for row in history),
        "idle_s_median": statistics.median(row["trainer_idle_s"] for row in history),
        "idle_share": sum(row["trainer_idle_s"] for row in history) / loop_s,
        "update_s_median": statistics.median(row.get("update_time_s", 0.0) for row in history),
        "rollouts_per_s": sum(row["rollouts"] for row in history) / loop_s,
        "final_reward": sum(row["reward_mean"] for row in tail) / len(tail),
        "first_reward": history[0]["reward_mean"],
        "staleness_mean": statistics.fmean(row["staleness_mean"] for row in history),
        "loop_s": loop_s,
        "fit_wall_s": wall,
        # this process's CPU seconds (trainer, gateway, runners; the built-in engine's too), and its children's
        # (a vLLM server) once they have exited
        "cpu_s": cpu_end.user + cpu_end.system - cpu.user - cpu.system,
        "children_cpu_s": cpu_end.children_user
        + cpu_end.children_system
        - cpu.children_user
        - cpu.children_system,
        "setup": setup,
    }


def _set_affinity(cores: set[int]) -> None:
    """Every thread of this process on ``cores`` (``sched_setaffinity(0)`` moves only the calling thread)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            continue


@contextmanager
def cores_for(setup: str) -> Iterator[tuple[str, ...]]:
    """For ``vllm-pinned``: this process (trainer, gateway, runners) on the first core with one torch thread,
    and the second core for the vLLM server (yielded, as ``VllmEngine.cpu_cores``); put back afterwards."""
    if setup != "vllm-pinned":
        yield ()
        return
    import torch

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"setup vllm-pinned needs two cores, this process may use {cores}")
    threads = torch.get_num_threads()
    _set_affinity({cores[0]})
    torch.set_num_threads(1)
    try:
        yield (str(cores[1]),)
    finally:
        _set_affinity(set(cores))
        torch.set_num_threads(threads)


def setups_of(text: str) -> list[str]:
    """``--setups``: known names, comma-separated."""
    setups = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or not setups:
        raise SystemExit(f"--setups: {unknown or text!r} not among {', '.join(SETUPS)}")
    return setups


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny", help="tiny, smollm2 or a local model folder")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tasks-per-step", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--runners", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=None, help="default: 3e-2 tiny, 1e-5 otherwise")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--tool-latency-s", type=float, default=0.0)
    parser.add_argument("--final-steps", type=int, default=2, help="steps averaged for the final reward")
    parser.add_argument("--async-first", action="store_true", help="run async before sync in round 0")
    parser.add_argument(
        "--setups", default="builtin", help=f"ways of serving, comma-separated: {', '.join(SETUPS)}"
    )
    parser.add_argument("--rounds", type=int, default=1, help="(sync, async) pairs per setup")
    parser.add_argument(
        "--lora-rank", type=int, default=0, help="train a LoRA of this rank (0: the full model)"
    )
    parser.add_argument("--json", type=Path, default=None, help="append the rows to this JSONL file")
    _results.add_arguments(parser)
    args = parser.parse_args()
    setups = setups_of(args.setups)
    recorder = _results.Recorder("async_grpo", args)
    if args.model == "tiny":
        model_path = str(agl.models.tiny_model())
    elif args.model == "smollm2":
        model_path = str(agl.models.smollm2())
    else:
        model_path = args.model
    args.lr = args.lr if args.lr is not None else (3e-2 if args.model == "tiny" else 1e-5)
    kind = "tiny" if args.model == "tiny" else "chat"
    tasks = make_tasks(kind, 12, args.tool_latency_s, args.max_tokens)
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    ratios: dict[str, list[float]] = {setup: [] for setup in setups}
    for round_ in range(args.rounds):
        for setup in setups:
            first_async = (round_ % 2 == 1) != args.async_first  # alternate which mode goes first
            with cores_for(setup) as engine_cpus:
                pair = {
                    asynchronous: run_mode(args, model_path, tasks, asynchronous, setup, engine_cpus)
                    for asynchronous in ((True, False) if first_async else (False, True))
                }
            rows += [{**row, "round": round_} for row in pair.values()]
            ratios[setup].append(pair[False]["step_s_median"] / pair[True]["step_s_median"])
    summary: dict[str, Any] = {
        "model": args.model,
        "load_before": [round(x, 2) for x in load],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "lora_rank": args.lora_rank,
        "setups": {},
    }
    for setup in setups:
        mine = [r for r in rows if r["setup"] == setup]
        sync = [r for r in mine if r["mode"] == "sync"]
        asy = [r for r in mine if r["mode"] != "sync"]
        summary["setups"][setup] = {
            "step_s_sync": statistics.median(r["step_s_median"] for r in sync),
            "step_s_async": statistics.median(r["step_s_median"] for r in asy),
            "step_time_ratio_sync_over_async": statistics.median(ratios[setup]),
            "step_time_ratio_range": [min(ratios[setup]), max(ratios[setup])],
            "throughput_ratio_async_over_sync": statistics.median(
                a["rollouts_per_s"] / s["rollouts_per_s"] for s, a in zip(sync, asy, strict=True)
            ),
            "final_reward_sync": statistics.median(r["final_reward"] for r in sync),
            "final_reward_async": statistics.median(r["final_reward"] for r in asy),
        }
    for row in [*rows, summary]:
        line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
        print(line, flush=True)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            with args.json.open("a") as f:
                f.write(line + "\n")
    recorder.save(
        metric=f"sync step time over async ({setups[-1]})",
        unit="x, a value per round",
        values=ratios[setups[-1]],
        runs=rows,
        summary=summary,
        variant="-".join([args.model if args.model in ("tiny", "smollm2") else "model", *setups]),
    )


if __name__ == "__main__":
    main()
