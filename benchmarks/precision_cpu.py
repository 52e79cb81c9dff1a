"""fp32 against bf16 autocast on this CPU: a policy forward + backward, generation, and how far log-probs move.

Each measurement alternates fp32 and bf16 ``--repeats`` times in one process and reports medians and the ratio:
- ``update``: seconds of a ``token_logprobs`` forward and backward over ``--batch`` x ``--length`` tokens, with activation
  checkpointing on and off (what ``Policy.step`` runs per micro-batch);
- ``generate``: tokens/s of the built-in engine sampling ``--batch`` completions of up to ``--new-tokens``;
- ``logprobs``: mean and max |log p(bf16) - log p(fp32)| over sampled tokens (the trainer's autocast against
  fp32, and the bf16 engine's sampling log-probs against the bf16 trainer's: the loss's ratio sees the latter).

    .venv/bin/python benchmarks/precision_cpu.py --model smollm2
    .venv/bin/python benchmarks/precision_cpu.py --model tiny --repeats 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from agl.algorithm.policy.logprobs import token_logprobs  # noqa: E402
from agl.algorithm.policy.model import enable_activation_checkpointing  # noqa: E402
from agl.compute.precision import autocast, cpu_has_native_bf16  # noqa: E402
from benchmarks import _results  # noqa: E402


def _model_path(name: str) -> Path:
    from agl.models import smollm2, tiny_model

    return smollm2() if name == "smollm2" else tiny_model()


def _update_s(model: Any, ids: torch.Tensor, precision: str) -> float:
    model.zero_grad(set_to_none=True)
    began = time.perf_counter()
    with autocast(precision, "cpu"):  # type: ignore[arg-type]
        taken, _ = token_logprobs(model, ids, torch.ones_like(ids))
    taken.mean().backward()
    return time.perf_counter() - began


async def _generate(engine: Any, prompt: list[int], n: int, tokens: int, seed: int) -> tuple[float, Any]:
    from agl.engines.builtin import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=tokens, n=n, seed=seed)
    began = time.perf_counter()
    gen = await engine.generate(prompt, params)
    return time.perf_counter() - began, gen


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument(
        "--batch", type=int, default=8, help="sequences per pass / completions per generation"
    )
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence in the update")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="append the result as one JSON line")
    _results.add_arguments(parser)
    args = parser.parse_args()
    recorder = _results.Recorder("precision_cpu", args)
    for name in ("batch", "length", "new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from agl.engines.builtin import Engine

    path = _model_path(args.model)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32).train()
    ids = torch.randint(3, model.config.vocab_size, (args.batch, args.length))
    row: dict[str, Any] = {
        "bench": "precision_cpu",
        "model": args.model,
        "native_bf16": cpu_has_native_bf16(),
    }
    every: dict[str, dict[str, list[float]]] = {}  # each repeat's seconds or tokens/s, for the result file
    for checkpointing in (True, False):
        if checkpointing:
            enable_activation_checkpointing(model)
        else:
            model.gradient_checkpointing_disable()
        _update_s(model, ids, "fp32")  # warm-up
        times: dict[str, list[float]] = {"fp32": [], "bf16": []}
        for _ in range(args.repeats):
            for precision in ("fp32", "bf16"):
                times[precision].append(_update_s(model, ids, precision))
        key = "update_ckpt" if checkpointing else "update"
        every[key] = times
        row[key] = {p: round(statistics.median(t), 3) for p, t in times.items()}
        row[key]["speedup"] = round(row[key]["fp32"] / row[key]["bf16"], 2)

    engines = {p: Engine(path, max_batch_size=args.batch, precision=p) for p in ("fp32", "bf16")}
    prompt = engines["fp32"].encode_chat(
        [{"role": "user", "content": "Explain, step by step, what 17 x 23 is."}]
    )
    gen_times: dict[str, list[float]] = {"fp32": [], "bf16": []}
    asyncio.run(_generate(engines["fp32"], prompt, args.batch, 4, 0))  # warm-up
    sampled = None
    for r in range(args.repeats):
        for precision, engine in engines.items():
            seconds, gen = asyncio.run(_generate(engine, prompt, args.batch, args.new_tokens, r))
            gen_times[precision].append(sum(len(c.token_ids) for c in gen.choices) / seconds)
            if precision == "bf16":
                sampled = gen
    every["generate_tok_per_s"] = gen_times
    row["generate_tok_per_s"] = {p: round(statistics.median(t), 1) for p, t in gen_times.items()}
    row["generate_tok_per_s"]["speedup"] = round(
        row["generate_tok_per_s"]["bf16"] / row["generate_tok_per_s"]["fp32"], 2
    )

    assert sampled is not None
    model.eval()
    seqs = [prompt + c.token_ids for c in sampled.choices]
    width = max(len(s) for s in seqs)
    batch = torch.zeros((len(seqs), width), dtype=torch.long)
    attention = torch.zeros_like(batch)
    for i, s in enumerate(seqs):
        batch[i, : len(s)], attention[i, : len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        exact, _ = token_logprobs(model, batch, attention)
        with autocast("bf16", "cpu"):
            bf16, _ = token_logprobs(model, batch, attention)
    to_fp32, to_engine = [], []
    for i, choice in enumerate(sampled.choices):
        span = slice(len(prompt) - 1, len(prompt) - 1 + len(choice.token_ids))
        to_fp32.append((bf16[i, span] - exact[i, span]).abs())
        to_engine.append((bf16[i, span] - torch.tensor(choice.logprobs)).abs())
    a, b = torch.cat(to_fp32), torch.cat(to_engine)
    row["logprob_diff"] = {
        "trainer_bf16_vs_fp32_mean": round(float(a.mean()), 4),
        "trainer_bf16_vs_fp32_max": round(float(a.max()), 3),
        "engine_bf16_vs_trainer_bf16_mean": round(float(b.mean()), 4),
        "engine_bf16_vs_trainer_bf16_max": round(float(b.max()), 3),
    }
    print(json.dumps(row, indent=2))
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(row) + "\n")
    recorder.save(
        metric="update speedup",
        unit="x, bf16 over fp32 forward + backward",
        values=[
            round(f / b, 3) for f, b in zip(every["update"]["fp32"], every["update"]["bf16"], strict=True)
        ],
        runs=[{key: {p: [round(x, 3) for x in xs] for p, xs in got.items()} for key, got in every.items()}],
        summary=row,
        variant=args.model,
    )


if __name__ == "__main__":
    main()
