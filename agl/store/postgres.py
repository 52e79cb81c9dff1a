"""PostgreSQL LightningStore: the shared SQL lifecycle over psycopg 3, for several machines and servers.

Concurrency model: as for SQLite (group commit; ``connections`` > 1 lets a group form and run while the
one before it commits, each on its own connection), with PostgreSQL's row locks instead of a file lock:
rows a call will write are locked when it reads them, so two transactions never take the same span
sequence ids; a claim selects the queue head ``FOR UPDATE SKIP LOCKED``, so several store servers
sharing one database never hand out the same rollout; and a deadlock or serialization failure retries
the call inside its savepoint. Completions are announced with NOTIFY in the finishing transaction, so
waiters on every server sharing the schema wake at once.

Round trips: a group first runs in psycopg's pipeline mode, where only a read waits for the server,
without savepoints, with the rows its calls name (``Reads``) read and locked for all of them at once,
and as many queue heads as it has claims in one more read (``ReadAhead``: a hot call then makes no read
of its own), each call's writes sent as one statement,
and span counters and digests merged for the group (``Deferred``). Should any statement fail, or a
call fail after writing, the group is rolled back and run again as SQLite runs it (a savepoint and a
wait per statement), so outcomes never differ.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any, cast

import orjson

from agl.errors import missing_extra
from agl.schemas import now_s
from agl.store._sql import QUEUE_ORDER, Deferred, ReadAhead, SqlLightningStore
from agl.store._sql_schema import POSTGRES, ddl, upgrade_tables
from agl.store._sqlite_thread import GroupCommitPool, GroupCommitThread, _convert, _Op
from agl.store.base import Clock


class PostgresLightningStore(SqlLightningStore):
    """A LightningStore in a PostgreSQL database.

    Args:
        dsn: a libpq connection string, e.g. ``postgresql://postgres@127.0.0.1:5432/test``.
        schema: the PostgreSQL schema holding agl's tables (created when missing); one per deployment.
        connections: database connections that run groups of calls side by side (plus one that
            listens for completions); ``?connections=N`` in a store URL. On one 2-core machine with the
            runners beside it two gave no measurable change, so one is the default.
    """

    dialect = POSTGRES
    #: NOTIFY wakes waiters on every server; the poll only covers a dropped listener connection
    cross_process_poll_s: float | None = 5.0

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "agl",
        clock: Clock = now_s,
        watchdog_interval_s: float = 1.0,
        connections: int = 1,
    ) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise missing_extra("psycopg", "postgres") from exc
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", schema):
            raise ValueError(f"schema must be a plain SQL identifier, got {schema!r}")
        try:
            connections = int(connections)  # from a URL's ?connections= it comes as text
        except (TypeError, ValueError):
            raise ValueError(f"connections must be a whole number, got {connections!r}") from None
        if not 1 <= connections <= 64:
            raise ValueError(f"connections must be between 1 and 64, got {connections}")
        super().__init__(clock=clock, watchdog_interval_s=watchdog_interval_s)
        self.path = dsn
        self.schema = schema
        conn = _NulFreeConnection(psycopg.connect(dsn, autocommit=True))
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(4747)")  # one creator at a time
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            conn.execute(f'SET search_path TO "{schema}"')
            for statement in ddl(POSTGRES):
                conn.execute(statement)
            upgrade_tables(conn, POSTGRES)  # a schema from an older agl: the columns it lacks, filled once
            _compress_spans_with_lz4(conn)
            _leave_room_for_updates(conn)
        conn.execute(f'SET search_path TO "{schema}"')
        self._channel = f"agl_finished_{schema}"[:63]  # PostgreSQL's identifier limit
        threads: list[GroupCommitThread] = []
        for n in range(connections):
            if n:
                conn = _NulFreeConnection(psycopg.connect(dsn, autocommit=True))
                conn.execute(f'SET search_path TO "{schema}"')
            threads.append(
                _PipelinedGroupCommit(
                    conn,
                    f"agl-postgres-{schema}-{n}",
                    self._waiters.notify,
                    begin_write=self.dialect.begin_write,
                    is_retryable=self.dialect.is_retryable,
                    before_commit=self._announce,
                    ops=threads[0].ops if threads else None,
                )
            )
        self._db = GroupCommitPool(threads)
        listener = psycopg.connect(dsn, autocommit=True)
        listener.execute(f'LISTEN "{self._channel}"')
        self._listener = threading.Thread(
            target=self._listen, args=(listener,), name=f"agl-postgres-listen-{schema}", daemon=True
        )
        self._listener.start()

    def _announce(self, conn: Any, finished: list[str]) -> None:
        """NOTIFY the finished rollout ids as JSON lists, delivered at COMMIT.

        Payloads stay under PostgreSQL's 8000-byte limit; an id too long for any is left to the poll.
        """
        chunks: list[list[str]] = [[]]
        size = 2
        for rollout_id in finished:
            encoded = len(orjson.dumps(rollout_id)) + 1
            if encoded > 7000:
                continue
            if size + encoded > 7000:
                chunks.append([])
                size = 2
            chunks[-1].append(rollout_id)
            size += encoded
        for chunk in chunks:
            if chunk:
                conn.execute("SELECT pg_notify(%s, %s)", (self._channel, orjson.dumps(chunk).decode()))

    def _listen(self, conn: Any) -> None:
        with contextlib.suppress(Exception), conn:  # a lost connection leaves the poll as the fallback
            while not self._db.closed:
                for note in conn.notifies(timeout=0.5):
                    self._waiters.notify(orjson.loads(note.payload))


class _Redo(Exception):
    """The pipelined run of a group cannot tell which call a failure belongs to: run it again carefully."""


#: the table a write statement changes
_WRITE_TARGET = re.compile(r"(?:INSERT INTO|UPDATE|DELETE FROM) (\w+)")


class _CallConn:
    """The connection as one call of a pipelined group sees it.

    It notes whether the call wrote, holds the call's span counters and digests (``deferred``) for the
    group's end, and sends the call's consecutive writes to distinct tables as one statement (``WITH
    w0 AS (write), ... last write``): psycopg spends more CPU per statement than the statement costs the
    database. Each write of the chain sees the rows as they were before it (one snapshot), so a second
    write to a table, and any read, first sends what is held.
    """

    __slots__ = ("_conn", "_tables", "_writer", "_writes", "ahead", "deferred", "wrote")

    def __init__(self, conn: Any, writer: Any, ahead: ReadAhead | None) -> None:
        self._conn = conn
        self.ahead = ahead  # the rows the group read before its first call
        self._writer = writer  # one cursor for the group's writes: a cursor per statement costs as much again
        self.deferred = Deferred()
        self.wrote = False
        self._writes: list[tuple[str, Sequence[Any]]] = []
        self._tables: set[str] = set()

    def execute(self, query: str, params: Sequence[Any] = ()) -> Any:
        target = None if query.startswith("SELECT") or " RETURNING " in query else _WRITE_TARGET.match(query)
        if target is None:  # a read, or a write whose answer is wanted
            self.send_writes()
            if not query.startswith("SELECT"):
                self.wrote = True
            return self._conn.execute(query, params)
        self.wrote = True
        if target[1] in self._tables:
            self.send_writes()
        self._writes.append((query, params))
        self._tables.add(target[1])
        return None  # nobody reads a plain write's cursor

    def cursor(self) -> Any:
        self.send_writes()
        self.wrote = True
        return self._conn.cursor()

    def send_writes(self) -> None:
        """Send the writes held, as one statement."""
        if not self._writes:
            return
        *chained, (last, _) = self._writes
        query = last
        if chained:
            query = "WITH " + ", ".join(f"w{n} AS ({q})" for n, (q, _) in enumerate(chained)) + " " + last
        self._writer.execute(query, [v for _, params in self._writes for v in params])
        self._writes.clear()
        self._tables.clear()


class _PipelinedGroupCommit(GroupCommitThread):
    """Group commit with one wait per read instead of one per statement (see the module docstring)."""

    def _run_group(self, batch: list[_Op]) -> None:
        try:
            outcomes = self._run_pipelined(batch)
        except Exception:
            with contextlib.suppress(Exception):
                self._conn.execute("ROLLBACK")
            for op in batch:
                op.finished.clear()
            super()._run_group(batch)  # savepoints and a wait per statement, retries included
            return
        self._answer(outcomes)

    def _run_pipelined(self, batch: list[_Op]) -> list[tuple[_Op, Any, BaseException | None]]:
        import psycopg

        conn = self._conn
        outcomes: list[tuple[_Op, Any, BaseException | None]] = []
        group = Deferred()
        with conn.pipeline():
            conn.execute(self._begin_write)
            writer = conn.cursor()  # nobody reads what a plain write answers
            reads = [getattr(op.fn, "reads", []) for op in batch]
            claims = sum(getattr(op.fn, "claims", 0) for op in batch)
            ahead = None
            if any(reads) or claims:  # one read for all calls, locking their rows until COMMIT
                ahead = read_ahead(conn, [read for r in reads for read in r], claims)
            for op in batch:
                if not op.write and group:  # a read sees the counters and digests written before it
                    group.flush(conn, POSTGRES)
                view = _CallConn(conn, writer, ahead)
                try:
                    result = op.fn(cast(Any, view), op.finished)
                    view.send_writes()
                except psycopg.Error:
                    raise
                except Exception as exc:
                    if view.wrote:  # without a savepoint its writes cannot be undone alone
                        raise _Redo from exc
                    op.finished.clear()
                    outcomes.append((op, None, _convert(exc)))
                else:
                    group.merge(view.deferred)
                    outcomes.append((op, result, None))
            group.flush(conn, POSTGRES)
            finished = [i for op, _, error in outcomes if error is None for i in op.finished]
            if finished and self._before_commit is not None:
                self._before_commit(conn, finished)
            conn.execute("COMMIT")
        return outcomes


def read_ahead(conn: Any, reads: Sequence[tuple[str, str, Sequence[str]]], claims: int = 0) -> ReadAhead:
    """Read (and lock) the rows of ``reads``, and the first ``claims`` queued rollouts no other
    transaction holds, at once: PostgreSQL only (arrays, row locks)."""
    ahead = ReadAhead()
    if not reads:
        ahead.heads = _queue_heads(conn, claims)
        return ahead
    ahead.asked = {rollout_id for rollout_id, _, _ in reads}
    ids = sorted(ahead.asked)  # rows are locked in this order: no deadlock between servers doing the same
    # the ids go as one JSON text each: psycopg writes a list parameter element by element in Python
    wanted = "ARRAY(SELECT json_array_elements_text(%s::json))"
    rollouts = conn.execute(
        f"SELECT rollout_id, data, next_seq FROM rollouts WHERE rollout_id = ANY({wanted}) "
        "ORDER BY rollout_id FOR NO KEY UPDATE",
        (orjson.dumps(ids).decode(),),
    )
    attempts = conn.execute(
        f"SELECT rollout_id, attempt_id, live, data FROM attempts WHERE rollout_id = ANY({wanted}) "
        "ORDER BY attempt_id FOR NO KEY UPDATE",
        (orjson.dumps(ids).decode(),),
    )
    keys: dict[tuple[str, str], set[str]] = {}
    for rollout_id, attempt_id, span_ids in reads:
        if 0 < len(span_ids) <= 1000:
            keys.setdefault((rollout_id, attempt_id), set()).update(span_ids)
    spans = None
    if keys:
        triples = [[r, a, s] for (r, a), asked in keys.items() for s in asked]
        spans = conn.execute(
            "SELECT s.rollout_id, s.attempt_id, s.span_id FROM spans s JOIN json_array_elements(%s::json) k "
            "ON s.rollout_id=k->>0 AND s.attempt_id=k->>1 AND s.span_id=k->>2",
            (orjson.dumps(triples).decode(),),
        )
    # after the reads that wait for locks: a claim skips locked rows, so it waits for nobody
    ahead.heads = _queue_heads(conn, claims)
    for rollout_id, data, next_seq in rollouts.fetchall():
        ahead.rollouts[rollout_id] = (data, int(next_seq))
    for rollout_id, attempt_id, live, data in attempts.fetchall():
        ahead.attempts.setdefault(rollout_id, {})[attempt_id] = (live, data)
    ahead.spans = {key: (asked, set()) for key, asked in keys.items()}
    for rollout_id, attempt_id, span_id in spans.fetchall() if spans is not None else ():
        ahead.spans[(rollout_id, attempt_id)][1].add(span_id)
    return ahead


def _queue_heads(conn: Any, claims: int) -> list[tuple[str, str]]:
    """The first ``claims`` queued rollouts no other transaction holds, locked as a claim locks its one."""
    if not claims:
        return []
    sql = f"SELECT rollout_id, data {QUEUE_ORDER} LIMIT %s{POSTGRES.claim_suffix}"
    return [(r, d) for r, d in conn.execute(sql, (claims,)).fetchall()]


def _compress_spans_with_lz4(conn: Any) -> None:
    """Spans' JSON (kilobytes each) is compressed as it is stored: lz4 costs the database a third of the
    CPU of pglz, PostgreSQL's default, and stores smaller. Kept as is where the server
    lacks lz4 (before PostgreSQL 14, or built without it); rows stored before keep their compression."""
    row = conn.execute(
        "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name='default_toast_compression'"
    ).fetchone()
    if row is None or not row[0]:
        return
    (method,) = conn.execute(
        "SELECT attcompression FROM pg_attribute WHERE attrelid='spans'::regclass AND attname='data'"
    ).fetchone()
    if method != "l":
        conn.execute("ALTER TABLE spans ALTER COLUMN data SET COMPRESSION lz4")


#: free space left in each new page, so that an update which changes no indexed column (a heartbeat,
#: a rollout's next sequence id) writes its new row version in the same page and no index entries (HOT)
_FILLFACTOR = {"rollouts": 70, "attempts": 70, "workers": 50}


def _leave_room_for_updates(conn: Any) -> None:
    for table, percent in _FILLFACTOR.items():
        (options,) = conn.execute(f"SELECT reloptions FROM pg_class WHERE oid='{table}'::regclass").fetchone()
        if f"fillfactor={percent}" not in (options or []):
            conn.execute(f"ALTER TABLE {table} SET (fillfactor={percent})")


class _NulFreeConnection:
    """A psycopg connection that writes NUL in text parameters as U+FFFD instead of failing the statement.

    PostgreSQL text cannot hold NUL, and a model may emit one; spans keep it exactly (their JSON escapes
    it as ``\\u0000``), so only derived text columns (a digest's reply, a rollout's search text) see U+FFFD.
    Done here rather than by a psycopg dumper: one written in Python made psycopg convert every text
    parameter in Python, a fifth of the database thread's CPU.
    """

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def execute(self, query: str, params: Sequence[Any] | None = None) -> Any:
        return self._conn.execute(query, _nul_free(params))

    def cursor(self) -> Any:
        return _NulFreeCursor(self._conn.cursor())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _NulFreeCursor:
    def __init__(self, cursor: Any) -> None:
        self._cursor = cursor

    def execute(self, query: str, params: Sequence[Any] | None = None) -> Any:
        return self._cursor.execute(query, _nul_free(params))

    def executemany(self, query: str, params_seq: Iterable[Sequence[Any]]) -> None:
        self._cursor.executemany(query, [_nul_free(params) for params in params_seq])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cursor, name)


def _nul_free(params: Sequence[Any] | None) -> Any:
    for value in params or ():  # a plain loop: this runs for every statement
        if (type(value) is str and "\x00" in value) or (type(value) is list and _has_nul(value)):
            return [_without_nul(v) for v in params or ()]
    return params


def _has_nul(value: Any) -> bool:
    kind = type(value)
    return (kind is str and "\x00" in value) or (kind is list and any(_has_nul(v) for v in value))


def _without_nul(value: Any) -> Any:
    if type(value) is str:
        return value.replace("\x00", "\ufffd")
    if type(value) is list:
        return [_without_nul(v) for v in value]
    return value
