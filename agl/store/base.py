"""The LightningStore protocol: the hub every other component talks through.

Concurrency model: every backend is safe to call from many asyncio tasks, from several event loops
in several threads, and (for SQLite and PostgreSQL) from several processes. A background watchdog
task marks overrun attempts; it starts with the first attempt created or with :meth:`start`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, Literal, TypeVar

import orjson
from pydantic import BaseModel

from agl.errors import NotFoundError, StoreError
from agl.schemas import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    Resource,
    ResourcesVersion,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Span,
    Worker,
    WorkerStatus,
    now_s,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
_StoreT = TypeVar("_StoreT", bound="LightningStore")
Clock = Callable[[], float]
RolloutOrder = Literal["created_at", "updated_at", "rollout_id"]


class Page(BaseModel, Generic[T]):
    """One page of a query; pass ``next_cursor`` back to get the next one (None: no more)."""

    items: list[T]
    next_cursor: str | None = None


def encode_cursor(sort_value: Any, tiebreak: Any) -> str:
    """An opaque keyset cursor: the sort key and id of the last item of a page."""
    return base64.urlsafe_b64encode(orjson.dumps([sort_value, tiebreak])).decode()


class InvalidCursorError(StoreError):
    """A page cursor the store did not hand out (forged, garbled or from another query)."""

    param = "cursor"  # the HTTP error body names it as the field

    def __init__(self, cursor: object) -> None:
        text = repr(cursor) if len(repr(cursor)) <= 80 else repr(cursor)[:77] + "..."
        super().__init__(f"cursor {text} is not one this store handed out; pass next_cursor unchanged")


Kind = type | tuple[type, ...]
SCALAR_KIND: tuple[type, ...] = (str, int, float)


def decode_cursor(cursor: str, sort: Kind | list[Kind] = SCALAR_KIND, tie: Kind = str) -> tuple[Any, Any]:
    """The (sort key, tiebreak) of ``encode_cursor``, checked against the kinds the query expects.

    ``sort`` as a list means a JSON array with one kind per position (a composite sort key).

    Raises:
        InvalidCursorError: the cursor does not decode to that shape.
    """
    try:
        sort_value, tiebreak = orjson.loads(base64.urlsafe_b64decode(cursor.encode()))
    except Exception as exc:
        raise InvalidCursorError(cursor) from exc
    kinds = sort if isinstance(sort, list) else [sort]
    values = sort_value if isinstance(sort, list) else [sort_value]
    if not (
        isinstance(values, list)
        and len(values) == len(kinds)
        and all(_is(v, k) for v, k in zip(values, kinds, strict=True))
        and _is(tiebreak, tie)
    ):
        raise InvalidCursorError(cursor)
    return sort_value, tiebreak


def _is(value: Any, kind: Kind) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def check_limit(limit: int) -> int:
    if not 1 <= limit <= 10_000:
        raise StoreError(f"limit must be between 1 and 10000, got {limit}")
    return limit


QUEUE_KEY = "queue"  # what queue waiters wait on (completion waiters wait on rollout ids)


class CompletionWaiters:
    """Futures waiting for rollouts to finish, woken from any thread or event loop."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None], frozenset[str]]] = []

    def register(self, rollout_ids: Iterable[str]) -> asyncio.Future[None]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiters.append((loop, future, frozenset(rollout_ids)))
        return future

    def discard(self, future: asyncio.Future[None]) -> None:
        with self._lock:
            self._waiters = [w for w in self._waiters if w[1] is not future]

    def notify(self, finished_ids: Iterable[str]) -> None:
        """Wake every waiter interested in any of ``finished_ids``; it re-checks the store itself."""
        finished = set(finished_ids)
        if not finished:
            return
        with self._lock:
            woken = [w for w in self._waiters if w[2] & finished]
        for loop, future, _ in woken:
            with contextlib.suppress(RuntimeError):  # the waiter's loop has closed
                loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class LightningStore(ABC):
    """Task queue, versioned resources and spans behind one async API.

    This is the lifecycle core that runners, the trainer and algorithms use. Subclasses implement the
    abstract methods; the forms built on them (single reads and writes, cancel, the watchdog loop,
    waiting) are written here once. What only the dashboard and analysis read (digests, search,
    statistics, workers) is the read model (``agl.store.read_model``), which every backend adds.
    """

    def __init__(self, *, clock: Clock = now_s, watchdog_interval_s: float = 1.0) -> None:
        self.clock = clock
        self.watchdog_interval_s = watchdog_interval_s
        self._waiters = CompletionWaiters()
        self._queue_waiters = CompletionWaiters()  # runners between empty dequeues, keyed by QUEUE_KEY
        self._watchdog_task: asyncio.Task[None] | None = None

    # ----- rollouts -------------------------------------------------------------------------
    @abstractmethod
    async def enqueue_rollouts(self, requests: Sequence[RolloutCreate]) -> list[Rollout]:
        """Queue rollouts in order; a repeated ``rollout_id`` with equal content returns the stored one.

        Raises:
            NotFoundError: a ``resources_id`` the store does not hold.
            ConflictError: a ``rollout_id`` already stored with different content.
        """

    @abstractmethod
    async def dequeue(self, worker_id: str) -> AttemptedRollout | None:
        """Claim the oldest queued rollout for ``worker_id`` and create its attempt, atomically."""

    @abstractmethod
    async def start_rollout(self, request: RolloutCreate, worker_id: str | None = None) -> AttemptedRollout:
        """Create a rollout and its first attempt at once, bypassing the queue (online use)."""

    @abstractmethod
    async def update_rollout(
        self, rollout_id: str, *, status: RolloutStatus | None = None, metadata: dict[str, Any] | None = None
    ) -> Rollout:
        """Change a rollout's status (checked against the state machine) or merge into its metadata."""

    @abstractmethod
    async def query_rollouts(
        self,
        *,
        status: Sequence[RolloutStatus] | None = None,
        mode: str | None = None,
        group_id: str | None = None,
        rollout_ids: Sequence[str] | None = None,
        order_by: RolloutOrder = "created_at",
        descending: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Rollout]: ...

    # ----- attempts -------------------------------------------------------------------------
    @abstractmethod
    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        *,
        status: AttemptStatus | None = None,
        error: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Attempt:
        """Move an attempt (and so its rollout) forward; retries are decided here.

        Raises:
            StaleAttemptError: the attempt is already final (e.g. the watchdog timed it out).
            InvalidTransitionError: the state machine forbids the change.
        """

    @abstractmethod
    async def heartbeat(self, rollout_id: str, attempt_id: str) -> Rollout:
        """Record a sign of life; returns the rollout so a runner notices cancellation."""

    @abstractmethod
    async def query_attempts(
        self,
        *,
        rollout_id: str | None = None,
        status: Sequence[AttemptStatus] | None = None,
        worker_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Attempt]: ...

    # ----- spans ----------------------------------------------------------------------------
    @abstractmethod
    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        """Store spans (the fast path), assigning ``sequence_id`` where absent; duplicates are ignored.

        A span of a live attempt counts as a heartbeat and moves a preparing attempt to running.
        """

    @abstractmethod
    async def next_sequence_id(self, rollout_id: str) -> int:
        """Reserve the next span sequence id of a rollout."""

    @abstractmethod
    async def query_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        name: str | None = None,
        limit: int = 1000,
        cursor: str | None = None,
    ) -> Page[Span]:
        """Spans ordered by (rollout, sequence_id); ``attempt_id="latest"`` picks each rollout's last attempt."""

    # ----- resources ------------------------------------------------------------------------
    @abstractmethod
    async def add_resources(
        self,
        resources: dict[str, Resource],
        *,
        resources_id: str | None = None,
        parent_id: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> ResourcesVersion:
        """Store a new immutable version; it becomes the latest."""

    @abstractmethod
    async def get_resources(self, resources_id: str) -> ResourcesVersion: ...

    @abstractmethod
    async def query_resources(
        self, *, descending: bool = False, limit: int = 100, cursor: str | None = None
    ) -> Page[ResourcesVersion]:
        """Versions in the order they were added (newest first with ``descending``)."""

    # ----- workers, watchdog ----------------------------------------------------------------
    @abstractmethod
    async def update_worker(
        self, worker_id: str, *, status: WorkerStatus | None = None, host: dict[str, Any] | None = None
    ) -> Worker:
        """Register or refresh a worker (any call counts as its heartbeat)."""

    @abstractmethod
    async def run_watchdog(self) -> list[Attempt]:
        """Mark overrun live attempts ``timeout`` / ``unresponsive`` now; returns those it marked."""

    # ----- written once for every backend over the methods above ----------------------------
    async def get_rollout(self, rollout_id: str) -> Rollout:
        """Raises NotFoundError for an unknown id."""
        found = (await self.query_rollouts(rollout_ids=[rollout_id], limit=1)).items
        if not found:
            raise NotFoundError(f"no rollout {rollout_id!r} in the store", rollout_id=rollout_id)
        return found[0]

    async def get_latest_resources(self) -> ResourcesVersion | None:
        """The version added last, or None before any."""
        found = (await self.query_resources(descending=True, limit=1)).items
        return found[0] if found else None

    async def _finished(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        """The rollouts among ``rollout_ids`` in a terminal state, in that order; NotFoundError for unknown ids."""
        ids = list(dict.fromkeys(rollout_ids))
        found: dict[str, Rollout] = {}
        for start in range(0, len(ids), 10_000):
            chunk = ids[start : start + 10_000]
            found.update(
                (r.rollout_id, r)
                for r in (await self.query_rollouts(rollout_ids=chunk, limit=len(chunk))).items
            )
        for rollout_id in ids:
            if rollout_id not in found:
                raise NotFoundError(f"no rollout {rollout_id!r} in the store", rollout_id=rollout_id)
        return [found[i] for i in ids if found[i].status.is_terminal]

    async def enqueue_rollout(self, input: Any = None, **fields: Any) -> Rollout:
        """Queue one rollout; ``fields`` are those of :class:`RolloutCreate`."""
        (rollout,) = await self.enqueue_rollouts([RolloutCreate(input=input, **fields)])
        return rollout

    async def add_span(self, span: Span) -> Span:
        (stored,) = await self.add_spans([span])
        return stored

    async def cancel_rollout(self, rollout_id: str) -> Rollout:
        return await self.update_rollout(rollout_id, status=RolloutStatus.CANCELLED)

    async def update_resources(self, resources_id: str, changes: dict[str, Resource]) -> ResourcesVersion:
        """A new version: the bundle ``resources_id`` with ``changes`` merged over it."""
        base = await self.get_resources(resources_id)
        return await self.add_resources({**base.resources, **changes}, parent_id=resources_id)

    async def wait_for_rollouts(
        self, rollout_ids: Sequence[str], timeout_s: float | None = None
    ) -> list[Rollout]:
        """Wait until every rollout is terminal or ``timeout_s`` passes; returns the finished ones.

        Woken by completions in this process; changes made by other processes are noticed within
        ``cross_process_poll_s``.
        """
        ids = list(dict.fromkeys(rollout_ids))
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            future = self._waiters.register(ids)
            try:
                finished = await self._finished(ids)
                if len(finished) == len(ids):
                    return finished
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return finished
                wait = self.cross_process_poll_s
                if remaining is not None:
                    wait = remaining if wait is None else min(wait, remaining)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(future), wait)
            finally:
                self._waiters.discard(future)

    async def wait_for_queued(self, timeout_s: float) -> None:
        """Wait until a rollout is queued (or re-queued) through this store object, or ``timeout_s`` passes.

        Runners call it between empty dequeues instead of sleeping, so a step's rollouts start as soon as the
        algorithm enqueues them; it says only that one may be there (dequeue to find out). Rollouts queued by
        another process (another server, a client over HTTP) are not signalled: it then waits ``timeout_s``.
        """
        future = self._queue_waiters.register([QUEUE_KEY])
        try:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(future), timeout_s)
        finally:
            self._queue_waiters.discard(future)

    def _signal_queued(self) -> None:
        """Wake :meth:`wait_for_queued` callers in any thread or event loop."""
        self._queue_waiters.notify([QUEUE_KEY])

    #: How often a waiter re-reads the backend for completions made by other processes (None: never).
    cross_process_poll_s: float | None = None

    async def start(self) -> None:
        """Start the background watchdog on the running loop (idempotent)."""
        self._ensure_watchdog()

    def _ensure_watchdog(self) -> None:
        """Start the watchdog on the current loop unless one is alive (called where attempts are born)."""
        task = self._watchdog_task
        if self.watchdog_interval_s <= 0:
            return
        if task is None or task.done() or task.get_loop().is_closed():
            self._watchdog_task = asyncio.get_running_loop().create_task(self._watchdog_loop())

    async def _watchdog_loop(self) -> None:
        while True:
            await asyncio.sleep(self.watchdog_interval_s)
            try:
                await self.run_watchdog()
            except Exception:  # the watchdog must outlive a transient backend error
                log.exception("store watchdog pass failed; retrying in %.1fs", self.watchdog_interval_s)

    async def aclose(self) -> None:
        """Stop the watchdog and release the backend."""
        task = self._watchdog_task
        if task is not None and task.get_loop() is asyncio.get_running_loop():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, RuntimeError):
                await task
        elif task is not None and not task.get_loop().is_closed():
            task.get_loop().call_soon_threadsafe(task.cancel)
        self._watchdog_task = None

    async def __aenter__(self: _StoreT) -> _StoreT:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
