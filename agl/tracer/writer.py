"""The one path spans take into a store, shared by the runner and the gateway; and riding out store outages.

A :class:`SpanWriter` keeps a bounded queue of spans (or zero-argument callables that build them) and one
task that writes them in batches, in the order they came. A batch rides out an unreachable store
(``StoreUnavailableError``) with capped, jittered backoff until ``deadline_s`` of outage has passed; a
batch the store rejects (a 4xx: a deleted rollout, a malformed span) is split in halves until the bad span
is alone, so one bad span never costs the others. Counters say what was written, dropped (queue full),
failed (rejected, unbuildable or given up on) and how many store calls failed.

:class:`StoreOutage` is the backoff and the once-per-state-change logging; a runner shares one between its
writer and its other store calls (claims, heartbeats, reports), so an outage is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar, cast

from agl.errors import StoreUnavailableError, UnauthorizedError
from agl.schemas import Span
from agl.tracer.context import suppressed

if TYPE_CHECKING:
    from agl.store.base import LightningStore

log = logging.getLogger(__name__)
T = TypeVar("T")

#: what a writer accepts: a span, or a callable that builds one on the writer's task (off the caller's path)
SpanSource = Span | Callable[[], Span]


class GaveUp(Exception):
    """The store stayed unreachable past the deadline, or the caller stopped while waiting for it."""


class StoreOutage:
    """Whether the store is reachable, shared by every store call of one runner or gateway.

    Args:
        who: names the caller in log lines (``"runner w-1"``, ``"gateway"``).
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

    def down_for(self) -> float:
        """Seconds the store has been unreachable (0 while it answers)."""
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def failed(self, what: str, exc: BaseException) -> None:
        """Note an unreachable store; logs only on the change from reachable."""
        if self.down_since is None:
            self.down_since = time.monotonic()
            self.outages += 1
            log.warning(
                "%s: store unreachable while %s (%s); retrying with backoff up to %.0fs, "
                "work in flight keeps running and is stored when it is back",
                self.who,
                what,
                exc,
                self.max_backoff_s,
            )

    def succeeded(self) -> None:
        """Note a store call that worked; logs only on the change from unreachable."""
        if self.down_since is not None:
            log.warning(
                "%s: store reachable again after %.1fs; resuming",
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
                    raise GaveUp(f"stopping while the store is unreachable ({what})") from exc
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


@dataclass
class SpanTally:
    """How many of one owner's spans (a runner's attempt) were written and how many were given up on."""

    written: int = 0
    failed: int = 0


@dataclass
class WriterStats:
    """A writer's counters since it was made."""

    written: int = 0
    #: refused at ``submit`` because the queue was full
    dropped: int = 0
    #: rejected by the store, unbuildable, or given up on after the outage deadline
    failed: int = 0
    #: failed ``add_spans`` calls, each retry counted
    store_errors: int = 0


class _Entry:
    __slots__ = ("item", "settled", "tally")

    def __init__(self, item: SpanSource, tally: SpanTally | None) -> None:
        self.item, self.tally, self.settled = item, tally, False


class SpanWriter:
    """Writes spans to ``store`` in batches from one background task; see the module docstring.

    Args:
        store: any LightningStore.
        who: names the owner in log lines.
        queue_size: spans waiting at most; :meth:`submit` drops beyond it, :meth:`put` waits for room.
        batch_size: spans per ``add_spans`` call at most.
        deadline_s: how long a batch rides out an unreachable store before its spans count as failed.
        outage: the backoff and outage log to share; one of its own (``backoff_s``..``max_backoff_s``) if None.
    """

    def __init__(
        self,
        store: LightningStore,
        *,
        who: str = "span writer",
        queue_size: int = 10_000,
        batch_size: int = 256,
        deadline_s: float = 600.0,
        outage: StoreOutage | None = None,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ) -> None:
        if queue_size < 1 or batch_size < 1:
            raise ValueError(f"queue_size and batch_size must be >= 1, got {queue_size} and {batch_size}")
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.store = store
        self.queue_size, self.batch_size, self.deadline_s = queue_size, batch_size, deadline_s
        self.outage = outage or StoreOutage(who, backoff_s=backoff_s, max_backoff_s=max_backoff_s)
        self.stats = WriterStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[_Entry] | None = None
        self._task: asyncio.Task[None] | None = None
        self._queued = 0  # entries put on the current queue, ever
        self._done = 0  # of those, entries settled (written or failed)
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._full_logged = False

    @property
    def queued(self) -> int:
        """Spans waiting for the store (queued, or in the batch being written)."""
        return self._queued - self._done

    # ----- producers ----------------------------------------------------------------------------
    def submit(self, item: SpanSource, tally: SpanTally | None = None) -> bool:
        """Queue a span without waiting; a full queue drops it (counted, logged once per episode)."""
        queue = self._ensure()
        try:
            queue.put_nowait(_Entry(item, tally))
        except asyncio.QueueFull:
            self.stats.dropped += 1
            if tally is not None:
                tally.failed += 1
            if not self._full_logged:
                self._full_logged = True
                log.warning(
                    "%s: span queue full (%d); dropping spans until it drains (counted)",
                    self.outage.who,
                    self.queue_size,
                )
            return False
        self._queued += 1
        return True

    async def put(self, items: Iterable[SpanSource], tally: SpanTally | None = None) -> None:
        """Queue spans, waiting for room while the queue is full (back-pressure instead of drops)."""
        for item in items:
            queue, entry = self._ensure(), _Entry(item, tally)
            if queue.full():
                await queue.put(entry)
            else:  # what put() does when there is room, without a coroutine per span
                queue.put_nowait(entry)
            self._queued += 1

    async def flush(self) -> None:
        """Return once every span queued before this call is written or counted failed."""
        if self._queue is None or self._done >= self._queued:
            return
        self._ensure()  # a writer task that died is restarted on what is queued
        if self._done >= self._queued:  # what was queued belonged to a loop that is gone
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((self._queued, waiter))
        await waiter

    async def aclose(self, timeout_s: float | None = None) -> None:
        """Flush (for at most ``timeout_s``), then stop the task; spans still queued then count failed."""
        task = self._task
        if task is None:
            return
        try:
            await asyncio.wait_for(self.flush(), timeout_s)
        except asyncio.TimeoutError:
            log.error(
                "%s: %d spans not stored %.0fs into closing; they are lost",
                self.outage.who,
                self.queued,
                timeout_s,
            )
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        self._task = None
        queue = self._queue
        while queue is not None and not queue.empty():
            self._fail([queue.get_nowait()], None)
        self._advance(0)

    # ----- the writer task ----------------------------------------------------------------------
    def _ensure(self) -> asyncio.Queue[_Entry]:
        """The queue of the running loop, with its writer task running (started on first use)."""
        loop = asyncio.get_running_loop()
        if self._queue is None or self._loop is not loop:
            self._loop, self._queue, self._task = loop, asyncio.Queue(self.queue_size), None
            self._done = self._queued  # whatever an earlier loop held went with it
            self._waiters = []
        if self._task is None or self._task.done():
            with suppressed():  # the task inherits this context: agl's own store calls are never traced
                self._task = loop.create_task(self._run(self._queue), name="agl-span-writer")
        return self._queue

    async def _run(self, queue: asyncio.Queue[_Entry]) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < self.batch_size and not queue.empty():
                batch.append(queue.get_nowait())
            self._full_logged = False
            try:
                await self._write(batch)
            except Exception:  # a bug here must not stop the writer or lose track of the batch
                log.exception("%s: writing %d spans failed", self.outage.who, len(batch))
            finally:  # cancelled (closing) or failed: whatever is unsettled is lost, and counted
                self._fail([e for e in batch if not e.settled], None)
                self._advance(len(batch))

    def _advance(self, n: int) -> None:
        self._done = self._queued if self._task is None else self._done + n
        ready = [w for w in self._waiters if w[0] <= self._done]
        self._waiters = [w for w in self._waiters if w[0] > self._done]
        for _, waiter in ready:
            if not waiter.done():
                waiter.set_result(None)

    async def _write(self, batch: list[_Entry]) -> None:
        built: list[_Entry] = []
        for i, entry in enumerate(batch):
            if not isinstance(entry.item, Span):
                if i and i % 32 == 0:
                    await asyncio.sleep(0)  # building a big batch must not stall the loop it shares
                try:
                    entry.item = entry.item()
                except Exception:  # a bug in a converter must not stop the writer
                    log.exception("%s: could not build a span; dropping it", self.outage.who)
                    self._fail([entry], None)
                    continue
            built.append(entry)
        if built:
            await self._store(built)

    async def _store(self, entries: list[_Entry]) -> None:
        """Write ``entries`` in one call; ride out an outage until the deadline; split around a bad span."""
        first_failure: float | None = None
        failures = 0
        while True:
            try:
                await self.store.add_spans(cast(list[Span], [e.item for e in entries]))
            except StoreUnavailableError as exc:
                self.stats.store_errors += 1
                self.outage.failed(f"storing {len(entries)} spans", exc)
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                waited = max(now - first_failure, self.outage.down_for())
                if waited >= self.deadline_s:
                    reason = f"the store was unreachable for {waited:.0f}s (deadline_s={self.deadline_s:g})"
                    self._fail(entries, reason, level=logging.ERROR)
                    return
                await asyncio.sleep(min(self.outage.delay(failures), self.deadline_s - waited))
                failures += 1
                continue
            except UnauthorizedError as exc:  # about the caller, not a span: splitting would not help
                self.stats.store_errors += 1
                self._fail(entries, str(exc))
                return
            except Exception as exc:  # a rejected batch: find the bad span(s), keep the others
                self.stats.store_errors += 1
                if len(entries) == 1:
                    self._fail(entries, f"{type(exc).__name__}: {exc}")
                    return
                half = len(entries) // 2
                await self._store(entries[:half])
                await self._store(entries[half:])
                return
            self.outage.succeeded()
            self.stats.written += len(entries)
            for entry in entries:
                entry.settled = True
                if entry.tally is not None:
                    entry.tally.written += 1
            return

    def _fail(self, entries: list[_Entry], reason: str | None, level: int = logging.WARNING) -> None:
        """Count ``entries`` as failed; with a ``reason``, log it (rejections warn, lost outages are errors)."""
        if not entries:
            return
        if reason is not None:
            item = entries[0].item
            where = f" of rollout {item.rollout_id}" if isinstance(item, Span) else ""
            log.log(level, "%s: could not store %d spans%s: %s", self.outage.who, len(entries), where, reason)
        self.stats.failed += len(entries)
        for entry in entries:
            entry.settled = True
            if entry.tally is not None:
                entry.tally.failed += 1
