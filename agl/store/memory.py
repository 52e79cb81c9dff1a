"""In-memory LightningStore: dicts behind one lock, for tests and single-process runs.

Concurrency model: every unit of work runs synchronously under a ``threading.Lock`` and never
awaits while holding it, so it is safe across asyncio tasks, event loops and threads.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from agl.schemas import (
    Attempt,
    ResourcesVersion,
    Rollout,
    Span,
    Worker,
    now_s,
)
from agl.store._lifecycle import Query, R, Tables, TableStore, Work
from agl.store.base import (
    SCALAR_KIND,
    Clock,
    InvalidCursorError,
    Kind,
    Page,
    T,
    check_limit,
    decode_cursor,
    encode_cursor,
)
from agl.store.read_model import DigestState, InProcessReadModel, merge_digest, search_text, span_digest
from agl.store.states import watchdog_verdict


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


#: each table's key column: a query naming its keys looks them up instead of scanning the table
_KEYS = {
    "rollouts": "rollout_id",
    "attempts": "attempt_id",
    "resources": "resources_id",
    "workers": "worker_id",
}


def _freeze(value: Any) -> Any:
    """JSON arrays back into the tuples the sort keys are made of."""
    return tuple(_freeze(v) for v in value) if isinstance(value, (list, tuple)) else value


class MemoryTables(Tables):
    """The tables as dicts (the :class:`InProcessRows` the read model reads); reads hand out copies so
    nothing changes until it is saved."""

    def __init__(self) -> None:
        self.order = itertools.count()
        self.rollouts: dict[str, Rollout] = {}
        self.search_texts: dict[str, str] = {}  # what search looks through besides the reply
        self.rollout_pos: dict[str, int] = {}
        self.queue: deque[str] = deque()  # may hold ids no longer queued (cancelled); skipped when claimed
        self.attempts: dict[str, Attempt] = {}
        self.attempt_pos: dict[str, int] = {}
        self.rollout_attempts: dict[str, list[str]] = {}
        self.live: set[str] = set()
        self.spans: dict[str, list[Span]] = {}
        self.span_keys: set[tuple[str, str, str]] = set()
        self.next_seq: dict[str, int] = {}
        self.span_bytes = 0
        self.versions: dict[str, ResourcesVersion] = {}
        self.latest: str | None = None
        self.workers: dict[str, Worker] = {}
        #: (rollout id, attempt id) -> (stamp, digest state), kept as spans arrive
        self.digests: dict[tuple[str, str], tuple[int, DigestState]] = {}
        self.digest_stamps = itertools.count(1)

    def rollout(self, rollout_id: str) -> Rollout | None:
        found = self.rollouts.get(rollout_id)
        return None if found is None else found.model_copy()

    def insert_rollout(self, rollout: Rollout) -> None:
        self.rollout_pos[rollout.rollout_id] = next(self.order)
        self.next_seq[rollout.rollout_id] = 1
        self.search_texts[rollout.rollout_id] = search_text(rollout)
        self.save_rollout(rollout, enqueue=rollout.status.is_queued)

    def save_rollout(self, rollout: Rollout, *, enqueue: bool = False) -> None:
        self.rollouts[rollout.rollout_id] = rollout.model_copy()
        if enqueue:
            self.queue.append(rollout.rollout_id)

    def queue_head(self) -> Rollout | None:
        while self.queue:
            rollout = self.rollouts[self.queue.popleft()]
            if rollout.status.is_queued:
                return rollout.model_copy()
        return None

    def attempt(self, rollout_id: str, attempt_id: str) -> Attempt | None:
        found = self.attempts.get(attempt_id)
        return None if found is None or found.rollout_id != rollout_id else found.model_copy()

    def insert_attempt(self, attempt: Attempt) -> None:
        self.attempt_pos[attempt.attempt_id] = next(self.order)
        self.rollout_attempts.setdefault(attempt.rollout_id, []).append(attempt.attempt_id)
        self.save_attempt(attempt)

    def save_attempt(self, attempt: Attempt) -> None:
        self.attempts[attempt.attempt_id] = attempt.model_copy()
        if attempt.status.is_terminal:
            self.live.discard(attempt.attempt_id)
        else:
            self.live.add(attempt.attempt_id)

    def live_attempts(
        self, rollout_id: str | None = None, *, overdue_at: float | None = None
    ) -> list[tuple[Attempt, Rollout]]:
        ids = (
            self.live
            if rollout_id is None
            else self.live.intersection(self.rollout_attempts.get(rollout_id, []))
        )
        pairs = [(self.attempts[a], self.rollouts[self.attempts[a].rollout_id]) for a in ids]
        if overdue_at is not None:
            pairs = [(a, r) for a, r in pairs if watchdog_verdict(a, r.retry, overdue_at) is not None]
        return [(a.model_copy(), r.model_copy()) for a, r in pairs]

    def worker(self, worker_id: str) -> Worker | None:
        found = self.workers.get(worker_id)
        return None if found is None else found.model_copy()

    def save_worker(self, worker: Worker) -> None:
        self.workers[worker.worker_id] = worker.model_copy()

    def insert_spans(self, spans: list[Span]) -> list[Span]:
        stored: list[Span] = []
        for span in spans:
            key = (span.rollout_id, span.attempt_id, span.span_id)
            if key in self.span_keys:
                continue
            seq = self.next_seq[span.rollout_id]
            if span.sequence_id is None:
                span = span.model_copy(update={"sequence_id": seq})
            self.next_seq[span.rollout_id] = max(seq, span.sequence_id or 0) + 1
            self.span_keys.add(key)
            self.spans.setdefault(span.rollout_id, []).append(span)
            self.span_bytes += len(span.model_dump_json())
            stored.append(span)
            slots = span_digest(span.name, span.attributes)
            if slots:
                attempt = (span.rollout_id, span.attempt_id)
                state = self.digests[attempt][1] if attempt in self.digests else {}
                merge_digest(state, span.sequence_id or 0, slots)
                self.digests[attempt] = (next(self.digest_stamps), state)
        return stored

    def next_sequence_id(self, rollout_id: str) -> int:
        seq = self.next_seq[rollout_id]
        self.next_seq[rollout_id] = seq + 1
        return seq

    def resources(self, resources_id: str | None) -> ResourcesVersion | None:
        key = self.latest if resources_id is None else resources_id
        return None if key is None else self.versions.get(key)

    def insert_resources(self, version: ResourcesVersion) -> ResourcesVersion:
        version = version.model_copy(update={"version": len(self.versions) + 1})
        self.versions[version.resources_id] = version
        self.latest = version.resources_id
        return version

    def page(self, query: Query) -> Page[Any]:
        items: list[Any]
        if query.table == "spans":
            rids = query.where.get("rollout_id")
            pools = [self.spans.get(r, []) for r in rids] if rids is not None else self.spans.values()
            items = [s for pool in pools for s in pool]
            if query.latest_attempt:
                last = {rid: attempts[-1] for rid, attempts in self.rollout_attempts.items()}
                items = [s for s in items if last.get(s.rollout_id) == s.attempt_id]
        else:
            tables: dict[str, dict[str, Any]] = {
                "rollouts": self.rollouts,
                "attempts": self.attempts,
                "resources": self.versions,
                "workers": self.workers,
            }
            table = tables[query.table]
            ids = query.where.get(_KEYS[query.table])
            items = (
                list(table.values()) if ids is None else [table[i] for i in dict.fromkeys(ids) if i in table]
            )
        for column, values in query.where.items():
            accepted = set(values)
            items = [i for i in items if getattr(i, column) in accepted]
        pos = self.rollout_pos if query.table == "rollouts" else self.attempt_pos

        def key(item: Any) -> tuple[Any, Any]:
            tie = getattr(item, query.tiebreak)
            sort = tuple(pos[tie] if c == "pos" else getattr(item, c) for c in query.order)
            return (sort if len(sort) > 1 else sort[0]), tie

        if query.table == "spans":
            return _paginate(items, key, query.limit, query.cursor, sort=[str, int])
        page = _paginate(items, key, query.limit, query.cursor, query.descending)
        return Page(items=[i.model_copy() for i in page.items], next_cursor=page.next_cursor)


class InMemoryLightningStore(InProcessReadModel, TableStore):
    """A LightningStore that lives in this process's memory and is lost when it exits."""

    _t: MemoryTables

    def __init__(self, *, clock: Clock = now_s, watchdog_interval_s: float = 1.0) -> None:
        super().__init__(clock=clock, watchdog_interval_s=watchdog_interval_s)
        self._lock = threading.Lock()
        self._t = MemoryTables()

    async def _tx(self, fn: Work[R], *, write: bool = True) -> R:
        finished: list[str] = []
        with self._lock:
            result = fn(self._t, finished)
        self._waiters.notify(finished)
        return result
