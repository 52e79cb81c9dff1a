"""Riding out store outages: capped exponential backoff with jitter, logged once per state change.

A ``LightningStoreClient`` retries a request for a few seconds, then raises ``StoreUnavailableError``;
a runner must outlive longer outages (a store restart, a network blip), so its store calls go through
:meth:`StoreOutage.call`, which keeps retrying until the store answers, a deadline passes or the runner
stops.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from agl.errors import StoreUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")


class GaveUp(Exception):
    """The store stayed unreachable past the deadline, or the runner stopped while waiting for it."""


class StoreOutage:
    """Tracks whether the store is reachable, shared by every store call of one runner.

    Args:
        who: names the runner in log lines.
        backoff_s: first wait after a failed call; doubles per failure up to ``max_backoff_s``.
    """

    def __init__(self, who: str, *, backoff_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        if backoff_s <= 0 or max_backoff_s < backoff_s:
            raise ValueError(
                f"need 0 < backoff_s <= max_backoff_s, got backoff_s={backoff_s}, max_backoff_s={max_backoff_s}"
            )
        self.who = who
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.down_since: float | None = None
        #: outages seen (a state change from reachable to unreachable counts one)
        self.outages = 0

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, what: str, exc: BaseException) -> None:
        """Note an unreachable store; logs only on the change from reachable."""
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.outages += 1
            log.warning(
                "runner %s: store unreachable while %s (%s); retrying with backoff up to %.0fs, "
                "in-flight attempts keep running and report when it is back",
                self.who,
                what,
                exc,
                self.max_backoff_s,
            )

    def succeeded(self) -> None:
        """Note a store call that worked; logs only on the change from unreachable."""
        if self.down_since is not None:
            log.warning(
                "runner %s: store reachable again after %.1fs; resuming",
                self.who,
                time.monotonic() - self.down_since,
            )
            self.down_since = None

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` consecutive failures: exponential, capped, with jitter in [d/2, d]."""
        ceiling = min(self.max_backoff_s, self.backoff_s * 2 ** min(failures, 32))
        return random.uniform(ceiling / 2, ceiling)

    async def call(
        self,
        what: str,
        fn: Callable[[], Awaitable[T]],
        *,
        deadline_s: float | None = None,
        stop: asyncio.Event | None = None,
    ) -> T:
        """``await fn()``, retrying while the store is unavailable.

        Raises :class:`GaveUp` after ``deadline_s`` seconds of outage or once ``stop`` is set; any
        other error of ``fn`` propagates at once.
        """
        started = time.monotonic()
        failures = 0
        while True:
            try:
                result = await fn()
            except StoreUnavailableError as exc:
                self.failed(what, exc)
                if stop is not None and stop.is_set():
                    raise GaveUp(f"runner stopping while the store is unreachable ({what})") from exc
                wait = self.delay(failures)
                failures += 1
                if deadline_s is not None:
                    left = deadline_s - (time.monotonic() - started)
                    if left <= 0:
                        raise GaveUp(f"store unreachable for {deadline_s:.0f}s while {what}") from exc
                    wait = min(wait, left)
                if stop is None:
                    await asyncio.sleep(wait)
                else:
                    try:
                        await asyncio.wait_for(stop.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                continue
            self.succeeded()
            return result
