"""Waiting in tests for something to happen, not for time to pass.

``await until(condition, what)`` polls ``condition`` (a plain or async callable) until it holds and fails
naming ``what`` once ``timeout_s`` has passed. A test then asserts on a state it knows was reached,
instead of on whatever a fixed sleep happened to leave.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

Condition = Callable[[], bool | Awaitable[bool]]


async def until(
    condition: Condition, what: str, *, timeout_s: float = 30.0, interval_s: float = 0.01
) -> None:
    """Return as soon as ``condition()`` is true; raise AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout_s:g}s for {what}; it never happened")
        await asyncio.sleep(interval_s)
