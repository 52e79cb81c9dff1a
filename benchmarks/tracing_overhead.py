"""Tracing overhead per instrumented LLM call: the openai SDK against a local server, traced vs not.

Alternates blocks of plain and instrumented calls (inside a rollout context, spans filed into its
buffer) and reports the median per-call time of each and their difference.

    python benchmarks/tracing_overhead.py --calls 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import openai  # noqa: E402

from agl.schemas import Attempt, Rollout  # noqa: E402
from agl.testing.simulated_lm import SimulatedLMServer  # noqa: E402
from agl.tracer import RolloutContext, instrument, rollout_context, uninstrument  # noqa: E402

MESSAGES = [
    {"role": "system", "content": "ANSWER:"},
    {"role": "user", "content": "One x costs 2 dollars. What do 3 cost?"},
]


def block(client: openai.OpenAI, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.chat.completions.create(model="task", messages=MESSAGES)  # type: ignore[arg-type]
        times.append((time.perf_counter() - start) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=400, help="calls per mode")
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    rollout = Rollout(rollout_id="ro-bench", created_at=0, updated_at=0)
    ctx = RolloutContext(
        rollout=rollout,
        attempt=Attempt(attempt_id="at-b", rollout_id="ro-bench", attempt_number=1, started_at=0),
    )
    plain: list[float] = []
    traced: list[float] = []
    with SimulatedLMServer() as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k")
        block(client, 20)  # warm up
        per_block = max(args.calls // args.blocks, 1)
        for _ in range(args.blocks):
            uninstrument()
            plain += block(client, per_block)
            instrument("openai", required=True)
            with rollout_context(ctx):
                traced += block(client, per_block)
            ctx.buffer.take()
        uninstrument()
    result = {
        "benchmark": "tracing_overhead",
        "calls_per_mode": len(plain),
        "plain_p50_ms": round(statistics.median(plain), 3),
        "traced_p50_ms": round(statistics.median(traced), 3),
        "overhead_p50_ms": round(statistics.median(traced) - statistics.median(plain), 3),
    }
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
