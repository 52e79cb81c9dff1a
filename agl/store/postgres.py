"""PostgreSQL LightningStore: the SQLite store's logic over psycopg 3, for several machines and servers.

Concurrency model: as for SQLite (one connection per store, group commit on one thread), with
PostgreSQL's row locks instead of a file lock: a claim selects the queue head ``FOR UPDATE SKIP
LOCKED``, so several store servers sharing one database never hand out the same rollout, and a
deadlock or serialization failure retries the call inside its savepoint.
"""

from __future__ import annotations

import re
from typing import Any

from agl.errors import missing_extra
from agl.schemas import now_s
from agl.store._sqlite_thread import GroupCommitThread
from agl.store.base import Clock
from agl.store.sqlite import SqliteLightningStore

# ids sort with COLLATE "C" so pages come out in the same order as Python's (and SQLite's) string order
SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    pos BIGSERIAL PRIMARY KEY,
    rollout_id TEXT COLLATE "C" NOT NULL UNIQUE,
    status TEXT NOT NULL,
    mode TEXT,
    group_id TEXT,
    updated_at DOUBLE PRECISION NOT NULL,
    queue_pos BIGINT,
    next_seq BIGINT NOT NULL DEFAULT 1,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts(queue_pos) WHERE queue_pos IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_status ON rollouts(status, pos);
CREATE INDEX IF NOT EXISTS rollouts_group ON rollouts(group_id);
CREATE INDEX IF NOT EXISTS rollouts_updated ON rollouts(updated_at, rollout_id);
CREATE TABLE IF NOT EXISTS attempts (
    pos BIGSERIAL PRIMARY KEY,
    attempt_id TEXT COLLATE "C" NOT NULL UNIQUE,
    rollout_id TEXT COLLATE "C" NOT NULL REFERENCES rollouts(rollout_id),
    status TEXT NOT NULL,
    worker_id TEXT,
    live INTEGER NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS attempts_rollout ON attempts(rollout_id, pos);
CREATE INDEX IF NOT EXISTS attempts_live ON attempts(live) WHERE live=1;
CREATE TABLE IF NOT EXISTS spans (
    rollout_id TEXT COLLATE "C" NOT NULL,
    attempt_id TEXT COLLATE "C" NOT NULL,
    span_id TEXT COLLATE "C" NOT NULL,
    sequence_id BIGINT NOT NULL,
    name TEXT NOT NULL,
    size BIGINT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (rollout_id, attempt_id, span_id)
);
CREATE INDEX IF NOT EXISTS spans_order ON spans(rollout_id, sequence_id, span_id);
CREATE TABLE IF NOT EXISTS resources (
    version BIGINT PRIMARY KEY,
    resources_id TEXT COLLATE "C" NOT NULL UNIQUE,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT COLLATE "C" PRIMARY KEY,
    status TEXT NOT NULL DEFAULT 'idle',
    last_heartbeat_at DOUBLE PRECISION,
    current_rollout_id TEXT,
    current_attempt_id TEXT,
    host TEXT
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value BIGINT NOT NULL);
INSERT INTO counters (name, value) VALUES ('queue', 0), ('resources', 0), ('spans', 0), ('span_bytes', 0)
    ON CONFLICT DO NOTHING;
"""

_RETRYABLE_SQLSTATES = frozenset({"40001", "40P01"})  # serialization failure, deadlock detected


class _PgConnection:
    """A psycopg connection that accepts the SQLite store's SQL: ``?`` placeholders and its two idioms."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn
        self._cache: dict[str, str] = {}

    def _translate(self, sql: str) -> str:
        out = self._cache.get(sql)
        if out is None:
            out = sql.replace("?", "%s").replace("MAX(next_seq, %s)", "GREATEST(next_seq, %s)")
            if out.startswith("INSERT OR IGNORE INTO"):
                out = out.replace("INSERT OR IGNORE INTO", "INSERT INTO", 1) + " ON CONFLICT DO NOTHING"
            self._cache[sql] = out
        return out

    def execute(self, sql: str, params: Any = None) -> Any:
        return self._conn.execute(self._translate(sql), params)

    def close(self) -> None:
        self._conn.close()


def _is_retryable(exc: BaseException) -> bool:
    return getattr(exc, "sqlstate", None) in _RETRYABLE_SQLSTATES


class PostgresLightningStore(SqliteLightningStore):
    """A LightningStore in a PostgreSQL database.

    Args:
        dsn: a libpq connection string, e.g. ``postgresql://postgres@127.0.0.1:5432/test``.
        schema: the PostgreSQL schema holding agl's tables (created when missing); one per deployment.
    """

    _claim_lock = " FOR UPDATE SKIP LOCKED"

    def __init__(
        self,
        dsn: str,
        *,
        schema: str = "agl",
        clock: Clock = now_s,
        watchdog_interval_s: float = 1.0,
    ) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise missing_extra("psycopg", "postgres") from exc
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", schema):
            raise ValueError(f"schema must be a plain SQL identifier, got {schema!r}")
        super(SqliteLightningStore, self).__init__(clock=clock, watchdog_interval_s=watchdog_interval_s)
        self.path = dsn
        self.schema = schema
        raw = psycopg.connect(dsn, autocommit=True)
        with raw.transaction():
            raw.execute("SELECT pg_advisory_xact_lock(4747)")  # one creator at a time
            raw.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            raw.execute(f'SET search_path TO "{schema}"')
            raw.execute(SCHEMA)
        raw.execute(f'SET search_path TO "{schema}"')
        self._db = GroupCommitThread(
            _PgConnection(raw),
            f"agl-postgres-{schema}",
            self._waiters.notify,
            begin_write="BEGIN",
            is_retryable=_is_retryable,
        )
