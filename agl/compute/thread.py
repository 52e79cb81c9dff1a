"""One thread for the process's PyTorch work: loading models, engine batches, policy steps, weight copies.

PyTorch's CPU kernels run on GNU OpenMP, which gives every Python thread that calls one a team of worker
threads of its own, kept while that thread lives. OpenMP lets idle team threads spin, ready for the next
kernel, only while the process's OpenMP threads number no more than its CPUs; past that every kernel pays a
sleep and a wake-up. ``asyncio.to_thread`` spreads calls over a pool of threads, each keeping a team
once it has run a kernel, so on a 2-core machine every kernel paid that, and decode steps and GRPO updates
ran slower. Work sent here shares one thread and one team.

A job must never wait for another job of this thread (that one would never start): it may block only on work
done elsewhere.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_lock = threading.Lock()
_executor: ThreadPoolExecutor | None = None


def _compute_executor() -> ThreadPoolExecutor:
    global _executor
    with _lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="agl-compute")
        return _executor


def _forget_after_fork() -> None:
    # a forked child has no copy of the thread: it starts its own on first use
    global _executor, _lock
    _executor, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


async def run_compute(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on the compute thread, awaited (``asyncio.to_thread``, on that one thread)."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_compute_executor(), call)


__all__ = ["run_compute"]
