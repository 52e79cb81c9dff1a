"""The rollout/attempt lifecycle, written once over a small tables interface.

Every backend supplies :class:`Tables` (row access inside one transaction, or under one lock) and
``_tx`` (how a transaction runs); enqueue, dequeue, start, attempt updates, heartbeats, spans,
resources, workers and the watchdog are decided here, so memory, SQLite and PostgreSQL cannot drift.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from agl.errors import ConflictError, NotFoundError, StaleAttemptError
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
    new_id,
)
from agl.store import _logic
from agl.store.base import Page, RolloutOrder, check_limit
from agl.store.read_model import StoreWithReadModel
from agl.store.states import rollout_status_for_attempt, transition, watchdog_verdict

R = TypeVar("R")
#: a unit of work: ``fn(tables, finished)``; it appends the ids of rollouts it finished to ``finished``
Work = Callable[["Tables", list[str]], R]
#: what a unit of work will ``prefetch``: (rollout id, attempt id, span ids) each
ReadList = list[tuple[str, str, Sequence[str]]]


class Reads(Generic[R]):
    """A unit of work that names up front what it will ``prefetch`` (and how many queue heads it will
    claim), so that a backend running many calls at once (PostgreSQL) can read the rows of all of them
    in one go. Called, it is the work."""

    __slots__ = ("claims", "fn", "reads")

    def __init__(self, fn: Work[R], reads: ReadList, claims: int = 0) -> None:
        self.fn, self.reads, self.claims = fn, reads, claims

    def __call__(self, t: Tables, finished: list[str]) -> R:
        return self.fn(t, finished)


@dataclass(frozen=True)
class Query:
    """One keyset-paginated read: rows of ``table`` whose columns take one of the listed values."""

    table: str  # rollouts, attempts, spans, resources or workers
    where: dict[str, list[Any]]
    order: tuple[str, ...]  # sort columns; ``pos`` is insertion order
    tiebreak: str
    descending: bool = False
    limit: int = 100
    cursor: str | None = None
    latest_attempt: bool = False  # spans: only those of each rollout's latest attempt


def _where(**filters: Any) -> dict[str, list[Any]]:
    """Filters given as values or lists of values, None ones dropped, enums as their values."""
    out = {}
    for column, value in filters.items():
        if value is not None:
            values = list(value) if isinstance(value, (list, tuple, set)) else [value]
            out[column] = [getattr(v, "value", v) for v in values]
    return out


class Tables(ABC):
    """Row access for the lifecycle; every call happens inside the caller's transaction.

    Reads return objects the caller may mutate; nothing is stored until the matching ``save``/``insert``.
    """

    @abstractmethod
    def rollout(self, rollout_id: str) -> Rollout | None: ...

    @abstractmethod
    def insert_rollout(self, rollout: Rollout) -> None:
        """Store a new rollout; a queued one joins the queue's tail."""

    @abstractmethod
    def save_rollout(self, rollout: Rollout, *, enqueue: bool = False) -> None:
        """Write a rollout back; ``enqueue`` puts it at the queue's tail, a non-queued status takes it out."""

    @abstractmethod
    def queue_head(self) -> Rollout | None:
        """The oldest queued rollout, locked for this transaction's claim."""

    @abstractmethod
    def attempt(self, rollout_id: str, attempt_id: str) -> Attempt | None: ...

    @abstractmethod
    def insert_attempt(self, attempt: Attempt) -> None: ...

    @abstractmethod
    def save_attempt(self, attempt: Attempt) -> None: ...

    @abstractmethod
    def live_attempts(
        self, rollout_id: str | None = None, *, overdue_at: float | None = None
    ) -> list[tuple[Attempt, Rollout]]:
        """Non-terminal attempts (of one rollout, or all) with their rollouts. With ``overdue_at``, at
        least those ``watchdog_verdict`` marks at that time (the watchdog's pass, every second, need
        not read every live attempt in full)."""

    @abstractmethod
    def worker(self, worker_id: str) -> Worker | None: ...

    @abstractmethod
    def save_worker(self, worker: Worker) -> None: ...

    # A backend that pays a round trip per statement (PostgreSQL) overrides these four: one read
    # instead of several, and worker writes that need no read first. The defaults are the plain reads
    # and writes above, so every backend means the same by them.
    def prefetch(self, rollout_id: str, attempt_id: str, span_ids: Sequence[str] = ()) -> None:  # noqa: B027
        """A hint that this call reads the rollout, the attempt and whether these spans are stored
        (the default reads nothing ahead)."""

    def touch_worker(self, worker_id: str, now: float) -> None:
        """A sign of life from ``worker_id`` (registered when unknown); nothing else about it changes."""
        worker = self.worker(worker_id) or Worker(worker_id=worker_id)
        worker.last_heartbeat_at = now
        self.save_worker(worker)

    def claim_worker(self, worker_id: str, now: float, rollout_id: str, attempt_id: str) -> None:
        """``worker_id`` (registered when unknown) is busy with this attempt, as of ``now``."""
        worker = self.worker(worker_id) or Worker(worker_id=worker_id)
        worker.last_heartbeat_at = now
        worker.status = WorkerStatus.BUSY
        worker.current_rollout_id, worker.current_attempt_id = rollout_id, attempt_id
        self.save_worker(worker)

    def release_worker(self, worker_id: str, attempt_id: str) -> None:
        """``worker_id`` goes idle if ``attempt_id`` is still its current attempt."""
        worker = self.worker(worker_id)
        if worker is not None and worker.current_attempt_id == attempt_id:
            worker.status = WorkerStatus.IDLE
            worker.current_attempt_id = worker.current_rollout_id = None
            self.save_worker(worker)

    @abstractmethod
    def insert_spans(self, spans: list[Span]) -> list[Span]:
        """Store spans not yet stored, assigning missing sequence ids; returns those stored."""

    @abstractmethod
    def next_sequence_id(self, rollout_id: str) -> int:
        """Reserve the next span sequence id of an existing rollout."""

    @abstractmethod
    def resources(self, resources_id: str | None) -> ResourcesVersion | None:
        """One version, or the latest when ``resources_id`` is None."""

    @abstractmethod
    def insert_resources(self, version: ResourcesVersion) -> ResourcesVersion:
        """Store a new version; the tables number it (``version`` is set on the returned copy)."""

    @abstractmethod
    def page(self, query: Query) -> Page[Any]:
        """One page of ``query`` in (order, tiebreak) order, after its cursor."""


class TableStore(StoreWithReadModel):
    """A LightningStore whose whole lifecycle runs as units of work over :class:`Tables`; the backend adds
    the rest of the read model (digests, search, statistics)."""

    @abstractmethod
    async def _tx(self, fn: Work[R], *, write: bool = True) -> R:
        """Run ``fn`` in one transaction; waiters are told of the rollouts it finished after it commits."""

    # ----- row helpers ----------------------------------------------------------------------
    @staticmethod
    def _rollout(t: Tables, rollout_id: str) -> Rollout:
        rollout = t.rollout(rollout_id)
        if rollout is None:
            raise NotFoundError(f"no rollout {rollout_id!r} in the store", rollout_id=rollout_id)
        return rollout

    @staticmethod
    def _attempt(t: Tables, rollout_id: str, attempt_id: str) -> Attempt:
        attempt = t.attempt(rollout_id, attempt_id)
        if attempt is None:
            TableStore._rollout(t, rollout_id)
            raise NotFoundError(
                f"rollout {rollout_id} has no attempt {attempt_id!r}",
                rollout_id=rollout_id,
                attempt_id=attempt_id,
            )
        return attempt

    def _set_rollout_status(
        self, t: Tables, rollout: Rollout, status: RolloutStatus, finished: list[str]
    ) -> bool:
        """Apply a checked transition (the caller saves the rollout); True when it re-entered the queue."""
        if rollout.status == status:
            return False
        transition(rollout.status, status, rollout_id=rollout.rollout_id)
        now = self.clock()
        rollout.status = status
        rollout.updated_at = now
        # claimed is started: an attempt that prepares for a while still counts toward its duration
        if status in (RolloutStatus.PREPARING, RolloutStatus.RUNNING) and rollout.started_at is None:
            rollout.started_at = now
        if status.is_terminal:
            rollout.ended_at = now
            finished.append(rollout.rollout_id)
            for attempt, _ in t.live_attempts(rollout.rollout_id):  # cancelling a live attempt ends it
                self._finish_attempt(t, attempt, AttemptStatus.FAILED, "rollout cancelled")
        if status == RolloutStatus.REQUEUING:
            self._signal_queued()  # a hint only: a waiter that finds nothing waits again
        return status == RolloutStatus.REQUEUING

    def _finish_attempt(self, t: Tables, attempt: Attempt, status: AttemptStatus, error: str | None) -> None:
        attempt.status = status
        attempt.ended_at = self.clock()
        if error is not None:
            attempt.error = error
        t.save_attempt(attempt)
        if attempt.worker_id is not None:
            t.release_worker(attempt.worker_id, attempt.attempt_id)

    def _move_attempt(
        self, t: Tables, attempt: Attempt, status: AttemptStatus, error: str | None, finished: list[str]
    ) -> None:
        rollout = self._rollout(t, attempt.rollout_id)
        transition(attempt.status, status, rollout_id=attempt.rollout_id, attempt_id=attempt.attempt_id)
        if status.is_terminal:
            self._finish_attempt(t, attempt, status, error)
        else:
            attempt.status = status
            t.save_attempt(attempt)
        target = rollout_status_for_attempt(status, attempt.attempt_number, rollout.retry)
        if rollout.status != target:
            enqueue = self._set_rollout_status(t, rollout, target, finished)
            t.save_rollout(rollout, enqueue=enqueue)

    def _touch_worker(self, t: Tables, worker_id: str) -> Worker:
        worker = t.worker(worker_id) or Worker(worker_id=worker_id)
        worker.last_heartbeat_at = self.clock()
        return worker

    def _create_attempt(self, t: Tables, rollout: Rollout, worker_id: str | None) -> AttemptedRollout:
        attempt = _logic.new_attempt(rollout, worker_id, self.clock())
        rollout.num_attempts = attempt.attempt_number
        t.insert_attempt(attempt)
        t.save_rollout(rollout)
        if worker_id is not None:
            t.claim_worker(worker_id, self.clock(), rollout.rollout_id, attempt.attempt_id)
        return AttemptedRollout(rollout=rollout, attempt=attempt)

    def _resolve_resources(self, t: Tables, resources_id: str | None) -> str | None:
        version = t.resources(resources_id)
        if version is None and resources_id is not None:
            raise NotFoundError(f"no resources {resources_id!r} in the store; add them before enqueueing")
        return None if version is None else version.resources_id

    def _insert_rollout(
        self, t: Tables, req: RolloutCreate, status: RolloutStatus, resources_id: str | None
    ) -> Rollout:
        if req.rollout_id is not None:
            existing = t.rollout(req.rollout_id)
            if existing is not None:
                return _logic.check_same_request(existing, req)
        rollout = _logic.new_rollout(req, resources_id, self.clock(), status)
        if status != RolloutStatus.QUEUING:  # started by its first claim (start_rollout): started now
            rollout.started_at = rollout.created_at
        t.insert_rollout(rollout)
        return rollout

    # ----- rollouts -------------------------------------------------------------------------
    async def enqueue_rollouts(self, requests: Sequence[RolloutCreate]) -> list[Rollout]:
        reqs = _logic.coerce_rollout_creates(requests)

        def op(t: Tables, _: list[str]) -> list[Rollout]:
            wanted = {r.resources_id for r in reqs}  # check the whole batch before writing any of it
            resolved = {rid: self._resolve_resources(t, rid) for rid in wanted}
            return [self._insert_rollout(t, r, RolloutStatus.QUEUING, resolved[r.resources_id]) for r in reqs]

        rollouts = await self._tx(op)
        self._signal_queued()
        return rollouts

    async def dequeue(self, worker_id: str) -> AttemptedRollout | None:
        self._ensure_watchdog()

        def op(t: Tables, finished: list[str]) -> AttemptedRollout | None:
            rollout = t.queue_head()
            if rollout is None:
                t.touch_worker(worker_id, self.clock())
                return None
            self._set_rollout_status(t, rollout, RolloutStatus.PREPARING, finished)
            return self._create_attempt(t, rollout, worker_id)

        return await self._tx(Reads(op, [], claims=1))

    async def start_rollout(self, request: RolloutCreate, worker_id: str | None = None) -> AttemptedRollout:
        self._ensure_watchdog()
        (req,) = _logic.coerce_rollout_creates([request])

        def op(t: Tables, _: list[str]) -> AttemptedRollout:
            if req.rollout_id is not None and t.rollout(req.rollout_id) is not None:
                raise ConflictError(f"rollout {req.rollout_id} already exists", rollout_id=req.rollout_id)
            resources_id = self._resolve_resources(t, req.resources_id)
            return self._create_attempt(
                t, self._insert_rollout(t, req, RolloutStatus.PREPARING, resources_id), worker_id
            )

        return await self._tx(op)

    async def _page(self, query: Query, rollout_id: str | None = None) -> Page[Any]:
        check_limit(query.limit)

        def op(t: Tables, _: list[str]) -> Page[Any]:
            if rollout_id is not None:
                self._rollout(t, rollout_id)
            return t.page(query)

        return await self._tx(op, write=False)

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
    ) -> Page[Rollout]:
        statuses = None if status is None else [RolloutStatus(s) for s in status]
        where = _where(status=statuses, mode=mode, group_id=group_id, rollout_id=rollout_ids)
        column = {"created_at": "pos", "updated_at": "updated_at", "rollout_id": "rollout_id"}[order_by]
        return await self._page(Query("rollouts", where, (column,), "rollout_id", descending, limit, cursor))

    async def update_rollout(
        self, rollout_id: str, *, status: RolloutStatus | None = None, metadata: dict[str, Any] | None = None
    ) -> Rollout:
        _logic.checked_json(metadata, "metadata")

        def op(t: Tables, finished: list[str]) -> Rollout:
            rollout = self._rollout(t, rollout_id)
            enqueue = False
            if status is not None:
                enqueue = self._set_rollout_status(t, rollout, RolloutStatus(status), finished)
            if metadata:
                rollout.metadata = {**rollout.metadata, **metadata}
                rollout.updated_at = self.clock()
            if enqueue or status is not None or metadata:
                t.save_rollout(rollout, enqueue=enqueue)
            return rollout

        return await self._tx(op)

    # ----- attempts -------------------------------------------------------------------------
    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        *,
        status: AttemptStatus | None = None,
        error: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Attempt:
        _logic.checked_json(metadata, "metadata")

        def op(t: Tables, finished: list[str]) -> Attempt:
            t.prefetch(rollout_id, attempt_id)
            attempt = self._attempt(t, rollout_id, attempt_id)
            if status is not None:
                target = AttemptStatus(status)
                if attempt.status.is_terminal and target != attempt.status:
                    raise StaleAttemptError(
                        f"attempt {attempt_id} of rollout {rollout_id} is already {attempt.status.value}; "
                        f"its update to {target.value} was ignored",
                        rollout_id=rollout_id,
                        attempt_id=attempt_id,
                    )
                if target != attempt.status:
                    self._move_attempt(t, attempt, target, error, finished)
            if error is not None:
                attempt.error = error
            if metadata:
                attempt.metadata = {**attempt.metadata, **metadata}
            if error is not None or metadata:
                t.save_attempt(attempt)
            return attempt

        return await self._tx(Reads(op, [(rollout_id, attempt_id, ())]))

    async def heartbeat(self, rollout_id: str, attempt_id: str) -> Rollout:
        def op(t: Tables, _: list[str]) -> Rollout:
            t.prefetch(rollout_id, attempt_id)
            attempt = self._attempt(t, rollout_id, attempt_id)
            if attempt.status.is_terminal:
                raise StaleAttemptError(
                    f"attempt {attempt_id} of rollout {rollout_id} is already {attempt.status.value}; stop working on it",
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                )
            attempt.last_heartbeat_at = self.clock()
            t.save_attempt(attempt)
            if attempt.worker_id is not None:
                t.touch_worker(attempt.worker_id, attempt.last_heartbeat_at)
            return self._rollout(t, rollout_id)

        return await self._tx(Reads(op, [(rollout_id, attempt_id, ())]))

    async def query_attempts(
        self,
        *,
        rollout_id: str | None = None,
        status: Sequence[AttemptStatus] | None = None,
        worker_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Attempt]:
        statuses = None if status is None else [AttemptStatus(s) for s in status]
        where = _where(rollout_id=rollout_id, status=statuses, worker_id=worker_id)
        return await self._page(
            Query("attempts", where, ("pos",), "attempt_id", False, limit, cursor), rollout_id
        )

    # ----- spans ----------------------------------------------------------------------------
    async def query_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        name: str | None = None,
        limit: int = 1000,
        cursor: str | None = None,
    ) -> Page[Span]:
        latest = attempt_id == "latest"
        where = _where(rollout_id=rollout_id, attempt_id=None if latest else attempt_id, name=name)
        order = ("rollout_id", "sequence_id")
        return await self._page(
            Query("spans", where, order, "span_id", False, limit, cursor, latest), rollout_id
        )

    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        batch = _logic.coerce_spans(spans)
        span_ids: dict[tuple[str, str], list[str]] = {}
        for span in batch:
            span_ids.setdefault((span.rollout_id, span.attempt_id), []).append(span.span_id)

        def op(t: Tables, finished: list[str]) -> list[Span]:
            attempts: dict[tuple[str, str], Attempt] = {}
            for key, ids in span_ids.items():  # check references before writing anything
                t.prefetch(*key, ids)
                attempts[key] = self._attempt(t, *key)
            stored = t.insert_spans(batch)
            now = self.clock()
            for attempt in attempts.values():
                if attempt.status.is_terminal:
                    continue  # late spans of a superseded attempt are kept but move nothing
                attempt.last_heartbeat_at = now
                if attempt.status == AttemptStatus.PREPARING:
                    self._move_attempt(t, attempt, AttemptStatus.RUNNING, None, finished)
                else:
                    t.save_attempt(attempt)
            return stored

        return await self._tx(Reads(op, [(rid, aid, ids) for (rid, aid), ids in span_ids.items()]))

    async def next_sequence_id(self, rollout_id: str) -> int:
        def op(t: Tables, _: list[str]) -> int:
            self._rollout(t, rollout_id)
            return t.next_sequence_id(rollout_id)

        return await self._tx(op)

    # ----- resources ------------------------------------------------------------------------
    async def add_resources(
        self,
        resources: dict[str, Resource],
        *,
        resources_id: str | None = None,
        parent_id: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> ResourcesVersion:
        named = _logic.coerce_resources(resources)
        _logic.checked_json(metadata, "metadata")

        def op(t: Tables, _: list[str]) -> ResourcesVersion:
            existing = None if resources_id is None else t.resources(resources_id)
            if existing is not None:
                if existing.resources != named:
                    raise ConflictError(
                        f"resources {resources_id} already exist with other content; versions are immutable, "
                        "use update_resources to derive a new one"
                    )
                return existing
            if parent_id is not None and t.resources(parent_id) is None:
                raise NotFoundError(f"parent resources {parent_id!r} are not in the store")
            version = ResourcesVersion(
                resources_id=resources_id or new_id("rs"),
                version=0,
                resources=named,
                parent_id=parent_id,
                metadata=metadata or {},
                created_at=self.clock(),
            )
            return t.insert_resources(version)

        return await self._tx(op)

    async def get_resources(self, resources_id: str) -> ResourcesVersion:
        def op(t: Tables, _: list[str]) -> ResourcesVersion:
            version = t.resources(resources_id)
            if version is None:
                raise NotFoundError(f"no resources {resources_id!r} in the store")
            return version

        return await self._tx(op, write=False)

    async def query_resources(
        self, *, descending: bool = False, limit: int = 100, cursor: str | None = None
    ) -> Page[ResourcesVersion]:
        return await self._page(
            Query("resources", {}, ("version",), "resources_id", descending, limit, cursor)
        )

    # ----- workers (``update_worker`` is the core's; the reads are the read model's), watchdog ---
    async def update_worker(
        self, worker_id: str, *, status: WorkerStatus | None = None, host: dict[str, Any] | None = None
    ) -> Worker:
        _logic.checked_json(host, "host")

        def op(t: Tables, _: list[str]) -> Worker:
            worker = self._touch_worker(t, worker_id)
            if status is not None:
                worker.status = WorkerStatus(status)
            if host is not None:
                worker.host = dict(host)
            t.save_worker(worker)
            return worker

        return await self._tx(op)

    async def get_worker(self, worker_id: str) -> Worker:
        def op(t: Tables, _: list[str]) -> Worker:
            worker = t.worker(worker_id)
            if worker is None:
                raise NotFoundError(f"no worker {worker_id!r} in the store")
            return worker

        return await self._tx(op, write=False)

    async def query_workers(
        self, *, status: Sequence[WorkerStatus] | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[Worker]:
        statuses = None if status is None else [WorkerStatus(s) for s in status]
        where = _where(status=statuses)
        return await self._page(Query("workers", where, ("worker_id",), "worker_id", False, limit, cursor))

    async def run_watchdog(self) -> list[Attempt]:
        def op(t: Tables, finished: list[str]) -> list[Attempt]:
            now = self.clock()
            marked = []
            for attempt, rollout in t.live_attempts(overdue_at=now):
                verdict = watchdog_verdict(attempt, rollout.retry, now)
                if verdict is not None:
                    self._move_attempt(
                        t, attempt, verdict, f"marked {verdict.value} by the watchdog", finished
                    )
                    marked.append(attempt)
            return marked

        return await self._tx(op)
