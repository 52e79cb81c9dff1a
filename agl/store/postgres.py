"""PostgreSQL LightningStore: the shared SQL lifecycle over psycopg 3, for several machines and servers.

Concurrency model: as for SQLite (one connection per store, group commit on one thread), with
PostgreSQL's row locks instead of a file lock: a claim selects the queue head ``FOR UPDATE SKIP
LOCKED``, so several store servers sharing one database never hand out the same rollout, and a
deadlock or serialization failure retries the call inside its savepoint. Completions are announced
with NOTIFY in the finishing transaction, so waiters on every server sharing the schema wake at once.
"""

from __future__ import annotations

import contextlib
import re
import threading
from typing import Any

import orjson

from agl.errors import missing_extra
from agl.schemas import now_s
from agl.store._sql import POSTGRES, SqlLightningStore, ddl, upgrade_tables
from agl.store.base import Clock


class PostgresLightningStore(SqlLightningStore):
    """A LightningStore in a PostgreSQL database.

    Args:
        dsn: a libpq connection string, e.g. ``postgresql://postgres@127.0.0.1:5432/test``.
        schema: the PostgreSQL schema holding agl's tables (created when missing); one per deployment.
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
    ) -> None:
        try:
            import psycopg
        except ImportError as exc:
            raise missing_extra("psycopg", "postgres") from exc
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,62}", schema):
            raise ValueError(f"schema must be a plain SQL identifier, got {schema!r}")
        super().__init__(clock=clock, watchdog_interval_s=watchdog_interval_s)
        self.path = dsn
        self.schema = schema
        conn = psycopg.connect(dsn, autocommit=True)
        conn.adapters.register_dumper(str, _nul_free_str_dumper())
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(4747)")  # one creator at a time
            conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
            conn.execute(f'SET search_path TO "{schema}"')
            for statement in ddl(POSTGRES):
                conn.execute(statement)
            upgrade_tables(conn, POSTGRES)  # a schema from an older agl: the columns it lacks, filled once
        conn.execute(f'SET search_path TO "{schema}"')
        self._channel = f"agl_finished_{schema}"[:63]  # PostgreSQL's identifier limit
        self._open(conn, f"agl-postgres-{schema}", before_commit=self._announce)
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


def _nul_free_str_dumper() -> type:
    """psycopg's default ``str`` dumper, writing NUL as U+FFFD instead of failing the transaction.

    PostgreSQL text cannot hold NUL, and a model may emit one; spans keep it exactly (their JSON escapes
    it as ``\\u0000``), so only derived text columns (a digest's reply, an error's message) see U+FFFD.
    """
    from psycopg.types.string import StrDumperUnknown

    class NulFreeStrDumper(StrDumperUnknown):
        def dump(self, obj: str) -> Any:
            return super().dump(obj.replace("\x00", "\ufffd") if "\x00" in obj else obj)

    return NulFreeStrDumper
