"""The SQL backends' tables: one column list for both DDLs, dialects as values, and the digest rows.

SQLite and PostgreSQL differ only in a :class:`Dialect`'s fields; ``ddl`` writes either schema from
``COLUMNS``, and ``upgrade_tables`` brings a store from an older agl up to date.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agl.schemas import Rollout
from agl.store import _logic
from agl.store.read_model import (
    DIGEST_COUNTS,
    DIGEST_SLOTS,
    DigestState,
    duration_s,
    merge_digest,
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
    # appended to a read of rows the transaction will write: where several connections write at once
    # (PostgreSQL) it holds them until COMMIT; SQLite's BEGIN IMMEDIATE already admits one writer
    lock_rows: str = ""
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
    lock_rows=" FOR NO KEY UPDATE",
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
        *((c, "int", "NOT NULL DEFAULT 0") for columns in DIGEST_COUNTS.values() for c in columns),
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
    "rollouts_mode ON rollouts(mode, pos)",  # a list of one mode (the changes view: every val rollout)
    "rollouts_updated ON rollouts(updated_at, rollout_id)",
    "attempts_rollout ON attempts(rollout_id, pos)",
    "attempts_live ON attempts(live) WHERE live=1",
    "spans_order ON spans(rollout_id, sequence_id, span_id)",
    "digests_stamp ON digests(stamp)",
]
#: ``digests``: the last digest stamp handed out (0: digests never written, see ``upgrade_tables``)
COUNTERS = ("queue", "resources", "spans", "span_bytes", "digests")
DIGEST_COLUMNS = [c for c, _, _ in COLUMNS["digests"]]
COUNT_COLUMNS = [c for columns in DIGEST_COUNTS.values() for c in columns]
LATEST_ATTEMPT = (
    "(SELECT a.attempt_id FROM attempts a WHERE a.rollout_id={t}.rollout_id ORDER BY a.pos DESC LIMIT 1)"
)


def digest_upsert(p: str) -> str:
    """One attempt's digest in: a slot changes only for a later span (an earlier one for ``ag``) and
    counts add up, so concurrent writers (several PostgreSQL servers) merge instead of overwriting
    each other."""
    updates = ["stamp=excluded.stamp", *(f"{c}=COALESCE(digests.{c},0)+excluded.{c}" for c in COUNT_COLUMNS)]
    for slot, (values, first) in DIGEST_SLOTS.items():
        seq = f"{slot}_seq"
        newer = (
            f"excluded.{seq} < COALESCE(digests.{seq}, 9223372036854775807)"
            if first
            else f"excluded.{seq} > COALESCE(digests.{seq}, -1)"
        )
        updates += [f"{c}=CASE WHEN {newer} THEN excluded.{c} ELSE digests.{c} END" for c in (seq, *values)]
    return (
        f"INSERT INTO digests ({', '.join(DIGEST_COLUMNS)}) VALUES ({','.join([p] * len(DIGEST_COLUMNS))}) "
        f"ON CONFLICT (rollout_id, attempt_id) DO UPDATE SET {', '.join(updates)}"
    )


def digest_row(rollout_id: str, attempt_id: str, stamp: int, state: DigestState) -> tuple[Any, ...]:
    row: list[Any] = [rollout_id, attempt_id, stamp]
    for slot, (values, _) in DIGEST_SLOTS.items():
        known = state.get(slot)
        row += list(known) if known is not None else [None] * (1 + len(values))
    for slot, columns in DIGEST_COUNTS.items():
        row += state.get(slot) or [0] * len(columns)
    return tuple(row)


def write_digests(conn: Any, d: Dialect, states: dict[tuple[str, str], DigestState]) -> None:
    """Merge the digests of a batch of spans (one state per attempt) into the table, newly stamped."""
    if not states:
        return
    top = int(
        conn.execute(
            f"UPDATE counters SET value=value+{d.param} WHERE name='digests' RETURNING value", (len(states),)
        ).fetchone()[0]
    )
    upsert_digests(conn, d, states, top)


def upsert_digests(conn: Any, d: Dialect, states: dict[tuple[str, str], DigestState], top: int) -> None:
    """Merge digests into the table, stamped ``top`` down (the counter was moved up by ``len(states)``)."""
    rows = [digest_row(rid, aid, top - n, state) for n, ((rid, aid), state) in enumerate(states.items())]
    conn.cursor().executemany(digest_upsert(d.param), rows)


def upgrade_tables(conn: Any, d: Dialect) -> None:
    """Bring a store from an older agl up to date; call inside the transaction that created the tables.
    Adds the columns it lacks (the rollouts' search columns filled from their JSON) and writes the
    digests of the spans it holds (once: the counter is 0 only until digests are first written), or
    only their counts where digests were written by an agl that kept none (once: as the columns come)."""
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
        conn.execute(f"UPDATE rollouts SET attempt_id={LATEST_ATTEMPT.format(t='rollouts')}")
    written = conn.execute("SELECT value FROM counters WHERE name='digests'").fetchone()[0]
    if written and not added.intersection(COUNT_COLUMNS):
        return
    states: dict[tuple[str, str], DigestState] = {}
    for rollout_id, attempt_id, sequence_id, name, data in conn.execute(
        "SELECT rollout_id, attempt_id, sequence_id, name, data FROM spans"
    ):
        slots = span_digest(name, _logic.json_loads(data).get("attributes") or {})
        if slots:
            merge_digest(states.setdefault((rollout_id, attempt_id), {}), sequence_id, slots)
    if written:  # the digests are there, without counts: set those (each attempt with a model call)
        p = d.param
        conn.cursor().executemany(
            f"UPDATE digests SET {', '.join(f'{c}={p}' for c in COUNT_COLUMNS)} "
            f"WHERE rollout_id={p} AND attempt_id={p}",
            [
                (*digest_row(rid, aid, 0, state)[-len(COUNT_COLUMNS) :], rid, aid)
                for (rid, aid), state in states.items()
                if any(slot in state for slot in DIGEST_COUNTS)
            ],
        )
        return
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
