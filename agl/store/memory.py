"""In-memory LightningStore: dicts behind one lock, for tests and single-process runs.

Concurrency model: every method does its work synchronously under a ``threading.Lock`` and never
awaits while holding it, so it is safe across asyncio tasks, event loops and threads.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

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
    now_s,
)
from agl.store import _logic
from agl.store.base import (
    SCALAR_KIND,
    Clock,
    InvalidCursorError,
    Kind,
    LightningStore,
    Page,
    RolloutOrder,
    StoreStatistics,
    T,
    check_limit,
    decode_cursor,
    encode_cursor,
)
from agl.store.states import rollout_status_for_attempt, transition, watchdog_verdict


def _paginate(
    items: list[T],
    key: Callable[[T], tuple[Any, Any]],
    limit: int,
    cursor: str | None,
    descending: bool = False,
    sort: Kind | list[Kind] = SCALAR_KIND,
) -> Page[T]:
    """Keyset pagination over an in-memory list: sort, skip past the cursor, cut a page."""
    check_limit(limit)
    items = sorted(items, key=key, reverse=descending)
    if cursor is not None:
        after = _freeze(decode_cursor(cursor, sort=sort))
        keys = [key(i) for i in items]
        try:
            if descending:
                start = next((n for n, k in enumerate(keys) if k < after), len(items))
            else:
                start = bisect.bisect_right(keys, after)
        except TypeError as exc:  # a cursor of another query: its key does not compare with these
            raise InvalidCursorError(cursor) from exc
        items = items[start:]
    page = items[:limit]
    next_cursor = encode_cursor(*key(page[-1])) if len(items) > limit else None
    return Page(items=page, next_cursor=next_cursor)


def _freeze(value: Any) -> Any:
    """JSON arrays back into the tuples the sort keys are made of."""
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


class InMemoryLightningStore(LightningStore):
    """A LightningStore that lives in this process's memory and is lost when it exits."""

    def __init__(self, *, clock: Clock = now_s, watchdog_interval_s: float = 1.0) -> None:
        super().__init__(clock=clock, watchdog_interval_s=watchdog_interval_s)
        self._lock = threading.Lock()
        self._order = itertools.count()
        self._rollouts: dict[str, Rollout] = {}
        self._rollout_pos: dict[str, int] = {}
        self._queue: deque[str] = deque()
        self._attempts: dict[str, Attempt] = {}
        self._attempt_pos: dict[str, int] = {}
        self._rollout_attempts: dict[str, list[str]] = {}
        self._live_attempts: set[str] = set()
        self._spans: dict[str, list[Span]] = {}
        self._span_keys: set[tuple[str, str, str]] = set()
        self._next_seq: dict[str, int] = {}
        self._span_bytes = 0
        self._resources: dict[str, ResourcesVersion] = {}
        self._latest_resources: str | None = None
        self._workers: dict[str, Worker] = {}

    # ----- helpers (call with the lock held) ------------------------------------------------
    def _rollout(self, rollout_id: str) -> Rollout:
        try:
            return self._rollouts[rollout_id]
        except KeyError:
            raise NotFoundError(f"no rollout {rollout_id!r} in the store", rollout_id=rollout_id) from None

    def _attempt(self, rollout_id: str, attempt_id: str) -> Attempt:
        attempt = self._attempts.get(attempt_id)
        if attempt is None or attempt.rollout_id != rollout_id:
            self._rollout(rollout_id)
            raise NotFoundError(
                f"rollout {rollout_id} has no attempt {attempt_id!r}",
                rollout_id=rollout_id,
                attempt_id=attempt_id,
            )
        return attempt

    def _set_rollout_status(self, rollout: Rollout, status: RolloutStatus, now: float) -> list[str]:
        """Apply a checked rollout transition; returns ids that just finished (for waiters)."""
        if rollout.status == status:
            return []
        transition(rollout.status, status, rollout_id=rollout.rollout_id)
        rollout.status = status
        rollout.updated_at = now
        if status == RolloutStatus.RUNNING and rollout.started_at is None:
            rollout.started_at = now
        if status == RolloutStatus.REQUEUING:
            self._queue.append(rollout.rollout_id)
        if status.is_terminal:
            rollout.ended_at = now
            for attempt_id in self._rollout_attempts.get(rollout.rollout_id, []):
                attempt = self._attempts[attempt_id]
                if not attempt.status.is_terminal:  # cancelling a live attempt ends it
                    self._finish_attempt(attempt, AttemptStatus.FAILED, now, error="rollout cancelled")
            return [rollout.rollout_id]
        return []

    def _finish_attempt(
        self, attempt: Attempt, status: AttemptStatus, now: float, error: str | None = None
    ) -> None:
        attempt.status = status
        attempt.ended_at = now
        if error is not None:
            attempt.error = error
        self._live_attempts.discard(attempt.attempt_id)
        worker = self._workers.get(attempt.worker_id or "")
        if worker is not None and worker.current_attempt_id == attempt.attempt_id:
            worker.status = WorkerStatus.IDLE
            worker.current_attempt_id = worker.current_rollout_id = None

    def _move_attempt(
        self, attempt: Attempt, status: AttemptStatus, now: float, error: str | None
    ) -> list[str]:
        rollout = self._rollouts[attempt.rollout_id]
        transition(attempt.status, status, rollout_id=attempt.rollout_id, attempt_id=attempt.attempt_id)
        if status.is_terminal:
            self._finish_attempt(attempt, status, now, error)
        else:
            attempt.status = status
        target = rollout_status_for_attempt(status, attempt.attempt_number, rollout.retry)
        return self._set_rollout_status(rollout, target, now)

    def _create_attempt(self, rollout: Rollout, worker_id: str | None, now: float) -> AttemptedRollout:
        attempt = _logic.new_attempt(rollout, worker_id, now)
        rollout.num_attempts = attempt.attempt_number
        self._attempts[attempt.attempt_id] = attempt
        self._attempt_pos[attempt.attempt_id] = next(self._order)
        self._rollout_attempts.setdefault(rollout.rollout_id, []).append(attempt.attempt_id)
        self._live_attempts.add(attempt.attempt_id)
        if worker_id is not None:
            worker = self._workers.get(worker_id) or Worker(worker_id=worker_id)
            worker.status = WorkerStatus.BUSY
            worker.current_rollout_id, worker.current_attempt_id = rollout.rollout_id, attempt.attempt_id
            worker.last_heartbeat_at = now
            self._workers[worker_id] = worker
        return AttemptedRollout(rollout=rollout.model_copy(), attempt=attempt.model_copy())

    def _check_resources(self, resources_id: str | None) -> str | None:
        if resources_id is None:
            return self._latest_resources
        if resources_id not in self._resources:
            raise NotFoundError(f"no resources {resources_id!r} in the store; add them before enqueueing")
        return resources_id

    def _insert_rollout(self, req: RolloutCreate, now: float, status: RolloutStatus) -> Rollout:
        if req.rollout_id is not None and req.rollout_id in self._rollouts:
            return _logic.check_same_request(self._rollouts[req.rollout_id], req)
        rollout = _logic.new_rollout(req, self._check_resources(req.resources_id), now, status)
        self._rollouts[rollout.rollout_id] = rollout
        self._rollout_pos[rollout.rollout_id] = next(self._order)
        self._next_seq[rollout.rollout_id] = 1
        if status == RolloutStatus.QUEUING:
            self._queue.append(rollout.rollout_id)
        return rollout

    # ----- rollouts -------------------------------------------------------------------------
    async def enqueue_rollouts(self, requests: Sequence[RolloutCreate]) -> list[Rollout]:
        reqs = _logic.coerce_rollout_creates(requests)
        with self._lock:
            now = self.clock()
            for req in reqs:  # validate the whole batch before writing any of it
                self._check_resources(req.resources_id)
            return [self._insert_rollout(r, now, RolloutStatus.QUEUING).model_copy() for r in reqs]

    async def dequeue(self, worker_id: str) -> AttemptedRollout | None:
        self._ensure_watchdog()
        with self._lock:
            now = self.clock()
            worker = self._workers.setdefault(worker_id, Worker(worker_id=worker_id))
            worker.last_heartbeat_at = now
            while self._queue:
                rollout = self._rollouts[self._queue.popleft()]
                if rollout.status.is_queued:  # skip entries cancelled while queued
                    self._set_rollout_status(rollout, RolloutStatus.PREPARING, now)
                    return self._create_attempt(rollout, worker_id, now)
            return None

    async def start_rollout(self, request: RolloutCreate, worker_id: str | None = None) -> AttemptedRollout:
        self._ensure_watchdog()
        (req,) = _logic.coerce_rollout_creates([request])
        with self._lock:
            now = self.clock()
            if req.rollout_id is not None and req.rollout_id in self._rollouts:
                raise ConflictError(f"rollout {req.rollout_id} already exists", rollout_id=req.rollout_id)
            rollout = self._insert_rollout(req, now, RolloutStatus.PREPARING)
            return self._create_attempt(rollout, worker_id, now)

    async def get_rollout(self, rollout_id: str) -> Rollout:
        with self._lock:
            return self._rollout(rollout_id).model_copy()

    async def update_rollout(
        self, rollout_id: str, *, status: RolloutStatus | None = None, metadata: dict[str, Any] | None = None
    ) -> Rollout:
        _logic.checked_json(metadata, "metadata")
        with self._lock:
            rollout = self._rollout(rollout_id)
            now = self.clock()
            finished: list[str] = []
            if status is not None:
                finished = self._set_rollout_status(rollout, RolloutStatus(status), now)
            if metadata:
                rollout.metadata = {**rollout.metadata, **metadata}
                rollout.updated_at = now
            result = rollout.model_copy()
        self._waiters.notify(finished)
        return result

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
        statuses = None if status is None else {RolloutStatus(s) for s in status}
        wanted = None if rollout_ids is None else set(rollout_ids)
        with self._lock:
            items = [
                r.model_copy()
                for r in self._rollouts.values()
                if (statuses is None or r.status in statuses)
                and (mode is None or r.mode == mode)
                and (group_id is None or r.group_id == group_id)
                and (wanted is None or r.rollout_id in wanted)
            ]
            pos = dict(self._rollout_pos)
        keys: dict[str, Callable[[Rollout], tuple[Any, Any]]] = {
            "created_at": lambda r: (pos[r.rollout_id], r.rollout_id),
            "updated_at": lambda r: (r.updated_at, r.rollout_id),
            "rollout_id": lambda r: (r.rollout_id, r.rollout_id),
        }
        return _paginate(items, keys[order_by], limit, cursor, descending)

    async def _finished(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        with self._lock:
            rollouts = [self._rollout(i) for i in rollout_ids]
            return [r.model_copy() for r in rollouts if r.status.is_terminal]

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
        finished: list[str] = []
        with self._lock:
            attempt = self._attempt(rollout_id, attempt_id)
            now = self.clock()
            if status is not None:
                status = AttemptStatus(status)
                if attempt.status.is_terminal and status != attempt.status:
                    raise StaleAttemptError(
                        f"attempt {attempt_id} of rollout {rollout_id} is already {attempt.status.value}; "
                        f"its update to {status.value} was ignored",
                        rollout_id=rollout_id,
                        attempt_id=attempt_id,
                    )
                if status != attempt.status:
                    finished = self._move_attempt(attempt, status, now, error)
            if error is not None:
                attempt.error = error
            if metadata:
                attempt.metadata = {**attempt.metadata, **metadata}
            result = attempt.model_copy()
        self._waiters.notify(finished)
        return result

    async def heartbeat(self, rollout_id: str, attempt_id: str) -> Rollout:
        with self._lock:
            attempt = self._attempt(rollout_id, attempt_id)
            if attempt.status.is_terminal:
                raise StaleAttemptError(
                    f"attempt {attempt_id} of rollout {rollout_id} is already {attempt.status.value}; stop working on it",
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                )
            now = self.clock()
            attempt.last_heartbeat_at = now
            worker = self._workers.get(attempt.worker_id or "")
            if worker is not None:
                worker.last_heartbeat_at = now
            return self._rollouts[rollout_id].model_copy()

    async def query_attempts(
        self,
        *,
        rollout_id: str | None = None,
        status: Sequence[AttemptStatus] | None = None,
        worker_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Attempt]:
        statuses = None if status is None else {AttemptStatus(s) for s in status}
        with self._lock:
            if rollout_id is not None:
                self._rollout(rollout_id)
                pool = [self._attempts[a] for a in self._rollout_attempts.get(rollout_id, [])]
            else:
                pool = list(self._attempts.values())
            items = [
                a.model_copy()
                for a in pool
                if (statuses is None or a.status in statuses)
                and (worker_id is None or a.worker_id == worker_id)
            ]
            pos = dict(self._attempt_pos)
        return _paginate(items, lambda a: (pos[a.attempt_id], a.attempt_id), limit, cursor)

    # ----- spans ----------------------------------------------------------------------------
    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        batch = _logic.coerce_spans(spans)
        stored: list[Span] = []
        with self._lock:
            for span in batch:  # validate references before writing anything
                self._attempt(span.rollout_id, span.attempt_id)
            now = self.clock()
            for span in batch:
                key = (span.rollout_id, span.attempt_id, span.span_id)
                if key in self._span_keys:
                    continue
                seq = self._next_seq[span.rollout_id]
                if span.sequence_id is None:
                    span = span.model_copy(update={"sequence_id": seq})
                self._next_seq[span.rollout_id] = max(seq, span.sequence_id or 0) + 1
                self._span_keys.add(key)
                self._spans.setdefault(span.rollout_id, []).append(span)
                self._span_bytes += len(span.model_dump_json())
                stored.append(span)
                attempt = self._attempts[span.attempt_id]
                if not attempt.status.is_terminal:
                    attempt.last_heartbeat_at = now
                    if attempt.status == AttemptStatus.PREPARING:
                        self._move_attempt(attempt, AttemptStatus.RUNNING, now, None)
        return stored

    async def next_sequence_id(self, rollout_id: str) -> int:
        with self._lock:
            self._rollout(rollout_id)
            seq = self._next_seq[rollout_id]
            self._next_seq[rollout_id] = seq + 1
            return seq

    async def query_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        name: str | None = None,
        limit: int = 1000,
        cursor: str | None = None,
    ) -> Page[Span]:
        with self._lock:
            if rollout_id is not None:
                self._rollout(rollout_id)
                pools = {rollout_id: self._spans.get(rollout_id, [])}
            else:
                pools = self._spans
            items: list[Span] = []
            for rid, pool in pools.items():
                wanted = attempt_id
                if attempt_id == "latest":
                    attempts = self._rollout_attempts.get(rid)
                    wanted = attempts[-1] if attempts else None
                items.extend(
                    s
                    for s in pool
                    if (wanted is None or s.attempt_id == wanted) and (name is None or s.name == name)
                )
        return _paginate(
            items, lambda s: ((s.rollout_id, s.sequence_id), s.span_id), limit, cursor, sort=[str, int]
        )

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
        with self._lock:
            if resources_id is not None and resources_id in self._resources:
                existing = self._resources[resources_id]
                if named != existing.resources:
                    raise ConflictError(
                        f"resources {resources_id} already exist with other content; versions are immutable, "
                        "use update_resources to derive a new one"
                    )
                return existing
            if parent_id is not None and parent_id not in self._resources:
                raise NotFoundError(f"parent resources {parent_id!r} are not in the store")
            version = ResourcesVersion.model_validate(
                {
                    "resources_id": resources_id or new_id("rs"),
                    "version": len(self._resources) + 1,
                    "resources": named,
                    "parent_id": parent_id,
                    "metadata": metadata or {},
                    "created_at": self.clock(),
                }
            )
            self._resources[version.resources_id] = version
            self._latest_resources = version.resources_id
            return version

    async def get_resources(self, resources_id: str) -> ResourcesVersion:
        with self._lock:
            try:
                return self._resources[resources_id]
            except KeyError:
                raise NotFoundError(f"no resources {resources_id!r} in the store") from None

    async def get_latest_resources(self) -> ResourcesVersion | None:
        with self._lock:
            return None if self._latest_resources is None else self._resources[self._latest_resources]

    async def query_resources(self, *, limit: int = 100, cursor: str | None = None) -> Page[ResourcesVersion]:
        with self._lock:
            items = list(self._resources.values())
        return _paginate(items, lambda v: (v.version, v.resources_id), limit, cursor)

    # ----- workers, statistics, watchdog ----------------------------------------------------
    async def update_worker(
        self, worker_id: str, *, status: WorkerStatus | None = None, host: dict[str, Any] | None = None
    ) -> Worker:
        _logic.checked_json(host, "host")
        with self._lock:
            worker = self._workers.setdefault(worker_id, Worker(worker_id=worker_id))
            worker.last_heartbeat_at = self.clock()
            if status is not None:
                worker.status = WorkerStatus(status)
            if host is not None:
                worker.host = dict(host)
            return worker.model_copy()

    async def get_worker(self, worker_id: str) -> Worker:
        with self._lock:
            try:
                return self._workers[worker_id].model_copy()
            except KeyError:
                raise NotFoundError(f"no worker {worker_id!r} in the store") from None

    async def query_workers(
        self, *, status: Sequence[WorkerStatus] | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[Worker]:
        statuses = None if status is None else {WorkerStatus(s) for s in status}
        with self._lock:
            items = [
                w.model_copy() for w in self._workers.values() if statuses is None or w.status in statuses
            ]
        return _paginate(items, lambda w: (w.worker_id, w.worker_id), limit, cursor)

    async def statistics(self) -> StoreStatistics:
        with self._lock:
            rollouts: dict[str, int] = {}
            for r in self._rollouts.values():
                rollouts[r.status.value] = rollouts.get(r.status.value, 0) + 1
            attempts: dict[str, int] = {}
            for a in self._attempts.values():
                attempts[a.status.value] = attempts.get(a.status.value, 0) + 1
            return StoreStatistics(
                rollouts_by_status=rollouts,
                attempts_by_status=attempts,
                spans=len(self._span_keys),
                span_bytes=self._span_bytes,
                resources=len(self._resources),
                workers=len(self._workers),
            )

    async def run_watchdog(self) -> list[Attempt]:
        marked: list[Attempt] = []
        finished: list[str] = []
        with self._lock:
            now = self.clock()
            for attempt_id in list(self._live_attempts):
                attempt = self._attempts[attempt_id]
                verdict = watchdog_verdict(attempt, self._rollouts[attempt.rollout_id].retry, now)
                if verdict is not None:
                    finished += self._move_attempt(
                        attempt, verdict, now, f"marked {verdict.value} by the watchdog"
                    )
                    marked.append(attempt.model_copy())
        self._waiters.notify(finished)
        return marked
