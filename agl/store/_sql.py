"""The SQL backends' shared half: one column list for both DDLs, dialects as values, SQL tables.

Each object is one JSON document (``data``) plus the columns that queries filter and sort on.
SQLite and PostgreSQL differ only in the :class:`Dialect` fields; the lifecycle itself lives in
``_lifecycle`` and the connection's thread in ``_sqlite_thread`` (group commit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from agl.errors import NotFoundError
from agl.schemas import (
    Attempt,
    ResourcesVersion,
    Rollout,
    RolloutStatus,
    Span,
    Worker,
    WorkerStatus,
)
from agl.store import _logic
from agl.store._lifecycle import Query, R, Tables, TableStore, Work
from agl.store._sqlite_thread import GroupCommitThread
from agl.store.base import (
    DIGEST_SLOTS,
    AttemptDigest,
    DigestState,
    Kind,
    ListedRollout,
    Page,
    RolloutMatches,
    RolloutSearch,
    StoreStatistics,
    check_limit,
    decode_cursor,
    duration_s,
    encode_cursor,
    merge_digest,
    resolve_digest,
    search_text,
    span_digest,
)


@dataclass(frozen=True)
class Dialect:
    """What differs between SQL engines: placeholders, column types, the claim lock, transactions."""

    name: str
    param: str  # the driver's positional placeholder
    types: dict[str, str]  # logical column type -> SQL type
    greatest: str  # the two-argument maximum function
    contains: str  # "{0} holds the substring {1}"
    lower: str  # the lower-case function for any letter, not only ASCII ones
    metadata_is: str  # "the rollout's metadata key {p} holds the JSON value {p}"
    claim_suffix: str = ""  # appended to the queue-head SELECT of a claim
    begin_write: str = "BEGIN"
    retryable: frozenset[str] = frozenset()  # SQLSTATEs retried inside the call's savepoint

    def is_retryable(self, exc: BaseException) -> bool:
        return getattr(exc, "sqlstate", None) in self.retryable


SQLITE = Dialect(
    name="sqlite",
    param="?",
    types={
        "serial": "INTEGER PRIMARY KEY AUTOINCREMENT",
        "id": "TEXT",
        "text": "TEXT",
        "int": "INTEGER",
        "real": "REAL",
    },
    greatest="MAX",
    contains="instr({0}, {1}) > 0",
    lower="agl_lower",  # Python's, registered on each connection: SQLite's own knows only ASCII
    metadata_is="json_extract(r.data, '$.metadata.' || json_quote({p})) = json_extract({p}, '$')",
    begin_write="BEGIN IMMEDIATE",
)
# ids sort with COLLATE "C" so pages come out in the same order as Python's (and SQLite's) string order
POSTGRES = Dialect(
    name="postgresql",
    param="%s",
    types={
        "serial": "BIGSERIAL PRIMARY KEY",
        "id": 'TEXT COLLATE "C"',
        "text": "TEXT",
        "int": "BIGINT",
        "real": "DOUBLE PRECISION",
    },
    greatest="GREATEST",
    contains="strpos({0}, {1}) > 0",
    lower="lower",
    metadata_is="(r.data::jsonb -> 'metadata' -> {p}) = {p}::jsonb",
    claim_suffix=" FOR UPDATE SKIP LOCKED",
    retryable=frozenset({"40001", "40P01"}),  # serialization failure, deadlock detected
)

# table -> (column, logical type, constraint); the one source of both DDLs
COLUMNS: dict[str, list[tuple[str, str, str]]] = {
    "rollouts": [
        ("pos", "serial", ""),
        ("rollout_id", "id", "NOT NULL UNIQUE"),
        ("status", "text", "NOT NULL"),
        ("mode", "text", ""),
        ("group_id", "text", ""),
        ("updated_at", "real", "NOT NULL"),
        ("queue_pos", "int", ""),
        ("next_seq", "int", "NOT NULL DEFAULT 1"),
        ("data", "text", "NOT NULL"),
        # what search filters and sorts on: the latest attempt (its digest), and copies out of ``data``
        ("attempt_id", "id", ""),
        ("resources_id", "text", ""),
        ("duration", "real", ""),
        ("search_text", "text", ""),  # ``search_text()``: id and input, lower-cased
    ],
    "attempts": [
        ("pos", "serial", ""),
        ("attempt_id", "id", "NOT NULL UNIQUE"),
        ("rollout_id", "id", "NOT NULL REFERENCES rollouts(rollout_id)"),
        ("status", "text", "NOT NULL"),
        ("worker_id", "text", ""),
        ("live", "int", "NOT NULL"),
        ("data", "text", "NOT NULL"),
    ],
    "spans": [
        ("rollout_id", "id", "NOT NULL"),
        ("attempt_id", "id", "NOT NULL"),
        ("span_id", "id", "NOT NULL"),
        ("sequence_id", "int", "NOT NULL"),
        ("name", "text", "NOT NULL"),
        ("size", "int", "NOT NULL"),
        ("data", "text", "NOT NULL"),
    ],
    "resources": [
        ("version", "int", "PRIMARY KEY"),
        ("resources_id", "id", "NOT NULL UNIQUE"),
        ("data", "text", "NOT NULL"),
    ],
    "workers": [
        ("worker_id", "id", "PRIMARY KEY"),
        ("status", "text", "NOT NULL"),
        ("last_heartbeat_at", "real", ""),
        ("current_rollout_id", "text", ""),
        ("current_attempt_id", "text", ""),
        ("host", "text", ""),
    ],
    "counters": [("name", "text", "PRIMARY KEY"), ("value", "int", "NOT NULL")],
    # one row per attempt with spans that fill a digest slot (``AttemptDigest``), kept as spans arrive
    "digests": [
        ("rollout_id", "id", "NOT NULL"),
        ("attempt_id", "id", "NOT NULL"),
        ("stamp", "int", "NOT NULL"),
        *(
            column
            for slot, (values, _) in DIGEST_SLOTS.items()
            for column in (
                (f"{slot}_seq", "int", ""),
                *((v, "real" if v.endswith("_value") else "text", "") for v in values),
            )
        ),
    ],
}
TABLE_EXTRAS = {
    "spans": ", PRIMARY KEY (rollout_id, attempt_id, span_id)",
    "digests": ", PRIMARY KEY (rollout_id, attempt_id)",
}
INDEXES = [
    "rollouts_queue ON rollouts(queue_pos) WHERE queue_pos IS NOT NULL",
    "rollouts_status ON rollouts(status, pos)",
    "rollouts_group ON rollouts(group_id)",
    "rollouts_updated ON rollouts(updated_at, rollout_id)",
    "attempts_rollout ON attempts(rollout_id, pos)",
    "attempts_live ON attempts(live) WHERE live=1",
    "spans_order ON spans(rollout_id, sequence_id, span_id)",
    "digests_stamp ON digests(stamp)",
]
#: ``digests``: the last digest stamp handed out (0: digests never written, see ``upgrade_tables``)
COUNTERS = ("queue", "resources", "spans", "span_bytes", "digests")
_DIGEST_COLUMNS = [c for c, _, _ in COLUMNS["digests"]]
_LATEST = (
    "(SELECT a.attempt_id FROM attempts a WHERE a.rollout_id={t}.rollout_id ORDER BY a.pos DESC LIMIT 1)"
)
_WITH_DIGEST = " LEFT JOIN digests d ON d.rollout_id=r.rollout_id AND d.attempt_id=r.attempt_id"
# opens "the latest attempt's digest matches ...": for the reply text, one pass over the digests is
# twice as fast as a join of every rollout when few match, and as fast when all do
_DIGEST_IN = "(r.rollout_id, r.attempt_id) IN (SELECT d.rollout_id, d.attempt_id FROM digests d WHERE "
#: a digest row's reply, as ``digest_values`` resolves it
_REPLY = (
    "CASE WHEN d.tr_seq IS NOT NULL AND (d.gw_seq IS NULL OR (d.tr_seq > d.gw_seq"
    " AND (d.tr_id IS NULL OR d.gw_id IS NULL OR d.tr_id <> d.gw_id))) THEN d.tr_text ELSE d.gw_text END"
)
_SORT_VALUES = {"created": "r.pos", "reward": "COALESCE(d.rw_value, d.rl_value)", "duration": "r.duration"}


def _digest_upsert(p: str) -> str:
    """One attempt's digest in: a slot changes only for a later span (an earlier one for ``ag``), so
    concurrent writers (several PostgreSQL servers) merge instead of overwriting each other."""
    updates = ["stamp=excluded.stamp"]
    for slot, (values, first) in DIGEST_SLOTS.items():
        seq = f"{slot}_seq"
        newer = (
            f"excluded.{seq} < COALESCE(digests.{seq}, 9223372036854775807)"
            if first
            else f"excluded.{seq} > COALESCE(digests.{seq}, -1)"
        )
        updates += [f"{c}=CASE WHEN {newer} THEN excluded.{c} ELSE digests.{c} END" for c in (seq, *values)]
    return (
        f"INSERT INTO digests ({', '.join(_DIGEST_COLUMNS)}) VALUES ({','.join([p] * len(_DIGEST_COLUMNS))}) "
        f"ON CONFLICT (rollout_id, attempt_id) DO UPDATE SET {', '.join(updates)}"
    )


def _digest_row(rollout_id: str, attempt_id: str, stamp: int, state: DigestState) -> tuple[Any, ...]:
    row: list[Any] = [rollout_id, attempt_id, stamp]
    for slot, (values, _) in DIGEST_SLOTS.items():
        known = state.get(slot)
        row += list(known) if known is not None else [None] * (1 + len(values))
    return tuple(row)


def _digest_of(row: Sequence[Any]) -> AttemptDigest:
    state: DigestState = {}
    n = 3
    for slot, (values, _) in DIGEST_SLOTS.items():
        if row[n] is not None:
            state[slot] = tuple(row[n : n + 1 + len(values)])
        n += 1 + len(values)
    return resolve_digest(row[0], row[1], row[2], state)


def write_digests(conn: Any, d: Dialect, states: dict[tuple[str, str], DigestState]) -> None:
    """Merge the digests of a batch of spans (one state per attempt) into the table, newly stamped."""
    if not states:
        return
    top = int(
        conn.execute(
            f"UPDATE counters SET value=value+{d.param} WHERE name='digests' RETURNING value", (len(states),)
        ).fetchone()[0]
    )
    rows = [_digest_row(rid, aid, top - n, state) for n, ((rid, aid), state) in enumerate(states.items())]
    conn.cursor().executemany(_digest_upsert(d.param), rows)


def upgrade_tables(conn: Any, d: Dialect) -> None:
    """Bring a store from an older agl up to date; call inside the transaction that created the tables.
    Adds the columns it lacks (the rollouts' search columns filled from their JSON) and writes the
    digests of the spans it holds (once: the counter is 0 only until digests are first written)."""
    added = set()
    for table, columns in COLUMNS.items():
        have = {c[0] for c in conn.execute(f"SELECT * FROM {table} LIMIT 0").description}
        for column, kind, extra in columns:
            if column not in have:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN {column} {d.types[kind]} {extra}")
                added.add(column)
    if "search_text" in added:
        found = [Rollout.model_validate_json(data) for (data,) in conn.execute("SELECT data FROM rollouts")]
        p = d.param
        conn.cursor().executemany(
            f"UPDATE rollouts SET resources_id={p}, duration={p}, search_text={p} WHERE rollout_id={p}",
            [(r.resources_id, duration_s(r), search_text(r), r.rollout_id) for r in found],
        )
        conn.execute(f"UPDATE rollouts SET attempt_id={_LATEST.format(t='rollouts')}")
    if conn.execute("SELECT value FROM counters WHERE name='digests'").fetchone()[0]:
        return
    states: dict[tuple[str, str], DigestState] = {}
    for rollout_id, attempt_id, sequence_id, name, data in conn.execute(
        "SELECT rollout_id, attempt_id, sequence_id, name, data FROM spans"
    ):
        slots = span_digest(name, _logic.json_loads(data).get("attributes") or {})
        if slots:
            merge_digest(states.setdefault((rollout_id, attempt_id), {}), sequence_id, slots)
    write_digests(conn, d, states)
    conn.execute("UPDATE counters SET value=value+1 WHERE name='digests'")  # done, even with none


def ddl(d: Dialect) -> list[str]:
    """The statements that create agl's tables (idempotent) in dialect ``d``."""
    out = []
    for table, columns in COLUMNS.items():
        cols = ", ".join(" ".join(filter(None, (c, d.types[kind], extra))) for c, kind, extra in columns)
        out.append(f"CREATE TABLE IF NOT EXISTS {table} ({cols}{TABLE_EXTRAS.get(table, '')})")
    out += [f"CREATE INDEX IF NOT EXISTS {index}" for index in INDEXES]
    values = ", ".join(f"('{name}', 0)" for name in COUNTERS)
    out.append(f"INSERT INTO counters (name, value) VALUES {values} ON CONFLICT DO NOTHING")
    return out


# what a cursor's sort key must be for each sort column (PostgreSQL refuses to compare across types)
_SORT_KINDS: dict[str, Kind] = {
    "sequence_id": int,
    "pos": int,
    "version": int,
    "created_at": (int, float),
    "updated_at": (int, float),
}
_WORKER_COLUMNS = "worker_id, status, last_heartbeat_at, current_rollout_id, current_attempt_id, host"
_SPAN_ROWS_PER_INSERT = 500  # 7 parameters a row stays under SQLite's 32766-parameter limit


def _worker(row: Sequence[Any]) -> Worker:
    worker_id, status, heartbeat, rollout_id, attempt_id, host = row
    return Worker(
        worker_id=worker_id,
        status=WorkerStatus(status),
        last_heartbeat_at=heartbeat,
        current_rollout_id=rollout_id,
        current_attempt_id=attempt_id,
        host=_logic.json_loads(host) if host else {},
    )


class SqlTables(Tables):
    """The tables over one DB-API connection inside the group-commit thread's transaction."""

    def __init__(self, conn: Any, dialect: Dialect) -> None:
        self.conn = conn
        self.p = dialect.param
        self.d = dialect

    def _one(self, sql: str, *args: Any) -> Any:
        return self.conn.execute(sql, args).fetchone()

    def _counter(self, name: str, by: int = 1) -> int:
        row = self._one(
            f"UPDATE counters SET value=value+{self.p} WHERE name={self.p} RETURNING value", by, name
        )
        return int(row[0])

    def rollout(self, rollout_id: str) -> Rollout | None:
        row = self._one(f"SELECT data FROM rollouts WHERE rollout_id={self.p}", rollout_id)
        return None if row is None else Rollout.model_validate_json(row[0])

    def insert_rollout(self, rollout: Rollout) -> None:
        p = self.p
        self.conn.execute(
            "INSERT INTO rollouts (rollout_id, status, mode, group_id, updated_at, queue_pos, data, "
            f"resources_id, duration, search_text) VALUES ({p},{p},{p},{p},{p},{p},{p},{p},{p},{p})",
            (
                rollout.rollout_id,
                rollout.status.value,
                rollout.mode,
                rollout.group_id,
                rollout.updated_at,
                self._counter("queue") if rollout.status.is_queued else None,
                rollout.model_dump_json(),
                rollout.resources_id,
                duration_s(rollout),
                search_text(rollout),
            ),
        )

    def save_rollout(self, rollout: Rollout, *, enqueue: bool = False) -> None:
        p = self.p
        queue = ""
        args: tuple[Any, ...] = ()
        if enqueue:
            queue, args = f", queue_pos={p}", (self._counter("queue"),)
        elif not rollout.status.is_queued:
            queue = ", queue_pos=NULL"
        self.conn.execute(
            f"UPDATE rollouts SET status={p}, updated_at={p}, duration={p}, data={p}{queue} WHERE rollout_id={p}",
            (
                rollout.status.value,
                rollout.updated_at,
                duration_s(rollout),
                rollout.model_dump_json(),
                *args,
                rollout.rollout_id,
            ),
        )

    def queue_head(self) -> Rollout | None:
        sql = "SELECT data FROM rollouts WHERE queue_pos IS NOT NULL ORDER BY queue_pos LIMIT 1"
        row = self._one(sql + self.d.claim_suffix)
        return None if row is None else Rollout.model_validate_json(row[0])

    def attempt(self, rollout_id: str, attempt_id: str) -> Attempt | None:
        row = self._one(
            f"SELECT data FROM attempts WHERE attempt_id={self.p} AND rollout_id={self.p}",
            attempt_id,
            rollout_id,
        )
        return None if row is None else Attempt.model_validate_json(row[0])

    def insert_attempt(self, attempt: Attempt) -> None:
        p = self.p
        self.conn.execute(
            f"INSERT INTO attempts (attempt_id, rollout_id, status, worker_id, live, data) VALUES ({p},{p},{p},{p},{p},{p})",
            (
                attempt.attempt_id,
                attempt.rollout_id,
                attempt.status.value,
                attempt.worker_id,
                int(not attempt.status.is_terminal),
                attempt.model_dump_json(),
            ),
        )
        self.conn.execute(
            f"UPDATE rollouts SET attempt_id={p} WHERE rollout_id={p}",
            (attempt.attempt_id, attempt.rollout_id),
        )

    def save_attempt(self, attempt: Attempt) -> None:
        p = self.p
        self.conn.execute(
            f"UPDATE attempts SET status={p}, live={p}, data={p} WHERE attempt_id={p}",
            (
                attempt.status.value,
                int(not attempt.status.is_terminal),
                attempt.model_dump_json(),
                attempt.attempt_id,
            ),
        )

    def live_attempts(self, rollout_id: str | None = None) -> list[tuple[Attempt, Rollout]]:
        sql = "SELECT a.data, r.data FROM attempts a JOIN rollouts r ON a.rollout_id=r.rollout_id WHERE a.live=1"
        args: tuple[Any, ...] = ()
        if rollout_id is not None:
            sql, args = sql + f" AND a.rollout_id={self.p}", (rollout_id,)
        rows = self.conn.execute(sql, args).fetchall()
        return [(Attempt.model_validate_json(a), Rollout.model_validate_json(r)) for a, r in rows]

    def worker(self, worker_id: str) -> Worker | None:
        row = self._one(f"SELECT {_WORKER_COLUMNS} FROM workers WHERE worker_id={self.p}", worker_id)
        return None if row is None else _worker(row)

    def save_worker(self, worker: Worker) -> None:
        p = self.p
        self.conn.execute(
            f"INSERT INTO workers ({_WORKER_COLUMNS}) VALUES ({p},{p},{p},{p},{p},{p}) ON CONFLICT(worker_id) DO UPDATE "
            "SET status=excluded.status, last_heartbeat_at=excluded.last_heartbeat_at, "
            "current_rollout_id=excluded.current_rollout_id, current_attempt_id=excluded.current_attempt_id, "
            "host=excluded.host",
            (
                worker.worker_id,
                worker.status.value,
                worker.last_heartbeat_at,
                worker.current_rollout_id,
                worker.current_attempt_id,
                _logic.json_dumps(worker.host) if worker.host else None,
            ),
        )

    def insert_spans(self, spans: list[Span]) -> list[Span]:
        """Duplicates are found with one SELECT per attempt, then the rest go in multi-row INSERTs."""
        p = self.p
        keys: dict[tuple[str, str], list[str]] = {}
        for span in spans:
            keys.setdefault((span.rollout_id, span.attempt_id), []).append(span.span_id)
        seen: set[tuple[str, str, str]] = set()
        for (rid, aid), span_ids in keys.items():
            rows = self.conn.execute(
                f"SELECT span_id FROM spans WHERE rollout_id={p} AND attempt_id={p} AND span_id IN ({','.join([p] * len(span_ids))})",
                (rid, aid, *span_ids),
            ).fetchall()
            seen.update((rid, aid, r[0]) for r in rows)
        next_seq: dict[str, int] = {}
        stored: list[Span] = []
        rows_out: list[tuple[Any, ...]] = []
        for span in spans:
            key = (span.rollout_id, span.attempt_id, span.span_id)
            if key in seen:
                continue  # a duplicate: already stored
            seen.add(key)
            rid = span.rollout_id
            if rid not in next_seq:
                next_seq[rid] = int(self._one(f"SELECT next_seq FROM rollouts WHERE rollout_id={p}", rid)[0])
            seq = next_seq[rid]
            if span.sequence_id is None:
                span = span.model_copy(update={"sequence_id": seq})
            next_seq[rid] = max(seq, span.sequence_id or 0) + 1
            data = span.model_dump_json()
            rows_out.append(
                (rid, span.attempt_id, span.span_id, span.sequence_id, span.name, len(data), data)
            )
            stored.append(span)
        for start in range(0, len(rows_out), _SPAN_ROWS_PER_INSERT):
            chunk = rows_out[start : start + _SPAN_ROWS_PER_INSERT]
            values = ",".join([f"({p},{p},{p},{p},{p},{p},{p})"] * len(chunk))
            self.conn.execute(
                f"INSERT INTO spans (rollout_id, attempt_id, span_id, sequence_id, name, size, data) VALUES {values} "
                "ON CONFLICT DO NOTHING",
                [v for row in chunk for v in row],
            )
        for rid, seq in next_seq.items():
            self.conn.execute(
                f"UPDATE rollouts SET next_seq={self.d.greatest}(next_seq, {p}) WHERE rollout_id={p}",
                (seq, rid),
            )
        if stored:
            self._counter("spans", len(stored))
            self._counter("span_bytes", sum(row[5] for row in rows_out))
            states: dict[tuple[str, str], DigestState] = {}
            for span in stored:
                slots = span_digest(span.name, span.attributes)
                if slots:
                    attempt = (span.rollout_id, span.attempt_id)
                    merge_digest(states.setdefault(attempt, {}), span.sequence_id or 0, slots)
            write_digests(self.conn, self.d, states)
        return stored

    def digests(self, rollout_ids: Sequence[str] | None, after: int, limit: int) -> Page[AttemptDigest]:
        """Digests of latest attempts stamped after ``after``, by stamp (one more read to see if more)."""
        p = self.p
        where = [f"d.stamp > {p}", f"d.attempt_id={_LATEST.format(t='d')}"]
        args: list[Any] = [after]
        if rollout_ids is not None:
            where.append(f"d.rollout_id IN ({','.join([p] * len(rollout_ids))})" if rollout_ids else "1=0")
            args += list(rollout_ids)
        columns = ", ".join(f"d.{c}" for c in _DIGEST_COLUMNS)
        rows = self.conn.execute(
            f"SELECT {columns} FROM digests d WHERE {' AND '.join(where)} ORDER BY d.stamp LIMIT {p}",
            (*args, limit + 1),
        ).fetchall()
        items = [_digest_of(r) for r in rows[:limit]]
        return Page(items=items, next_cursor=str(items[-1].stamp) if len(rows) > limit else None)

    def search(self, q: RolloutSearch) -> RolloutMatches:
        """The matching rollouts' positions in order (joined with the latest attempts' digests only for a
        filter or sort on them), then the page's rollouts and digests by position."""
        p, d = self.p, self.d
        where: list[str] = []
        args: list[Any] = []
        if q.status is not None:
            where.append(f"r.status IN ({','.join([p] * len(q.status))})" if q.status else "1=0")
            args += [s.value for s in q.status]
        for column, value in (
            ("r.mode", q.mode),
            ("r.group_id", q.group_id),
            ("r.resources_id", q.resources_id),
            ("d.ag_name", q.agent),
            ("d.err_type", q.error_type),
        ):
            if value is not None:
                where.append(f"{column}={p}")
                args.append(value)
        for key, wanted in (q.metadata or {}).items():
            where.append(d.metadata_is.format(p=p))
            args += [key, orjson.dumps(wanted).decode()]
        if q.text:
            needle = q.text.lower()
            lower = "lower" if needle.isascii() else d.lower
            reply = d.contains.format(f"{lower}({_REPLY})", p)
            where.append(f"({d.contains.format('r.search_text', p)} OR {_DIGEST_IN}{reply}))")
            args += [needle, needle]
        join = q.sort == "reward" or q.agent is not None or q.error_type is not None
        sql = f"SELECT r.pos, COUNT(*) OVER () FROM rollouts r{_WITH_DIGEST if join else ''}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        order = f"{_SORT_VALUES[q.sort]} {'DESC' if q.descending else 'ASC'} NULLS LAST, r.pos DESC"
        rows = self.conn.execute(
            f"{sql} ORDER BY {order} LIMIT {p} OFFSET {p}", (*args, q.limit, q.offset)
        ).fetchall()
        if not rows:
            total = self._one(f"SELECT COUNT(*) FROM ({sql}) c", *args)[0] if q.offset else 0
            return RolloutMatches(items=[], total=total)
        columns = ", ".join(f"d.{c}" for c in _DIGEST_COLUMNS)
        found = {
            row[0]: row[1:]
            for row in self.conn.execute(
                f"SELECT r.pos, r.data, {columns} FROM rollouts r{_WITH_DIGEST} WHERE r.pos IN ({','.join([p] * len(rows))})",
                [row[0] for row in rows],
            )
        }
        items = [
            ListedRollout(
                rollout=Rollout.model_validate_json(found[pos][0]),
                digest=None if found[pos][1] is None else _digest_of(found[pos][1:]),
            )
            for pos, _ in rows
        ]
        return RolloutMatches(items=items, total=rows[0][1])

    def next_sequence_id(self, rollout_id: str) -> int:
        row = self._one(
            f"UPDATE rollouts SET next_seq=next_seq+1 WHERE rollout_id={self.p} RETURNING next_seq",
            rollout_id,
        )
        return int(row[0]) - 1

    def resources(self, resources_id: str | None) -> ResourcesVersion | None:
        if resources_id is None:
            row = self._one("SELECT data FROM resources ORDER BY version DESC LIMIT 1")
        else:
            row = self._one(f"SELECT data FROM resources WHERE resources_id={self.p}", resources_id)
        return None if row is None else ResourcesVersion.model_validate_json(row[0])

    def insert_resources(self, version: ResourcesVersion) -> ResourcesVersion:
        version = version.model_copy(update={"version": self._counter("resources")})
        self.conn.execute(
            f"INSERT INTO resources (version, resources_id, data) VALUES ({self.p},{self.p},{self.p})",
            (version.version, version.resources_id, version.model_dump_json()),
        )
        return version

    def page(self, query: Query) -> Page[Any]:
        """Keyset pagination: rows strictly after the cursor's (sort key, id), one extra to see if more."""
        p = self.p
        where, args = [], []
        for column, values in query.where.items():
            where.append(f"s.{column} IN ({','.join([p] * len(values))})" if values else "1=0")
            args += values
        if query.latest_attempt:
            where.append(
                "s.attempt_id=(SELECT a.attempt_id FROM attempts a WHERE a.rollout_id=s.rollout_id ORDER BY a.pos DESC LIMIT 1)"
            )
        sort = ", ".join(f"s.{c}" for c in query.order)
        if query.cursor is not None:
            kinds = [_SORT_KINDS.get(c, str) for c in query.order]
            key, tie = decode_cursor(query.cursor, sort=kinds if len(kinds) > 1 else kinds[0])
            keys = list(key) if len(kinds) > 1 else [key]
            where.append(
                f"({sort}, s.{query.tiebreak}) {'<' if query.descending else '>'} ({','.join([p] * (len(keys) + 1))})"
            )
            args += [*keys, tie]
        direction = " DESC" if query.descending else ""
        columns = _WORKER_COLUMNS if query.table == "workers" else "data"
        sql = f"SELECT {sort}, s.{query.tiebreak}, {columns} FROM {query.table} s"
        if where:
            sql += " WHERE " + " AND ".join(where)
        order = ", ".join(f"s.{c}{direction}" for c in (*query.order, query.tiebreak))
        rows = self.conn.execute(f"{sql} ORDER BY {order} LIMIT {p}", (*args, query.limit + 1)).fetchall()
        n = len(query.order)
        parse = _worker if query.table == "workers" else _MODELS[query.table].model_validate_json
        items = [parse(r[n + 1 :] if query.table == "workers" else r[n + 1]) for r in rows[: query.limit]]
        next_cursor = None
        if len(rows) > query.limit:
            last = rows[query.limit - 1]
            next_cursor = encode_cursor(list(last[:n]) if n > 1 else last[0], last[n])
        return Page(items=items, next_cursor=next_cursor)


_MODELS: dict[str, Any] = {
    "rollouts": Rollout,
    "attempts": Attempt,
    "spans": Span,
    "resources": ResourcesVersion,
}


class SqlLightningStore(TableStore):
    """The lifecycle over :class:`SqlTables` on one group-commit connection; queries as keyset SQL."""

    cross_process_poll_s: float | None = 0.5
    dialect: Dialect = SQLITE
    path: str

    def _open(
        self, conn: Any, name: str, before_commit: Callable[[Any, list[str]], None] | None = None
    ) -> None:
        self._db = GroupCommitThread(
            conn,
            name,
            self._waiters.notify,
            begin_write=self.dialect.begin_write,
            is_retryable=self.dialect.is_retryable,
            before_commit=before_commit,
        )

    async def _tx(self, fn: Work[R], *, write: bool = True) -> R:
        dialect = self.dialect
        return await self._db.call(lambda conn, finished: fn(SqlTables(conn, dialect), finished), write=write)

    async def aclose(self) -> None:
        await super().aclose()
        await self._db.close()

    async def _finished(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        def op(t: Tables, _: list[str]) -> list[Rollout]:
            assert isinstance(t, SqlTables)
            out = []
            for rollout_id in rollout_ids:
                row = t._one(f"SELECT status, data FROM rollouts WHERE rollout_id={t.p}", rollout_id)
                if row is None:
                    raise NotFoundError(f"no rollout {rollout_id!r} in the store", rollout_id=rollout_id)
                if RolloutStatus(row[0]).is_terminal:
                    out.append(Rollout.model_validate_json(row[1]))
            return out

        return await self._tx(op, write=False)

    async def query_digests(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        after: int = 0,
        limit: int = 10_000,
    ) -> Page[AttemptDigest]:
        check_limit(limit)
        ids = None if rollout_ids is None else list(dict.fromkeys(rollout_ids))

        def op(t: Tables, _: list[str]) -> Page[AttemptDigest]:
            assert isinstance(t, SqlTables)
            if ids is None or len(ids) <= 1000:
                return t.digests(ids, after, limit)
            items = [
                d for n in range(0, len(ids), 1000) for d in t.digests(ids[n : n + 1000], after, limit).items
            ]
            items.sort(key=lambda d: d.stamp)
            return Page(
                items=items[:limit], next_cursor=str(items[limit - 1].stamp) if len(items) > limit else None
            )

        return await self._tx(op, write=False)

    async def search_rollouts(self, query: RolloutSearch) -> RolloutMatches:
        def op(t: Tables, _: list[str]) -> RolloutMatches:
            assert isinstance(t, SqlTables)
            return t.search(query)

        return await self._tx(op, write=False)

    async def statistics(self) -> StoreStatistics:
        def op(conn: Any, _: list[str]) -> StoreStatistics:
            counters = dict(conn.execute("SELECT name, value FROM counters").fetchall())
            return StoreStatistics(
                rollouts_by_status=dict(
                    conn.execute("SELECT status, COUNT(*) FROM rollouts GROUP BY status").fetchall()
                ),
                attempts_by_status=dict(
                    conn.execute("SELECT status, COUNT(*) FROM attempts GROUP BY status").fetchall()
                ),
                spans=counters.get("spans", 0),
                span_bytes=counters.get("span_bytes", 0),
                resources=conn.execute("SELECT COUNT(*) FROM resources").fetchone()[0],
                workers=conn.execute("SELECT COUNT(*) FROM workers").fetchone()[0],
            )

        return await self._db.call(op, write=False)
