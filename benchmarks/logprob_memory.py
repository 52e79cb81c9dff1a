"""Trainer log-probs: peak memory and time of one forward + backward, full logits vs chunked,
each with and without activation checkpointing.

Each variant runs in a fresh process (so one's peak cannot hide the other's): load the model, build a
micro-batch of ``--tokens`` tokens, run ``token_logprobs`` and backward through a GRPO-like loss, and
report the rise in peak RSS over the loaded model and the wall time (median of ``--repeats``). Prints
one JSON line; ``--json PATH`` also writes it to a file.

    python benchmarks/logprob_memory.py                 # SmolLM2-135M, 4,096 tokens
    python benchmarks/logprob_memory.py --model tiny --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks import _results  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def measure(
    model_name: str, tokens: int, sequences: int, chunk_tokens: int | None, checkpointing: bool, repeats: int
) -> dict[str, Any]:
    """One variant, in this process."""
    import torch
    from transformers import AutoModelForCausalLM

    from agl.algorithm.policy.logprobs import token_logprobs
    from agl.algorithm.policy.model import enable_activation_checkpointing
    from agl.models import smollm2, tiny_model

    torch.manual_seed(0)
    path = smollm2() if model_name == "smollm2" else tiny_model()
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    model.train()
    if checkpointing:
        enable_activation_checkpointing(model)
    ids = torch.randint(3, model.config.vocab_size, (sequences, tokens // sequences))
    attention = torch.ones_like(ids)
    advantages = torch.linspace(-1, 1, sequences)[:, None]
    baseline = _rss_mb()
    seconds = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        taken, _ = token_logprobs(model, ids, attention, chunk_tokens=chunk_tokens)
        loss = -(advantages * torch.exp(taken - taken.detach())).mean()
        loss.backward()
        seconds.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "chunk_tokens": chunk_tokens,
        "activation_checkpointing": checkpointing,
        "peak_rise_mb": round(peak - baseline, 1),
        "seconds_median": round(statistics.median(seconds), 3),
        "seconds": [round(x, 3) for x in seconds],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens in the micro-batch")
    parser.add_argument("--sequences", type=int, default=4, help="sequences it is split into")
    parser.add_argument("--chunk-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # internal: run one variant
    _results.add_arguments(parser)
    args = parser.parse_args()
    if args.variant is not None:
        chunk = None if args.variant.startswith("full") else args.chunk_tokens
        checkpointing = args.variant.endswith("+checkpointing")
        print(
            json.dumps(measure(args.model, args.tokens, args.sequences, chunk, checkpointing, args.repeats))
        )
        return
    recorder = _results.Recorder("logprob_memory", args)
    results = {}
    for variant in ("full", "chunked", "full+checkpointing", "chunked+checkpointing"):
        command = [sys.executable, __file__, "--variant", variant, *sys.argv[1:]]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        results[variant] = json.loads(done.stdout.strip().splitlines()[-1])
    base = results["full"]
    for result in results.values():  # against the plain path: memory saved (x) and time taken (x)
        result["memory_vs_full"] = round(base["peak_rise_mb"] / max(result["peak_rise_mb"], 1.0), 2)
        result["time_vs_full"] = round(result["seconds_median"] / base["seconds_median"], 2)
    row = {
        "benchmark": "logprob_memory",
        "model": args.model,
        "tokens": args.tokens,
        "sequences": args.sequences,
        **results,
    }
    line = json.dumps(row)
    print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(line + "\n")
    recorder.save(  # one peak per variant (a process each); the times of every repeat are in the run
        metric="chunked+checkpointing memory_vs_full",
        unit="x less peak memory than full logits",
        values=[results["chunked+checkpointing"]["memory_vs_full"]],
        runs=[row],
        summary={
            f"{name} {key}": r[key]
            for name, r in results.items()
            for key in ("peak_rise_mb", "seconds_median", "memory_vs_full", "time_vs_full")
        },
        variant=args.model,
    )


if __name__ == "__main__":
    main()
