"""SQLite LightningStore: the embedded, durable default.

Concurrency model: one connection per store instance, owned by one database thread that runs
queued calls in shared transactions (group commit; see ``_sqlite_thread``). Writers take the
database lock with ``BEGIN IMMEDIATE``, so several processes may open the same file: a claim
(dequeue) is a read-modify-write inside one locked transaction and is never doubled. WAL mode
keeps readers off the writers' backs; a committed transaction survives a process crash.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

from agl.schemas import now_s
from agl.store._sql import SqlLightningStore
from agl.store._sql_schema import SQLITE, ddl, upgrade_tables
from agl.store.base import Clock


class SqliteLightningStore(SqlLightningStore):
    """A LightningStore in one SQLite file (``":memory:"`` for a private, non-durable one).

    Args:
        path: the database file; created with its schema when missing.
        synchronous: SQLite's ``synchronous`` pragma; ``NORMAL`` survives process crashes, ``FULL``
            also power loss.
    """

    dialect = SQLITE

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
        conn.create_function("agl_lower", 1, _lower, deterministic=True)  # search's, for any letter
        with contextlib.suppress(sqlite3.OperationalError):  # another process created it first
            conn.executescript(";\n".join(ddl(SQLITE)) + ";")
        conn.execute("BEGIN IMMEDIATE")  # a file from an older agl: brought up to date once, here
        try:
            upgrade_tables(conn, SQLITE)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
        self._open(conn, f"agl-sqlite-{Path(self.path).name}")


def _lower(text: str | None) -> str | None:
    return None if text is None else text.lower()
