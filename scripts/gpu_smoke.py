"""GPU smoke test: a short GRPO loop through ``Trainer.fit`` with the built-in engine and the policy on CUDA.

    python scripts/gpu_smoke.py                       # SmolLM2-135M-Instruct, 3 steps
    python scripts/gpu_smoke.py --model tiny --steps 2
    python scripts/gpu_smoke.py --model /path/to/hf/model --steps 5 --async-rollouts

Reports generation tokens/s (completion tokens the engine produced for training rollouts / seconds spent
generating them) and training tokens/s (tokens through the policy's forward+backward / update seconds),
plus the reward per step and peak GPU memory. Without CUDA it runs on the CPU and says so (that is how
the test suite runs it). Prints one JSON line with the figures last.
"""

from __future__ import annotations

import argparse
import json
import os
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
from agl.algorithm.grpo import GRPO, GRPOConfig  # noqa: E402

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
    args = parser.parse_args(argv)

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {device} asked for, but torch sees no CUDA device (torch {torch.__version__})"
        )
    if device == "cpu":
        warnings.warn(
            "no CUDA device: running the GPU smoke test on the CPU (slow; figures are CPU figures)",
            stacklevel=1,
        )
    path = model_path(args.model)
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
    engine_options = {"device": device, "dtype": args.dtype}
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = agl.Trainer(
            algorithm=GRPO(config), n_runners=args.runners, output_dir=out, engine_options=engine_options
        ).fit(smoke_agent, tasks, [])
        wall = time.perf_counter() - started
    history = result["history"]
    generating_s = sum(row["rollout_time_s"] for row in history)
    trained = [row for row in history if "train_tokens_per_s" in row]
    report: dict[str, Any] = {
        "model": args.model,
        "device": device,
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
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
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in report.items()}), flush=True)
    return report


if __name__ == "__main__":
    main()
