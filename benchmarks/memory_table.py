"""Trainer memory: peak RSS and speed of GRPO policy steps by model, sample length and micro-batch.

Each cell runs in a fresh process: load a ``Policy`` (and, with ``--engine``, the built-in engine's copy
of the model, as ``Trainer.fit`` holds one in the same process), then take ``--steps`` policy steps on
``--samples`` synthetic samples of about ``--length`` tokens (lengths vary by up to a quarter, as
rollouts do), on rotating worker threads as ``GRPO`` runs them (``asyncio.to_thread``). Reported per
cell: the process's peak RSS over the run, its RSS after the first and the last step (growth between
steps), and trained tokens/s of the steps after the first. Time figures are noisy on a shared machine.
``--in-use`` also reads the RSS after a trim each step (the memory in use; the policy otherwise holds freed
memory for reuse, so its RSS stays at the high-water mark), and ``--onednn-caches torch`` runs with torch's
own 1,024-entry bf16 kernel caches instead of the bound agl sets (``agl.compute.precision``).

``--agent langgraph`` is the row of a framework agent in ``fit``: the SQL recipe (a LangGraph ReAct agent with a
``run_sql`` tool, its warm start, GRPO) for ``--steps`` steps with ``--runners`` rollouts at once, under
``/usr/bin/time -v``: the whole process's peak RSS (engine, store, gateway, runners and LangChain included),
each step's peak from ``metrics.csv`` (step 0: the validations and the warm start) and the climb from the first
GRPO step's peak to the last's.

    python benchmarks/memory_table.py --model tiny
    python benchmarks/memory_table.py --model smollm2 --lengths 1000 --micro-batches 1024,2048,4096
    python benchmarks/memory_table.py --model smollm2 --cell old --steps 4     # the defaults before (4,096, no checkpointing)
    python benchmarks/memory_table.py --model smollm2 --cell auto --steps 4    # the memory-safe defaults
    python benchmarks/memory_table.py --model smollm2 --cell auto --lengths 300 --steps 16 --in-use \
        --onednn-caches torch                                                   # bf16 kernel caches unbound
    python benchmarks/memory_table.py --model smollm2 --agent langgraph --runners 16 --steps 4
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks import _results  # noqa: E402

GB = 1024**3


def run_cell(args: argparse.Namespace, micro_batch: str, checkpointing: bool, trim: bool) -> dict[str, Any]:
    """One cell, in this process."""
    if args.onednn_caches == "torch":  # before torch's first bf16 matmul, which reads them
        from agl.compute.precision import ONEDNN_CACHE_ENTRIES

        for name in ONEDNN_CACHE_ENTRIES:
            os.environ[name] = "1024"
    from agl.adapter import Sample
    from agl.algorithm.grpo import LossConfig
    from agl.algorithm.policy.model import Policy, PolicyConfig
    from agl.compute import memory
    from agl.compute.memory import MicroBatchTokens
    from agl.models import smollm2, tiny_model

    if not trim:  # the behaviour before this change: glibc's default arenas, freed heap pages kept
        import agl.algorithm.policy.model as policy_module

        for module in (memory, policy_module):
            module.release_free_memory = lambda: None  # type: ignore[attr-defined]
            module.limit_arenas = lambda: None  # type: ignore[attr-defined]
    path = smollm2() if args.model == "smollm2" else tiny_model()
    mb: MicroBatchTokens = "auto" if micro_batch == "auto" else int(micro_batch)
    policy = Policy(
        PolicyConfig(
            model_path=str(path),
            lr=1e-6,
            micro_batch_tokens=mb,
            activation_checkpointing=checkpointing,
            # the code before had no budget: the old cell must not be refused for what it used to hold
            memory_budget_gb=None if trim else 1024.0,
        ),
        LossConfig(),
    )
    engine = None
    if args.engine:
        from agl.engines.builtin import Engine

        engine = Engine(path)
    vocab = int(policy.model.config.vocab_size)
    rng = random.Random(0)
    # four threads in turn: GRPO's steps land on whichever thread of asyncio.to_thread's pool is free
    threads = [concurrent.futures.ThreadPoolExecutor(max_workers=1) for _ in range(4)]
    monitor = memory.shared_monitor()
    monitor.take()
    loaded = memory.process_rss()
    rss_after, in_use, seconds, tokens, limits = [], [], [], [], []
    for step in range(args.steps):
        samples = []
        for _ in range(args.samples):
            n = args.length - rng.randrange(0, args.length // 4 + 1)
            samples.append(
                Sample(
                    "r",
                    None,
                    tuple(rng.randrange(3, vocab) for _ in range(n)),
                    (0,) * 16 + (1,) * (n - 16),
                    None,
                    0.0,
                )
            )
        advantages = [rng.uniform(-1, 1) for _ in samples]
        started = time.perf_counter()
        metrics = (
            threads[step % 4].submit(policy.step, samples, advantages, list(range(len(samples)))).result()
        )
        seconds.append(time.perf_counter() - started)
        tokens.append(sum(len(s.input_ids) for s in samples))
        limits.append(metrics["micro_batch_tokens"])
        rss_after.append(memory.process_rss())
        if args.in_use:
            memory.release_free_memory()
            in_use.append(memory.process_rss())
    peak = monitor.take()["peak_rss_gb"]
    later = slice(1, None) if args.steps > 1 else slice(None)
    del engine
    return {
        "model": args.model,
        "length": args.length,
        "samples": args.samples,
        "micro_batch": micro_batch,
        "micro_batch_used": limits[-1],
        "checkpointing": checkpointing,
        "allocator_fix": trim,  # arenas capped and freed pages trimmed after each step
        "loaded_gb": round(loaded / GB, 2),
        "peak_rss_gb": round(peak, 2),
        "rss_after_steps_gb": [round(r / GB, 2) for r in rss_after],
        **({"in_use_after_steps_gb": [round(r / GB, 3) for r in in_use]} if args.in_use else {}),
        "precision": policy.precision,
        "onednn_caches": args.onednn_caches,
        "tokens_per_s": round(sum(tokens[later]) / sum(seconds[later]), 1),
        "step_s": [round(s, 1) for s in seconds],
    }


def run_agent(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The SQL recipe's LangGraph agent through ``fit`` under ``/usr/bin/time -v``: peaks and climb."""
    import csv

    from agl.compute.precision import resolve_precision

    log = out / "time.log"
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "examples.sql_agent.train", "--model", args.model]
    command += ["--steps", str(args.steps), "--test", str(args.test), "--runners", str(args.runners)]
    command += ["--precision", args.precision, "--out", str(out / "run")]
    started = time.perf_counter()
    with log.open("w") as fh:  # a failed run is reported by timed_run, naming the log
        subprocess.run(command, stdout=fh, stderr=subprocess.STDOUT, check=False, cwd=_results.ROOT)
    wall = time.perf_counter() - started
    timed = _results.timed_run(log)
    rows = list(csv.DictReader((out / "run" / "metrics.csv").open()))
    peaks = [round(float(r["peak_rss_gb"]), 2) for r in rows if r.get("peak_rss_gb")]
    steps = [round(float(r["peak_rss_gb"]), 2) for r in rows if r.get("peak_rss_gb") and r["step"] != "0"]
    return {
        "model": args.model,
        "agent": "langgraph (examples/sql_agent)",
        "runners": args.runners,
        "steps": args.steps,
        "precision": resolve_precision(args.precision, "cpu"),  # as the run resolves it (same environment)
        "peak_rss_gb": round(timed["peak_rss_gb"], 2),  # the whole process, /usr/bin/time -v
        "step_peaks_gb": peaks,  # metrics.csv: step 0 (validations, warm start), then each GRPO step
        "climb_gb": round(steps[-1] - steps[0], 2) if len(steps) > 1 else 0.0,
        "cpu_s": round(timed["cpu_s"], 1),
        "wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="tiny")
    parser.add_argument("--lengths", default="500,1000", help="sample lengths, comma-separated")
    parser.add_argument("--micro-batches", default="1024,2048,4096,auto", help="micro_batch_tokens values")
    parser.add_argument("--checkpointing", default="on,off", help="activation checkpointing: on, off or both")
    parser.add_argument("--samples", type=int, default=8, help="samples per step")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--engine", action="store_true", help="also hold the built-in engine's model copy")
    parser.add_argument(
        "--cell",
        choices=["old", "auto"],
        default=None,
        help="one cell: old (4096, no checkpointing, no trim) or auto",
    )
    parser.add_argument("--in-use", action="store_true", help="also read the RSS after a trim each step")
    parser.add_argument(
        "--onednn-caches",
        choices=["agl", "torch"],
        default="agl",
        help="bf16 kernel caches: agl's bound (256 / 32 entries) or torch's 1,024",
    )
    parser.add_argument(
        "--agent", choices=["langgraph"], default=None, help="a framework agent's row through fit (see above)"
    )
    parser.add_argument("--runners", type=int, default=16, help="--agent: rollouts at once")
    parser.add_argument("--test", type=int, default=16, help="--agent: held-out tasks per validation")
    parser.add_argument(
        "--precision", choices=["auto", "fp32", "bf16"], default="auto", help="--agent: the run's precision"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="--agent: the run's folder (default: results/memory_table-MODEL-AGENT)",
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: "mb:ckpt:trim:length"
    _results.add_arguments(parser)
    args = parser.parse_args()
    if args.one is not None:
        mb, ckpt, trim, length = args.one.split(":")
        args.length = int(length)
        print(json.dumps(run_cell(args, mb, ckpt == "on", trim == "on")))
        return
    if args.agent is not None:
        recorder = _results.Recorder("memory_table", args)
        work = args.out or Path("results") / f"memory_table-{args.model}-{args.agent}"
        work.mkdir(parents=True, exist_ok=True)
        row = run_agent(args, work)
        print(json.dumps(row), flush=True)
        recorder.save(
            metric="peak_rss_gb",
            unit="GB peak RSS of the whole process",
            values=[row["peak_rss_gb"]],
            runs=[row],
            variant=f"{args.model}-{args.agent}-{args.runners}-runners-{row['precision']}",
            better="lower",
        )
        return
    if args.cell == "old":
        cells = [("4096", "off", "off", length) for length in args.lengths.split(",")]
    elif args.cell == "auto":
        cells = [("auto", "on", "on", length) for length in args.lengths.split(",")]
    else:
        cells = [
            (mb, ckpt, "on", length)
            for length in args.lengths.split(",")
            for mb in args.micro_batches.split(",")
            for ckpt in args.checkpointing.split(",")
        ]
    recorder = _results.Recorder("memory_table", args)
    rows = []
    argv = sys.argv[1:]
    passthrough = [a for i, a in enumerate(argv) if not a.startswith("--cell") and argv[i - 1] != "--cell"]
    for mb, ckpt, trim, length in cells:
        command = [sys.executable, __file__, *passthrough, "--one", f"{mb}:{ckpt}:{trim}:{length}"]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("".join(json.dumps(r) + "\n" for r in rows))
    recorder.save(
        metric="peak_rss_gb",
        unit="GB peak RSS, per cell",
        values=[r["peak_rss_gb"] for r in rows],
        runs=rows,
        summary={
            f"{r['micro_batch']} ckpt={r['checkpointing']} length={r['length']}": {
                k: r[k] for k in ("peak_rss_gb", "tokens_per_s", "rss_after_steps_gb")
            }
            for r in rows
        },
        variant=args.model + (f"-{args.cell}" if args.cell else "") + ("-in-use" if args.in_use else ""),
        better="lower",
    )


if __name__ == "__main__":
    main()
