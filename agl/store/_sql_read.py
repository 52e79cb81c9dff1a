"""The SQL backends' read model: digests, search and statistics as SQL over the lifecycle's tables.

The digests themselves are written with the spans (``_sql``'s ``Deferred``); this module only reads.
Every read runs as a read-only call of the group-commit thread, so it sees what the calls before it wrote.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from pydantic import TypeAdapter

from agl.schemas import Rollout
from agl.store._sql_schema import LATEST_ATTEMPT, Dialect
from agl.store._sqlite_thread import GroupCommitPool, GroupCommitThread
from agl.store.base import Page, check_limit
from agl.store.read_model import (
    AttemptDigest,
    ListedRollout,
    RolloutMatches,
    RolloutSearch,
    StoreReadModel,
    StoreStatistics,
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
_REWARD = "COALESCE(d.rw_value, d.rl_value)"
_SORT_VALUES = {
    "created": "r.pos",
    "reward": _REWARD,
    "duration": "r.duration",
    # the source with more calls (``counts_of``); a rollout without a digest made none
    "calls": "{greatest}(COALESCE(d.gw_calls, 0), COALESCE(d.tr_calls, 0))",
}
_IDS_PER_READ = 1000  # rollout ids per ``IN (...)`` list
#: a digest row's ``AttemptDigest`` fields as SQL over ``d``, resolved as ``digest_values`` resolves a
#: state (counts: the source with more calls, the gateway's when tied): read so, a page of digests costs
#: under half of reading every slot's columns and resolving them in Python
_FIELDS = {
    "rollout_id": "d.rollout_id",
    "attempt_id": "d.attempt_id",
    "stamp": "d.stamp",
    "reply": _REPLY,
    "error_type": "d.err_type",
    "reward": _REWARD,
    "agent": "d.ag_name",
    **{
        field: f"CASE WHEN d.tr_calls > d.gw_calls THEN d.tr_{column} ELSE d.gw_{column} END"
        for field, column in (
            ("calls", "calls"),
            ("tool_calls", "tool_calls"),
            ("completion_tokens", "tokens"),
        )
    },
}
_DIGEST_FIELDS = ", ".join(_FIELDS.values())
_DIGESTS = TypeAdapter(list[AttemptDigest])
_LISTED = TypeAdapter(list[ListedRollout])


def _digests_of(rows: Sequence[Sequence[Any]]) -> list[AttemptDigest]:
    """The digests rows of ``_DIGEST_FIELDS`` hold, validated at once (a third faster than one by one)."""
    return _DIGESTS.validate_python([dict(zip(_FIELDS, row, strict=True)) for row in rows])


def _sort_value(sort: str, d: Dialect) -> str:
    return _SORT_VALUES[sort].format(greatest=d.greatest)


class SqlReadModel(StoreReadModel):
    """The read model of a SQL backend; workers come from the lifecycle's keyset queries."""

    dialect: Dialect
    _db: GroupCommitThread | GroupCommitPool

    async def query_digests(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        after: int = 0,
        limit: int = 10_000,
    ) -> Page[AttemptDigest]:
        check_limit(limit)
        ids = None if rollout_ids is None else list(dict.fromkeys(rollout_ids))
        d = self.dialect

        def op(conn: Any, _: list[str]) -> Page[AttemptDigest]:
            if ids is None or len(ids) <= _IDS_PER_READ:
                return digests(conn, d, ids, after, limit)
            items = [
                found
                for n in range(0, len(ids), _IDS_PER_READ)
                for found in digests(conn, d, ids[n : n + _IDS_PER_READ], after, limit).items
            ]
            items.sort(key=lambda found: found.stamp)
            more = len(items) > limit
            return Page(items=items[:limit], next_cursor=str(items[limit - 1].stamp) if more else None)

        return await self._db.call(op, write=False)

    async def search_rollouts(self, query: RolloutSearch) -> RolloutMatches:
        d = self.dialect
        return await self._db.call(lambda conn, _: search(conn, d, query), write=False)

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


def digests(
    conn: Any, d: Dialect, rollout_ids: Sequence[str] | None, after: int, limit: int
) -> Page[AttemptDigest]:
    """Digests of latest attempts stamped after ``after``, by stamp (one more read to see if more)."""
    p = d.param
    where = [f"d.stamp > {p}", f"d.attempt_id={LATEST_ATTEMPT.format(t='d')}"]
    args: list[Any] = [after]
    if rollout_ids is not None:
        where.append(f"d.rollout_id IN ({','.join([p] * len(rollout_ids))})" if rollout_ids else "1=0")
        args += list(rollout_ids)
    rows = conn.execute(
        f"SELECT {_DIGEST_FIELDS} FROM digests d WHERE {' AND '.join(where)} ORDER BY d.stamp LIMIT {p}",
        (*args, limit + 1),
    ).fetchall()
    items = _digests_of(rows[:limit])
    return Page(items=items, next_cursor=str(items[-1].stamp) if len(rows) > limit else None)


def search(conn: Any, d: Dialect, q: RolloutSearch) -> RolloutMatches:
    """The matching rollouts' positions in order (joined with the latest attempts' digests only for a
    filter or sort on them), then the page's rollouts and digests by position."""
    p = d.param
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
    for sort, bound, op in (
        ("reward", q.reward_min, ">="),
        ("reward", q.reward_max, "<="),
        ("calls", q.calls_min, ">="),
        ("calls", q.calls_max, "<="),
    ):
        if bound is not None:
            where.append(f"{_sort_value(sort, d)} {op} {p}")
            args.append(bound)
    for key, wanted in (q.metadata or {}).items():
        where.append(d.metadata_is.format(p=p))
        args += [key, orjson.dumps(wanted).decode()]
    if q.text:
        needle = q.text.lower()
        lower = "lower" if needle.isascii() else d.lower
        reply = d.contains.format(f"{lower}({_REPLY})", p)
        where.append(f"({d.contains.format('r.search_text', p)} OR {_DIGEST_IN}{reply}))")
        args += [needle, needle]
    bounds = (q.reward_min, q.reward_max, q.calls_min, q.calls_max)
    join = q.sort in ("reward", "calls") or q.agent is not None or q.error_type is not None
    join = join or any(bound is not None for bound in bounds)
    sql = f"SELECT r.pos, COUNT(*) OVER () FROM rollouts r{_WITH_DIGEST if join else ''}"
    if where:
        sql += " WHERE " + " AND ".join(where)
    order = f"{_sort_value(q.sort, d)} {'DESC' if q.descending else 'ASC'} NULLS LAST, r.pos DESC"
    rows = conn.execute(f"{sql} ORDER BY {order} LIMIT {p} OFFSET {p}", (*args, q.limit, q.offset)).fetchall()
    if not rows:
        total = conn.execute(f"SELECT COUNT(*) FROM ({sql}) c", args).fetchone()[0] if q.offset else 0
        return RolloutMatches(items=[], total=total)
    found = {
        row[0]: row[1:]
        for row in conn.execute(
            f"SELECT r.pos, r.data, {_DIGEST_FIELDS} FROM rollouts r{_WITH_DIGEST} WHERE r.pos IN ({','.join([p] * len(rows))})",
            [row[0] for row in rows],
        )
    }
    page = [found[pos] for pos, _ in rows]
    known = iter(_digests_of([row[1:] for row in page if row[1] is not None]))
    items = _LISTED.validate_python(
        [
            {
                "rollout": Rollout.model_validate_json(row[0]),
                "digest": None if row[1] is None else next(known),
            }
            for row in page
        ]
    )
    return RolloutMatches(items=items, total=rows[0][1])
