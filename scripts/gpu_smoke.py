"""GPU smoke test: GRPO on CUDA through ``Trainer.fit``, a bf16 policy step, and FSDP2 over every visible GPU.

    python scripts/gpu_smoke.py                       # SmolLM2-135M-Instruct, 3 steps, all parts
    python scripts/gpu_smoke.py --model tiny --steps 2
    python scripts/gpu_smoke.py --model /path/to/hf/model --steps 5 --async-rollouts --parts fit
    python scripts/gpu_smoke.py --model tiny --allow-cpu   # no GPU: CPU figures, for testing the script

Parts (``--parts``, all by default), each reporting tokens/s and peak memory:

- ``fit``: a short GRPO loop with the built-in engine and the policy on CUDA: generation tokens/s
  (completion tokens the engine produced for training rollouts / seconds spent generating them) and
  training tokens/s (tokens through the policy's forward+backward / update seconds), reward per step.
- ``bf16``: GRPO policy steps on a synthetic batch under ``torch.autocast(bfloat16)`` (fp32 weights).
- ``fsdp``: the same steps sharded with FSDP2 (``sharding="fsdp"``, bf16 compute) over all visible GPUs
  (one rank per GPU; with one GPU a one-rank group), with each rank's shard bytes and peak memory.

It refuses to fake a result: with no CUDA device it exits non-zero and says so, unless ``--allow-cpu``
(then the figures are CPU figures: one gloo rank for ``fsdp``). Prints one JSON line with the figures last.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import openai  # noqa: E402
import torch  # noqa: E402

import agl  # noqa: E402
from agl.adapter import Sample  # noqa: E402
from agl.algorithm.grpo import GRPO, GRPOConfig, LossConfig  # noqa: E402
from agl.engines import BuiltinEngine  # noqa: E402

PARTS = ("fit", "bf16", "fsdp")

_generated = {"tokens": 0}
_lock = threading.Lock()


@agl.rollout
async def smoke_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    """Small sums: 1 for the right number, else half the share of digits; counts completion tokens."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["prompt"]}],
            max_tokens=task["max_tokens"],
        )
    finally:
        await client.close()
    with _lock:
        _generated["tokens"] += reply.usage.completion_tokens if reply.usage else 0
    text = reply.choices[0].message.content or ""
    if task["answer"] in [w.strip(".,!") for w in text.split()]:
        return 1.0
    return 0.5 * sum(c.isdigit() for c in text) / max(len(text), 1)  # dense: a random model still varies


def model_path(name: str) -> str:
    if name == "tiny":
        return str(agl.models.tiny_model())
    if name == "smollm2":
        return str(agl.models.smollm2())
    if not Path(name).is_dir():
        raise SystemExit(f"--model must be tiny, smollm2 or a local model folder; {name!r} is none of them")
    return name


def synthetic_batch(
    vocab: int, samples: int, tokens: int, seed: int = 0
) -> tuple[list[Sample], list[float], list[int]]:
    """``samples`` sequences of ``tokens`` random ids (first half prompt, second half trained), in groups
    of two with advantages +1 / -1: a real GRPO batch shape without an engine."""
    rng = random.Random(seed)
    batch = []
    for i in range(samples):
        ids = tuple(rng.randrange(3, vocab) for _ in range(tokens))
        mask = tuple(int(t >= tokens // 2) for t in range(tokens))
        batch.append(Sample(f"r{i}", f"g{i // 2}", ids, mask, None, float(i % 2)))
    return batch, [1.0 if i % 2 else -1.0 for i in range(samples)], [i // 2 for i in range(samples)]


def _peak_gib(device: str, rows: list[dict[str, float]]) -> float:
    if device.startswith("cuda"):
        return float(torch.cuda.max_memory_allocated()) / 2**30
    return max(r.get("update_peak_rss_gb", 0.0) for r in rows)


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    for row in rows:  # a smoke test must not pass on a step that computed nothing
        if not (row["grad_norm"] > 0 and row["loss"] == row["loss"]):
            raise SystemExit(
                f"a policy step gave grad_norm={row['grad_norm']}, loss={row['loss']}: not a real step"
            )
    return {
        "steps": len(rows),
        "tokens_per_s": statistics.median(r["train_tokens_per_s"] for r in rows),
        "step_s_median": statistics.median(r["update_time_s"] for r in rows),
    }


def bf16_steps(path: str, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """GRPO policy steps with bf16 autocast (fp32 master weights and optimizer) on ``device``."""
    from agl.algorithm.policy.model import Policy, PolicyConfig

    policy = Policy(PolicyConfig(model_path=path, lr=args.lr, device=device), LossConfig())
    batch = synthetic_batch(policy.model.config.vocab_size, args.train_samples, args.train_tokens)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for _ in range(args.train_steps):
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            rows.append(policy.step(*batch))
    report = {**_summary(rows), "peak_mem_gib": _peak_gib(device, rows), "dtype": "bf16 autocast"}
    del policy
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return report


def fsdp_steps(path: str, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """GRPO policy steps sharded with FSDP2 over every visible GPU (one rank each; bf16 compute)."""
    import torch.distributed as dist

    from agl.algorithm.policy.collective import backend_for
    from agl.algorithm.policy.distributed import DistributedPolicy, _free_port
    from agl.algorithm.policy.model import Policy, PolicyConfig
    from agl.algorithm.policy.sharding import ShardedPolicy

    ranks = torch.cuda.device_count() if device.startswith("cuda") else 1
    config = PolicyConfig(model_path=path, lr=args.lr, device=device)
    policy = Policy(config, LossConfig())
    batch = synthetic_batch(policy.model.config.vocab_size, args.train_samples, args.train_tokens)
    if ranks >= 2:  # the other ranks are spawned processes, one per GPU
        handle = DistributedPolicy.start(policy, ranks, sharding="fsdp")
        step: Any = handle.step
        shards: Any = handle.memory_bytes
        peaks: Any = lambda: handle.collective("peak_memory", gather=True)  # noqa: E731
        close: Any = handle.close
    else:  # one GPU (or the CPU): a one-rank group, FSDP2's bf16 path without a second device
        init = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend_for(device), init_method=init, rank=0, world_size=1)
        sharded = ShardedPolicy.adopt(policy)
        step = sharded.step
        shards = lambda: [sharded.memory_bytes()]  # noqa: E731
        peaks = lambda: [sharded.peak_memory()]  # noqa: E731
        close = dist.destroy_process_group
    try:
        rows = [step(*batch) for _ in range(args.train_steps)]
        per_rank = [sum(s.values()) / 2**30 for s in shards()]
        peak = [p / 2**30 for p in peaks()]
    finally:
        close()
    return {
        **_summary(rows),
        "ranks": ranks,
        "backend": backend_for(device),
        "shard_gib_per_rank": per_rank,  # parameters + gradients + AdamW state each rank holds
        "peak_mem_gib_per_rank": peak,  # includes loading the full model before sharding
        "dtype": "bf16 compute, fp32 reduce" if device.startswith("cuda") else "fp32",
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny or a local HF model folder")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runners", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument(
        "--dtype", default="float32", help="the engine's dtype (the policy trains in float32)"
    )
    parser.add_argument("--async-rollouts", action="store_true", help="GRPOConfig(async_rollouts=True)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run on the CPU when no GPU is visible (CPU figures)"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--train-samples", type=int, default=8, help="bf16/fsdp: samples per step")
    parser.add_argument("--train-tokens", type=int, default=512, help="bf16/fsdp: tokens per sample")
    parser.add_argument("--train-steps", type=int, default=2, help="bf16/fsdp: policy steps")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        raise SystemExit(
            f"--parts must be a comma-separated subset of {', '.join(PARTS)}, got {args.parts!r}"
        )

    path = model_path(args.model)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {device} asked for, but torch sees no CUDA device (torch {torch.__version__})"
        )
    if device == "cpu" and not args.allow_cpu:
        raise SystemExit(
            f"no CUDA device visible (torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}): refusing to report CPU figures as GPU "
            "ones; pass --allow-cpu to run on the CPU anyway"
        )
    if device == "cpu":
        warnings.warn(
            "no CUDA device: running the GPU smoke test on the CPU (slow; figures are CPU figures)",
            stacklevel=1,
        )
    report: dict[str, Any] = {"model": args.model, "device": device, "parts": parts}
    if device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name()
        report["visible_gpus"] = torch.cuda.device_count()
    if "fit" in parts:
        report.update(fit(path, device, args))
    if "bf16" in parts:
        report["bf16"] = bf16_steps(path, device, args)
    if "fsdp" in parts:
        report["fsdp"] = fsdp_steps(path, device, args)
    print(json.dumps(_rounded(report)), flush=True)
    return report


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def fit(path: str, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """A short GRPO loop through ``Trainer.fit``: the built-in engine and the policy on ``device``."""
    tasks = [
        {
            "prompt": f"What is {a} + {b}? Reply with the number only.",
            "answer": str(a + b),
            "max_tokens": args.max_tokens,
        }
        for a, b in [(2, 3), (7, 5), (11, 4), (6, 9), (13, 8), (3, 14), (10, 10), (1, 18)]
    ]
    config = GRPOConfig(
        model_path=path,
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        lr=args.lr,
        eval_every=0,
        device=device,
        async_rollouts=args.async_rollouts,
    )
    engine = BuiltinEngine({"device": device, "dtype": args.dtype})
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = agl.Trainer(
            GRPO(config), n_runners=args.runners, output_dir=out, serving=agl.Serving(engine=engine)
        ).fit(smoke_agent, tasks, [])
        wall = time.perf_counter() - started
    history = result["history"]
    generating_s = sum(row["rollout_time_s"] for row in history)
    trained = [row for row in history if "train_tokens_per_s" in row]
    return {
        "steps": len(history),
        "generation_tokens_per_s": _generated["tokens"] / generating_s if generating_s else 0.0,
        "generated_tokens": _generated["tokens"],
        "training_tokens_per_s": statistics.median(r["train_tokens_per_s"] for r in trained)
        if trained
        else 0.0,
        "trained_steps": len(trained),
        "step_s_median": statistics.median(r["step_time_s"] for r in history) if history else 0.0,
        "rewards": [round(r["reward_mean"], 3) for r in history],
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None,
        "wall_s": wall,
    }


if __name__ == "__main__":
    main()
