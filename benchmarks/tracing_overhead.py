"""Tracing overhead per instrumented LLM call: the openai SDK against a local server, traced vs not.

Alternates blocks of three modes: plain calls; the OpenInference instrumentor alone (a bare
TracerProvider, no processor: the instrumentor's own cost); and agl (its provider and processor, calls
inside a rollout context). The agl spans are converted at flush time, off the call path; that cost is
timed separately and reported per span. Figures are medians per call. The instrumentor comes with the
integrations extra (``pip install -e '.[integrations]'``).

    python benchmarks/tracing_overhead.py --calls 900 --json out.jsonl
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
from openinference.instrumentation.openai import OpenAIInstrumentor  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402

from agl.schemas import Attempt, Rollout  # noqa: E402
from agl.tracer import RolloutContext, instrument, rollout_context, uninstrument  # noqa: E402
from benchmarks import _results  # noqa: E402
from examples.apo.simulated_lm import SimulatedLMServer  # noqa: E402

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


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    """One measurement: ``--blocks`` alternations of the three modes, medians per call."""
    rollout = Rollout(rollout_id="ro-bench", created_at=0, updated_at=0)
    ctx = RolloutContext(
        rollout=rollout,
        attempt=Attempt(attempt_id="at-b", rollout_id="ro-bench", attempt_number=1, started_at=0),
    )
    plain: list[float] = []
    bare: list[float] = []
    traced: list[float] = []
    convert_s, converted = 0.0, 0
    with SimulatedLMServer() as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="k")
        block(client, 20)  # warm up
        per_block = max(args.calls // args.blocks, 1)
        for _ in range(args.blocks):
            uninstrument()
            plain += block(client, per_block)
            bare_instrumentor = OpenAIInstrumentor()
            bare_instrumentor.instrument(tracer_provider=TracerProvider())
            bare += block(client, per_block)
            bare_instrumentor.uninstrument()
            instrument("openai", required=True)
            with rollout_context(ctx):
                traced += block(client, per_block)
            start = time.perf_counter()
            converted += len(ctx.buffer.take())
            convert_s += time.perf_counter() - start
        uninstrument()
    p50 = statistics.median
    result = {
        "benchmark": "tracing_overhead",
        "calls_per_mode": len(plain),
        "plain_p50_ms": round(p50(plain), 3),
        "openinference_only_p50_ms": round(p50(bare), 3),
        "agl_traced_p50_ms": round(p50(traced), 3),
        "overhead_p50_ms": round(p50(traced) - p50(plain), 3),
        "agl_part_p50_ms": round(p50(traced) - p50(bare), 3),
        "convert_ms_per_span": round(convert_s * 1000 / max(converted, 1), 3),
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=900, help="calls per mode")
    parser.add_argument(
        "--blocks", type=int, default=30, help="alternations of the three modes (more: less drift)"
    )
    parser.add_argument("--json", type=Path, default=None)
    _results.add_arguments(parser, repeat=True)
    args = parser.parse_args()
    recorder = _results.Recorder("tracing_overhead", args)
    runs = []
    for _ in range(args.repeat):
        runs.append(measure(args))
        print(json.dumps(runs[-1]), flush=True)
    if args.json:
        args.json.write_text("".join(json.dumps(r) + "\n" for r in runs))
    recorder.save(
        metric="overhead_p50_ms",
        unit="ms per call",
        values=[float(r["overhead_p50_ms"]) for r in runs],
        runs=runs,
        better="lower",
    )


if __name__ == "__main__":
    main()
