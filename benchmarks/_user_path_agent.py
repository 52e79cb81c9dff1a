"""The user-path scenario's agent work and helpers, shared by agl's side and agentlightning's (no framework
imports).

Per rollout, 1 to 6 rounds; each round is an OpenTelemetry span with two child spans, each carrying a
freshly generated nested attribute dict of about 6 KB (flattened to dotted keys, as OTel attributes must
be); then a reward and a final span.
"""

from __future__ import annotations

import asyncio
import random
import resource
import socket
from collections.abc import Callable
from typing import Any


def nested_attributes(rng: random.Random, target_bytes: int = 6000) -> dict[str, Any]:
    """A fresh nested dict of about ``target_bytes`` of JSON, flattened to OTel's dotted primitive keys.

    About 26 branches of text, a number and a list of 1-9 ints: some 78 attributes. Made with
    ``getrandbits``/``randbytes`` (C) rather than ``randrange`` (Python), a third of the cost for the
    same shape: the benchmark measures the store path, not the random module.
    """
    out: dict[str, Any] = {}
    size = 0
    bits, randbytes = rng.getrandbits, rng.randbytes
    while size < target_bytes:
        key = f"payload.k{bits(20)}"
        text = randbytes(25 + bits(7) % 75).hex()
        out[f"{key}.text"] = text
        out[f"{key}.n"] = rng.random()
        out[f"{key}.list"] = [n * 4 for n in randbytes(1 + bits(4) % 9)]  # ints below 1,024
        size += len(text) + len(key) * 3 + 60
    return out


async def work(task: dict[str, Any], tracer: Any, reward: Callable[[float], Any]) -> int:
    """The agent's own work on an OTel ``tracer``; returns the OTel spans it made (the reward's not counted)."""
    rng = random.Random(task["i"])
    spans = 0
    for round_no in range(rng.randint(1, 6)):
        with tracer.start_as_current_span("round") as span:
            span.set_attribute("round", round_no)
            for child in ("llm.call", "tool.call"):
                with tracer.start_as_current_span(child) as inner:
                    inner.set_attributes(nested_attributes(rng))
            spans += 3
        await asyncio.sleep(0)
    reward(rng.random())
    with tracer.start_as_current_span("final") as span:
        span.set_attribute("answer", "42")
    return spans + 1


def cpu_s() -> float:
    """This process's CPU seconds so far, user and system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
