"""SQLite LightningStore: the embedded, durable default.

Concurrency model: one connection per store instance, owned by one database thread that runs
queued calls in shared transactions (group commit; see ``_sqlite_thread``). Writers take the database lock with ``BEGIN IMMEDIATE``, so several processes may open the same
file: a claim (dequeue) is a read-modify-write inside one locked transaction and is never doubled.
WAL mode keeps readers off the writers' backs; a committed transaction survives a process crash.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

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
from agl.store._sqlite_schema import SCHEMA
from agl.store._sqlite_thread import GroupCommitThread
from agl.store.base import (
    Clock,
    Kind,
    LightningStore,
    Page,
    RolloutOrder,
    StoreStatistics,
    check_limit,
    decode_cursor,
    encode_cursor,
)
from agl.store.states import rollout_status_for_attempt, transition, watchdog_verdict

log = logging.getLogger(__name__)
R = TypeVar("R")
Conn = sqlite3.Connection


def _where_in(where: list[str], args: list[Any], column: str, values: list[Any]) -> None:
    """Add ``column IN (...)``; an empty list matches nothing (valid SQL in SQLite and PostgreSQL)."""
    where.append(f"{column} IN ({','.join('?' * len(values))})" if values else "1=0")
    args += values


# what a cursor's sort key must be for each sort column (PostgreSQL refuses to compare across types)
_SORT_KINDS: dict[str, Kind] = {
    "pos": int,
    "version": int,
    "created_at": (int, float),
    "updated_at": (int, float),
}


class SqliteLightningStore(LightningStore):
    """A LightningStore in one SQLite file (``":memory:"`` for a private, non-durable one).

    Args:
        path: the database file; created with its schema when missing.
        synchronous: SQLite's ``synchronous`` pragma; ``NORMAL`` survives process crashes, ``FULL``
            also power loss.
    """

    cross_process_poll_s: float | None = 0.5

    def __init__(
        self,
        path: str | Path,
        *,
        clock: Clock = now_s,
        watchdog_interval_s: float = 1.0,
        synchronous: str = "NORMAL",
        busy_timeout_s: float = 60.0,
    ) -> None:
        super().__init__(clock=clock, watchdog_interval_s=watchdog_interval_s)
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(
            self.path, check_same_thread=False, isolation_level=None, timeout=busy_timeout_s
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("PRAGMA foreign_keys=ON")
        with contextlib.suppress(sqlite3.OperationalError):  # another process created it first
            conn.executescript(SCHEMA)
        self._db = GroupCommitThread(conn, f"agl-sqlite-{Path(self.path).name}", self._waiters.notify)

    #: appended to the dequeue SELECT; PostgreSQL sets ``FOR UPDATE SKIP LOCKED``
    _claim_lock = ""

    async def _call(self, fn: Callable[[Conn, list[str]], R], *, write: bool = True) -> R:
        return await self._db.call(fn, write=write)

    async def aclose(self) -> None:
        await super().aclose()
        await self._db.close()

    # ----- row helpers (database thread only) -----------------------------------------------
    @staticmethod
    def _load_rollout(conn: Conn, rollout_id: str) -> Rollout:
        row = conn.execute("SELECT data FROM rollouts WHERE rollout_id=?", (rollout_id,)).fetchone()
        if row is None:
            raise NotFoundError(f"no rollout {rollout_id!r} in the store", rollout_id=rollout_id)
        return Rollout.model_validate_json(row[0])

    @staticmethod
    def _load_attempt(conn: Conn, rollout_id: str, attempt_id: str) -> Attempt:
        row = conn.execute(
            "SELECT data FROM attempts WHERE attempt_id=? AND rollout_id=?", (attempt_id, rollout_id)
        )
        found = row.fetchone()
        if found is None:
            SqliteLightningStore._load_rollout(conn, rollout_id)
            raise NotFoundError(
                f"rollout {rollout_id} has no attempt {attempt_id!r}",
                rollout_id=rollout_id,
                attempt_id=attempt_id,
            )
        return Attempt.model_validate_json(found[0])

    @staticmethod
    def _next_counter(conn: Conn, name: str) -> int:
        conn.execute("UPDATE counters SET value=value+1 WHERE name=?", (name,))
        return int(conn.execute("SELECT value FROM counters WHERE name=?", (name,)).fetchone()[0])

    def _save_rollout(self, conn: Conn, rollout: Rollout, *, enqueue: bool = False) -> None:
        """Write the rollout back; ``enqueue`` puts it at the queue's tail, a non-queued status takes it out."""
        queue = ""
        args: tuple[Any, ...] = ()
        if enqueue:
            queue, args = ", queue_pos=?", (self._next_counter(conn, "queue"),)
        elif not rollout.status.is_queued:
            queue = ", queue_pos=NULL"
        conn.execute(
            f"UPDATE rollouts SET status=?, updated_at=?, data=?{queue} WHERE rollout_id=?",
            (rollout.status.value, rollout.updated_at, rollout.model_dump_json(), *args, rollout.rollout_id),
        )

    @staticmethod
    def _save_attempt(conn: Conn, attempt: Attempt) -> None:
        conn.execute(
            "UPDATE attempts SET status=?, live=?, data=? WHERE attempt_id=?",
            (
                attempt.status.value,
                int(not attempt.status.is_terminal),
                attempt.model_dump_json(),
                attempt.attempt_id,
            ),
        )

    def _set_rollout_status(
        self, conn: Conn, rollout: Rollout, status: RolloutStatus, finished: list[str]
    ) -> None:
        if rollout.status == status:
            return
        now = self.clock()
        transition(rollout.status, status, rollout_id=rollout.rollout_id)
        rollout.status = status
        rollout.updated_at = now
        if status == RolloutStatus.RUNNING and rollout.started_at is None:
            rollout.started_at = now
        if status.is_terminal:
            rollout.ended_at = now
            finished.append(rollout.rollout_id)
            live = conn.execute(
                "SELECT data FROM attempts WHERE rollout_id=? AND live=1", (rollout.rollout_id,)
            )
            for (data,) in live.fetchall():  # cancelling a live attempt ends it
                self._finish_attempt(
                    conn, Attempt.model_validate_json(data), AttemptStatus.FAILED, "rollout cancelled"
                )
        self._save_rollout(conn, rollout, enqueue=status == RolloutStatus.REQUEUING)

    def _finish_attempt(self, conn: Conn, attempt: Attempt, status: AttemptStatus, error: str | None) -> None:
        attempt.status = status
        attempt.ended_at = self.clock()
        if error is not None:
            attempt.error = error
        self._save_attempt(conn, attempt)
        if attempt.worker_id is not None:
            conn.execute(
                "UPDATE workers SET status='idle', current_rollout_id=NULL, current_attempt_id=NULL "
                "WHERE worker_id=? AND current_attempt_id=?",
                (attempt.worker_id, attempt.attempt_id),
            )

    def _move_attempt(
        self, conn: Conn, attempt: Attempt, status: AttemptStatus, error: str | None, finished: list[str]
    ) -> None:
        rollout = self._load_rollout(conn, attempt.rollout_id)
        transition(attempt.status, status, rollout_id=attempt.rollout_id, attempt_id=attempt.attempt_id)
        if status.is_terminal:
            self._finish_attempt(conn, attempt, status, error)
        else:
            attempt.status = status
            self._save_attempt(conn, attempt)
        target = rollout_status_for_attempt(status, attempt.attempt_number, rollout.retry)
        self._set_rollout_status(conn, rollout, target, finished)

    def _create_attempt(self, conn: Conn, rollout: Rollout, worker_id: str | None) -> AttemptedRollout:
        now = self.clock()
        attempt = _logic.new_attempt(rollout, worker_id, now)
        rollout.num_attempts = attempt.attempt_number
        conn.execute(
            "INSERT INTO attempts (attempt_id, rollout_id, status, worker_id, live, data) VALUES (?,?,?,?,1,?)",
            (
                attempt.attempt_id,
                rollout.rollout_id,
                attempt.status.value,
                worker_id,
                attempt.model_dump_json(),
            ),
        )
        self._save_rollout(conn, rollout)
        if worker_id is not None:
            self._touch_worker(conn, worker_id, now)
            conn.execute(
                "UPDATE workers SET status='busy', current_rollout_id=?, current_attempt_id=? WHERE worker_id=?",
                (rollout.rollout_id, attempt.attempt_id, worker_id),
            )
        return AttemptedRollout(rollout=rollout, attempt=attempt)

    @staticmethod
    def _touch_worker(conn: Conn, worker_id: str, now: float) -> None:
        conn.execute(
            "INSERT INTO workers (worker_id, status, last_heartbeat_at) VALUES (?, 'idle', ?) "
            "ON CONFLICT(worker_id) DO UPDATE SET last_heartbeat_at=excluded.last_heartbeat_at",
            (worker_id, now),
        )

    def _resolve_resources(self, conn: Conn, resources_id: str | None) -> str | None:
        if resources_id is None:
            row = conn.execute("SELECT resources_id FROM resources ORDER BY version DESC LIMIT 1").fetchone()
            return None if row is None else str(row[0])
        if conn.execute("SELECT 1 FROM resources WHERE resources_id=?", (resources_id,)).fetchone() is None:
            raise NotFoundError(f"no resources {resources_id!r} in the store; add them before enqueueing")
        return resources_id

    def _insert_rollout(self, conn: Conn, req: RolloutCreate, status: RolloutStatus) -> Rollout:
        if req.rollout_id is not None:
            row = conn.execute("SELECT data FROM rollouts WHERE rollout_id=?", (req.rollout_id,)).fetchone()
            if row is not None:
                return _logic.check_same_request(Rollout.model_validate_json(row[0]), req)
        rollout = _logic.new_rollout(
            req, self._resolve_resources(conn, req.resources_id), self.clock(), status
        )
        queued = status == RolloutStatus.QUEUING
        conn.execute(
            "INSERT INTO rollouts (rollout_id, status, mode, group_id, updated_at, queue_pos, data) "
            "VALUES (?,?,?,?,?,?,?)",
            (
                rollout.rollout_id,
                rollout.status.value,
                rollout.mode,
                rollout.group_id,
                rollout.updated_at,
                self._next_counter(conn, "queue") if queued else None,
                rollout.model_dump_json(),
            ),
        )
        return rollout

    # ----- rollouts -------------------------------------------------------------------------
    async def enqueue_rollouts(self, requests: Sequence[RolloutCreate]) -> list[Rollout]:
        reqs = _logic.coerce_rollout_creates(requests)

        def op(conn: Conn, finished: list[str]) -> list[Rollout]:
            return [self._insert_rollout(conn, r, RolloutStatus.QUEUING) for r in reqs]

        return await self._call(op)

    async def dequeue(self, worker_id: str) -> AttemptedRollout | None:
        self._ensure_watchdog()

        def op(conn: Conn, finished: list[str]) -> AttemptedRollout | None:
            self._touch_worker(conn, worker_id, self.clock())
            row = conn.execute(
                "SELECT data FROM rollouts WHERE queue_pos IS NOT NULL ORDER BY queue_pos LIMIT 1"
                + self._claim_lock
            ).fetchone()
            if row is None:
                return None
            rollout = Rollout.model_validate_json(row[0])
            self._set_rollout_status(conn, rollout, RolloutStatus.PREPARING, finished)
            return self._create_attempt(conn, rollout, worker_id)

        return await self._call(op)

    async def start_rollout(self, request: RolloutCreate, worker_id: str | None = None) -> AttemptedRollout:
        self._ensure_watchdog()
        (req,) = _logic.coerce_rollout_creates([request])

        def op(conn: Conn, finished: list[str]) -> AttemptedRollout:
            exists = "SELECT 1 FROM rollouts WHERE rollout_id=?"
            if req.rollout_id is not None and conn.execute(exists, (req.rollout_id,)).fetchone():
                raise ConflictError(f"rollout {req.rollout_id} already exists", rollout_id=req.rollout_id)
            return self._create_attempt(
                conn, self._insert_rollout(conn, req, RolloutStatus.PREPARING), worker_id
            )

        return await self._call(op)

    async def get_rollout(self, rollout_id: str) -> Rollout:
        return await self._call(lambda conn, _: self._load_rollout(conn, rollout_id), write=False)

    async def update_rollout(
        self, rollout_id: str, *, status: RolloutStatus | None = None, metadata: dict[str, Any] | None = None
    ) -> Rollout:
        _logic.checked_json(metadata, "metadata")

        def op(conn: Conn, finished: list[str]) -> Rollout:
            rollout = self._load_rollout(conn, rollout_id)
            if status is not None:
                self._set_rollout_status(conn, rollout, RolloutStatus(status), finished)
            if metadata:
                rollout.metadata = {**rollout.metadata, **metadata}
                rollout.updated_at = self.clock()
                self._save_rollout(conn, rollout)
            return rollout

        return await self._call(op)

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
        where: list[str] = []
        args: list[Any] = []
        if status is not None:
            _where_in(where, args, "status", [RolloutStatus(s).value for s in status])
        if mode is not None:
            where.append("mode=?")
            args.append(mode)
        if group_id is not None:
            where.append("group_id=?")
            args.append(group_id)
        if rollout_ids is not None:
            _where_in(where, args, "rollout_id", list(rollout_ids))
        column = {"created_at": "pos", "updated_at": "updated_at", "rollout_id": "rollout_id"}[order_by]
        return await self._page(
            "rollouts",
            column,
            "rollout_id",
            where,
            args,
            descending,
            limit,
            cursor,
            Rollout.model_validate_json,
        )

    async def _page(
        self,
        table: str,
        column: str,
        tiebreak: str,
        where: list[str],
        args: list[Any],
        descending: bool,
        limit: int,
        cursor: str | None,
        parse: Callable[[Any], R],
    ) -> Page[R]:
        """Keyset pagination: rows strictly after the cursor's (sort key, id), one extra to see if more."""
        check_limit(limit)
        where, args = list(where), list(args)
        if cursor is not None:
            key, tie = decode_cursor(cursor, sort=_SORT_KINDS.get(column, str))
            where.append(f"({column}, {tiebreak}) {'<' if descending else '>'} (?, ?)")
            args += [key, tie]
        direction = "DESC" if descending else "ASC"
        sql = f"SELECT {column}, {tiebreak}, data FROM {table}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY {column} {direction}, {tiebreak} {direction} LIMIT ?"
        rows = await self._call(lambda conn, _: conn.execute(sql, (*args, limit + 1)).fetchall(), write=False)
        items = [parse(r[2]) for r in rows[:limit]]
        next_cursor = encode_cursor(rows[limit - 1][0], rows[limit - 1][1]) if len(rows) > limit else None
        return Page(items=items, next_cursor=next_cursor)

    async def _finished(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        def op(conn: Conn, _: list[str]) -> list[Rollout]:
            out = []
            for rollout_id in rollout_ids:
                row = conn.execute(
                    "SELECT status, data FROM rollouts WHERE rollout_id=?", (rollout_id,)
                ).fetchone()
                if row is None:
                    raise NotFoundError(f"no rollout {rollout_id!r} in the store", rollout_id=rollout_id)
                if RolloutStatus(row[0]).is_terminal:
                    out.append(Rollout.model_validate_json(row[1]))
            return out

        return await self._call(op, write=False)

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

        def op(conn: Conn, finished: list[str]) -> Attempt:
            attempt = self._load_attempt(conn, rollout_id, attempt_id)
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
                    self._move_attempt(conn, attempt, target, error, finished)
            if error is not None:
                attempt.error = error
            if metadata:
                attempt.metadata = {**attempt.metadata, **metadata}
            if error is not None or metadata:
                self._save_attempt(conn, attempt)
            return attempt

        return await self._call(op)

    async def heartbeat(self, rollout_id: str, attempt_id: str) -> Rollout:
        def op(conn: Conn, _: list[str]) -> Rollout:
            attempt = self._load_attempt(conn, rollout_id, attempt_id)
            if attempt.status.is_terminal:
                raise StaleAttemptError(
                    f"attempt {attempt_id} of rollout {rollout_id} is already {attempt.status.value}; stop working on it",
                    rollout_id=rollout_id,
                    attempt_id=attempt_id,
                )
            now = self.clock()
            attempt.last_heartbeat_at = now
            self._save_attempt(conn, attempt)
            if attempt.worker_id is not None:
                conn.execute(
                    "UPDATE workers SET last_heartbeat_at=? WHERE worker_id=?", (now, attempt.worker_id)
                )
            return self._load_rollout(conn, rollout_id)

        return await self._call(op)

    async def query_attempts(
        self,
        *,
        rollout_id: str | None = None,
        status: Sequence[AttemptStatus] | None = None,
        worker_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Attempt]:
        where, args = [], []
        if rollout_id is not None:
            await self.get_rollout(rollout_id)
            where.append("rollout_id=?")
            args.append(rollout_id)
        if status is not None:
            _where_in(where, args, "status", [AttemptStatus(s).value for s in status])
        if worker_id is not None:
            where.append("worker_id=?")
            args.append(worker_id)
        return await self._page(
            "attempts", "pos", "attempt_id", where, args, False, limit, cursor, Attempt.model_validate_json
        )

    # ----- spans ----------------------------------------------------------------------------
    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        batch = _logic.coerce_spans(spans)

        def op(conn: Conn, finished: list[str]) -> list[Span]:
            attempts: dict[tuple[str, str], Attempt] = {}
            for span in batch:  # validate references before writing anything
                key = (span.rollout_id, span.attempt_id)
                if key not in attempts:
                    attempts[key] = self._load_attempt(conn, *key)
            stored: list[Span] = []
            stored_bytes = 0
            next_seq: dict[str, int] = {}
            for span in batch:
                rid = span.rollout_id
                if rid not in next_seq:
                    next_seq[rid] = int(
                        conn.execute("SELECT next_seq FROM rollouts WHERE rollout_id=?", (rid,)).fetchone()[0]
                    )
                seq = next_seq[rid]
                if span.sequence_id is None:
                    span = span.model_copy(update={"sequence_id": seq})
                data = span.model_dump_json()
                cur = conn.execute(
                    "INSERT OR IGNORE INTO spans (rollout_id, attempt_id, span_id, sequence_id, name, size, data) "
                    "VALUES (?,?,?,?,?,?,?)",
                    (rid, span.attempt_id, span.span_id, span.sequence_id, span.name, len(data), data),
                )
                if cur.rowcount == 0:
                    continue  # a duplicate: already stored
                next_seq[rid] = max(seq, span.sequence_id or 0) + 1
                stored.append(span)
                stored_bytes += len(data)
            for rid, seq in next_seq.items():
                conn.execute("UPDATE rollouts SET next_seq=MAX(next_seq, ?) WHERE rollout_id=?", (seq, rid))
            if stored:
                conn.execute("UPDATE counters SET value=value+? WHERE name='spans'", (len(stored),))
                conn.execute(
                    "UPDATE counters SET value=value+? WHERE name='span_bytes'",
                    (stored_bytes,),
                )
            now = self.clock()
            for attempt in attempts.values():
                if attempt.status.is_terminal:
                    continue  # late spans of a superseded attempt are kept but move nothing
                attempt.last_heartbeat_at = now
                if attempt.status == AttemptStatus.PREPARING:
                    self._move_attempt(conn, attempt, AttemptStatus.RUNNING, None, finished)
                else:
                    self._save_attempt(conn, attempt)
            return stored

        return await self._call(op)

    async def next_sequence_id(self, rollout_id: str) -> int:
        def op(conn: Conn, _: list[str]) -> int:
            self._load_rollout(conn, rollout_id)
            row = conn.execute(
                "UPDATE rollouts SET next_seq=next_seq+1 WHERE rollout_id=? RETURNING next_seq", (rollout_id,)
            ).fetchone()
            return int(row[0]) - 1

        return await self._call(op)

    async def query_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        name: str | None = None,
        limit: int = 1000,
        cursor: str | None = None,
    ) -> Page[Span]:
        check_limit(limit)
        where, args = [], []
        if rollout_id is not None:
            await self.get_rollout(rollout_id)
            where.append("s.rollout_id=?")
            args.append(rollout_id)
        if attempt_id == "latest":
            where.append(
                "s.attempt_id=(SELECT a.attempt_id FROM attempts a WHERE a.rollout_id=s.rollout_id ORDER BY a.pos DESC LIMIT 1)"
            )
        elif attempt_id is not None:
            where.append("s.attempt_id=?")
            args.append(attempt_id)
        if name is not None:
            where.append("s.name=?")
            args.append(name)
        if cursor is not None:
            (after_rollout, after_seq), after_span = decode_cursor(cursor, sort=[str, int], tie=str)
            where.append("(s.rollout_id, s.sequence_id, s.span_id) > (?, ?, ?)")
            args += [after_rollout, after_seq, after_span]
        sql = "SELECT s.data FROM spans s"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY s.rollout_id, s.sequence_id, s.span_id LIMIT ?"
        rows = await self._call(lambda conn, _: conn.execute(sql, (*args, limit + 1)).fetchall(), write=False)
        items = [Span.model_validate_json(r[0]) for r in rows[:limit]]
        next_cursor = None
        if len(rows) > limit:
            last = items[-1]
            next_cursor = encode_cursor([last.rollout_id, last.sequence_id], last.span_id)
        return Page(items=items, next_cursor=next_cursor)

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

        def op(conn: Conn, _: list[str]) -> ResourcesVersion:
            if resources_id is not None:
                row = conn.execute(
                    "SELECT data FROM resources WHERE resources_id=?", (resources_id,)
                ).fetchone()
                if row is not None:
                    existing = ResourcesVersion.model_validate_json(row[0])
                    if existing.resources != named:
                        raise ConflictError(
                            f"resources {resources_id} already exist with other content; versions are immutable, "
                            "use update_resources to derive a new one"
                        )
                    return existing
            if (
                parent_id is not None
                and not conn.execute("SELECT 1 FROM resources WHERE resources_id=?", (parent_id,)).fetchone()
            ):
                raise NotFoundError(f"parent resources {parent_id!r} are not in the store")
            version_no = self._next_counter(conn, "resources")
            version = ResourcesVersion(
                resources_id=resources_id or new_id("rs"),
                version=version_no,
                resources=named,
                parent_id=parent_id,
                metadata=metadata or {},
                created_at=self.clock(),
            )
            conn.execute(
                "INSERT INTO resources (version, resources_id, data) VALUES (?,?,?)",
                (version.version, version.resources_id, version.model_dump_json()),
            )
            return version

        return await self._call(op)

    async def get_resources(self, resources_id: str) -> ResourcesVersion:
        def op(conn: Conn, _: list[str]) -> ResourcesVersion:
            row = conn.execute("SELECT data FROM resources WHERE resources_id=?", (resources_id,)).fetchone()
            if row is None:
                raise NotFoundError(f"no resources {resources_id!r} in the store")
            return ResourcesVersion.model_validate_json(row[0])

        return await self._call(op, write=False)

    async def get_latest_resources(self) -> ResourcesVersion | None:
        def op(conn: Conn, _: list[str]) -> ResourcesVersion | None:
            row = conn.execute("SELECT data FROM resources ORDER BY version DESC LIMIT 1").fetchone()
            return None if row is None else ResourcesVersion.model_validate_json(row[0])

        return await self._call(op, write=False)

    async def query_resources(self, *, limit: int = 100, cursor: str | None = None) -> Page[ResourcesVersion]:
        return await self._page(
            "resources",
            "version",
            "resources_id",
            [],
            [],
            False,
            limit,
            cursor,
            ResourcesVersion.model_validate_json,
        )

    # ----- workers, statistics, watchdog ----------------------------------------------------
    @staticmethod
    def _worker_from_row(row: Sequence[Any]) -> Worker:
        worker_id, status, heartbeat, rollout_id, attempt_id, host = row
        return Worker(
            worker_id=worker_id,
            status=WorkerStatus(status),
            last_heartbeat_at=heartbeat,
            current_rollout_id=rollout_id,
            current_attempt_id=attempt_id,
            host=_logic.json_loads(host) if host else {},
        )

    _WORKER_COLUMNS = "worker_id, status, last_heartbeat_at, current_rollout_id, current_attempt_id, host"

    async def update_worker(
        self, worker_id: str, *, status: WorkerStatus | None = None, host: dict[str, Any] | None = None
    ) -> Worker:
        _logic.checked_json(host, "host")

        def op(conn: Conn, _: list[str]) -> Worker:
            self._touch_worker(conn, worker_id, self.clock())
            if status is not None:
                conn.execute(
                    "UPDATE workers SET status=? WHERE worker_id=?", (WorkerStatus(status).value, worker_id)
                )
            if host is not None:
                conn.execute(
                    "UPDATE workers SET host=? WHERE worker_id=?", (_logic.json_dumps(host), worker_id)
                )
            row = conn.execute(f"SELECT {self._WORKER_COLUMNS} FROM workers WHERE worker_id=?", (worker_id,))
            return self._worker_from_row(row.fetchone())

        return await self._call(op)

    async def get_worker(self, worker_id: str) -> Worker:
        def op(conn: Conn, _: list[str]) -> Worker:
            row = conn.execute(
                f"SELECT {self._WORKER_COLUMNS} FROM workers WHERE worker_id=?", (worker_id,)
            ).fetchone()
            if row is None:
                raise NotFoundError(f"no worker {worker_id!r} in the store")
            return self._worker_from_row(row)

        return await self._call(op, write=False)

    async def query_workers(
        self, *, status: Sequence[WorkerStatus] | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[Worker]:
        check_limit(limit)
        where: list[str] = []
        args: list[Any] = []
        if status is not None:
            _where_in(where, args, "status", [WorkerStatus(s).value for s in status])
        if cursor is not None:
            after, _ = decode_cursor(cursor, sort=str, tie=str)
            where.append("worker_id > ?")
            args.append(after)
        sql = f"SELECT {self._WORKER_COLUMNS} FROM workers"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY worker_id LIMIT ?"
        rows = await self._call(lambda conn, _: conn.execute(sql, (*args, limit + 1)).fetchall(), write=False)
        items = [self._worker_from_row(r) for r in rows[:limit]]
        next_cursor = encode_cursor(items[-1].worker_id, items[-1].worker_id) if len(rows) > limit else None
        return Page(items=items, next_cursor=next_cursor)

    async def statistics(self) -> StoreStatistics:
        def op(conn: Conn, _: list[str]) -> StoreStatistics:
            counters = dict(conn.execute("SELECT name, value FROM counters").fetchall())
            return StoreStatistics(
                rollouts_by_status=dict(
                    conn.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status")
                ),
                attempts_by_status=dict(
                    conn.execute("SELECT status, COUNT(*) FROM attempts GROUP BY status")
                ),
                spans=counters.get("spans", 0),
                span_bytes=counters.get("span_bytes", 0),
                resources=conn.execute("SELECT COUNT(*) FROM resources").fetchone()[0],
                workers=conn.execute("SELECT COUNT(*) FROM workers").fetchone()[0],
            )

        return await self._call(op, write=False)

    async def run_watchdog(self) -> list[Attempt]:
        def op(conn: Conn, finished: list[str]) -> list[Attempt]:
            now = self.clock()
            marked = []
            rows = conn.execute(
                "SELECT a.data, r.data FROM attempts a JOIN rollouts r ON a.rollout_id=r.rollout_id WHERE a.live=1"
            ).fetchall()
            for attempt_data, rollout_data in rows:
                attempt = Attempt.model_validate_json(attempt_data)
                verdict = watchdog_verdict(attempt, Rollout.model_validate_json(rollout_data).retry, now)
                if verdict is not None:
                    self._move_attempt(
                        conn, attempt, verdict, f"marked {verdict.value} by the watchdog", finished
                    )
                    marked.append(attempt)
            return marked

        return await self._call(op)
