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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, Literal, TypeVar

import orjson
from pydantic import BaseModel, Field, field_validator

from agl import semconv as sc
from agl.errors import StoreError
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
    WireModel,
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


class StoreStatistics(BaseModel):
    """Counts by status and span volume; cheap enough to call every second."""

    rollouts_by_status: dict[str, int] = Field(default_factory=dict)
    attempts_by_status: dict[str, int] = Field(default_factory=dict)
    spans: int = 0
    span_bytes: int = 0
    resources: int = 0
    workers: int = 0


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


class AttemptDigest(BaseModel):
    """What a list of rollouts shows of an attempt without reading its spans, kept by the store as the
    spans arrive: its last model reply (text and tool-call names), the type of its last exception,
    its final reward (as ``agl.adapter.final_reward``) and the agent named on its first reward span."""

    rollout_id: str
    attempt_id: str
    reply: str | None = None
    error_type: str | None = None
    reward: float | None = None
    agent: str | None = None
    #: increases with every change the store makes to a digest (0 where the store keeps none)
    stamp: int = 0


#: slot -> (value fields, whether its earliest span wins; else its latest). ``gw``/``tr``: the last
#: model call the gateway / a client-side tracer recorded (response id, reply); ``err``: exception
#: type; ``rw``/``rl``: reward without / with a response id; ``ag``: agent named on a reward span
DIGEST_SLOTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gw": (("gw_id", "gw_text"), False),
    "tr": (("tr_id", "tr_text"), False),
    "err": (("err_type",), False),
    "rw": (("rw_value",), False),
    "rl": (("rl_value",), False),
    "ag": (("ag_name",), True),
}
#: a digest's raw state: slot -> (sequence id, *values)
DigestState = dict[str, tuple[Any, ...]]


def span_digest(name: str, attributes: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """The digest slots one span fills (slot -> values), read from its name and attributes only (a
    stored span's JSON need not become a :class:`Span`)."""
    out: dict[str, tuple[Any, ...]] = {}
    if (sc.LLM_API in attributes or name == sc.SPAN_LLM_CALL) and name != sc.SPAN_EMBEDDINGS:
        message = attributes.get(sc.LLM_RESPONSE_MESSAGE)
        message = message if isinstance(message, dict) else {}
        content = message.get("content")
        text = content if isinstance(content, str) else ""
        names = [  # as the dashboard's ``output_text`` writes a reply
            str((c.get("function") or {}).get("name", c.get("name", "?")))
            for c in attributes.get(sc.LLM_TOOL_CALLS) or message.get("tool_calls") or []
            if isinstance(c, dict)
        ]
        text += "".join(f" [tool call {n}]" for n in names)
        response_id = attributes.get(sc.LLM_RESPONSE_ID)
        slot = "gw" if str(attributes.get(sc.LLM_SOURCE, "gateway")) == "gateway" else "tr"
        out[slot] = (str(response_id) if response_id else None, text)
    elif name == sc.SPAN_EXCEPTION:
        out["err"] = (str(attributes.get(sc.EXCEPTION_TYPE)),)
    elif name == sc.SPAN_REWARD:
        try:
            value = float(attributes[sc.REWARD_VALUE])
        except (KeyError, TypeError, ValueError):
            value = None
        if value is not None:
            out["rl" if sc.REWARD_RESPONSE_ID in attributes else "rw"] = (value,)
        if sc.AGENT_NAME in attributes:
            out["ag"] = (str(attributes[sc.AGENT_NAME]),)
    return out


def merge_digest(state: DigestState, sequence_id: int, slots: Mapping[str, tuple[Any, ...]]) -> None:
    """Fold one span's slots into ``state``: the latest span wins a slot (the earliest for ``ag``)."""
    for slot, values in slots.items():
        known = state.get(slot)
        first = DIGEST_SLOTS[slot][1]
        if known is None or (sequence_id < known[0] if first else sequence_id > known[0]):
            state[slot] = (sequence_id, *values)


def resolve_digest(rollout_id: str, attempt_id: str, stamp: int, state: DigestState) -> AttemptDigest:
    """The digest a state stands for."""
    return AttemptDigest(rollout_id=rollout_id, attempt_id=attempt_id, stamp=stamp, **digest_values(state))


def digest_values(state: DigestState) -> dict[str, Any]:
    """A digest state's reply, error type, reward and agent. A tracer's record of the gateway's last
    response is that response (the gateway's record wins, as in ``agl.adapter.llm_calls``)."""
    gw, tr = state.get("gw"), state.get("tr")
    reply = None
    if tr is not None and (gw is None or (tr[0] > gw[0] and not (tr[1] and tr[1] == gw[1]))):
        reply = tr[2]
    elif gw is not None:
        reply = gw[2]
    reward = state.get("rw") or state.get("rl")
    return {
        "reply": reply,
        "error_type": state["err"][1] if "err" in state else None,
        "reward": reward[1] if reward else None,
        "agent": state["ag"][1] if "ag" in state else None,
    }


RolloutSort = Literal["created", "reward", "duration"]


class RolloutSearch(WireModel):
    """What :meth:`LightningStore.search_rollouts` looks for: every given filter must hold.

    ``text`` is a case-insensitive substring of the rollout id, its input (a string as itself, anything
    else as compact JSON) or its latest attempt's last reply; ``agent``, ``error_type`` and the reward
    sort read that attempt's digest; ``metadata`` keys must equal the given values. Sorts put rollouts
    without a value (no reward, not ended) last; ties go newest first.
    """

    text: str | None = None
    status: list[RolloutStatus] | None = None
    mode: str | None = None
    group_id: str | None = None
    resources_id: str | None = None
    agent: str | None = None
    error_type: str | None = None
    metadata: dict[str, str | int | float] | None = None
    sort: RolloutSort = "created"
    descending: bool = True
    limit: int = Field(50, ge=1, le=10_000)
    offset: int = Field(0, ge=0, le=10**15)

    @field_validator("metadata")
    @classmethod
    def _plain_keys(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and any('"' in key for key in value):
            raise ValueError("metadata keys to filter on cannot hold a double quote")  # SQLite's JSON paths
        return value


class ListedRollout(BaseModel):
    """A rollout and the digest of its latest attempt (None: nothing recorded yet)."""

    rollout: Rollout
    digest: AttemptDigest | None = None


class RolloutMatches(BaseModel):
    """One page of a search, and how many rollouts match in all."""

    items: list[ListedRollout]
    total: int


def search_text(rollout: Rollout) -> str:
    """What ``text`` is looked for in besides the reply, lower-cased: the rollout id and its input."""
    given = rollout.input if isinstance(rollout.input, str) else orjson.dumps(rollout.input).decode()
    return f"{rollout.rollout_id}\n{given}".lower()


def duration_s(rollout: Rollout) -> float | None:
    """Seconds from the first start to the end, or None while the rollout has not ended."""
    if rollout.ended_at is None:
        return None
    return rollout.ended_at - (rollout.started_at or rollout.created_at)


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

    Subclasses implement the abstract methods; convenience forms (single-item writes, cancel,
    the watchdog loop, waiting) are written here once.
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
    async def get_rollout(self, rollout_id: str) -> Rollout:
        """Raises NotFoundError for an unknown id."""

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

    @abstractmethod
    async def query_digests(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        after: int = 0,
        limit: int = 10_000,
    ) -> Page[AttemptDigest]:
        """Digests of each rollout's latest attempt (none for one without model calls, exceptions or
        rewards), by increasing ``stamp``, only those stamped after ``after``; ``next_cursor`` is the
        last stamp (pass it as ``after``) when more remain."""

    @abstractmethod
    async def search_rollouts(self, query: RolloutSearch) -> RolloutMatches:
        """Rollouts matching ``query`` (text, filters, digest facts), sorted and paged by the store."""

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
    async def get_latest_resources(self) -> ResourcesVersion | None: ...

    @abstractmethod
    async def query_resources(self, *, limit: int = 100, cursor: str | None = None) -> Page[ResourcesVersion]:
        """Versions in the order they were added."""

    # ----- workers, statistics, watchdog ----------------------------------------------------
    @abstractmethod
    async def update_worker(
        self, worker_id: str, *, status: WorkerStatus | None = None, host: dict[str, Any] | None = None
    ) -> Worker: ...

    @abstractmethod
    async def get_worker(self, worker_id: str) -> Worker: ...

    @abstractmethod
    async def query_workers(
        self, *, status: Sequence[WorkerStatus] | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[Worker]: ...

    @abstractmethod
    async def statistics(self) -> StoreStatistics: ...

    @abstractmethod
    async def run_watchdog(self) -> list[Attempt]:
        """Mark overrun live attempts ``timeout`` / ``unresponsive`` now; returns those it marked."""

    @abstractmethod
    async def _finished(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        """The rollouts among ``rollout_ids`` in a terminal state; NotFoundError for unknown ids."""

    # ----- written once for every backend ---------------------------------------------------
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
