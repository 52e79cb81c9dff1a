"""``search_rollouts``: text search, filters, sorts and pages answered by the store, alike on every backend.

Six rollouts written through the store API with a hand-moved clock (known run times): ties in reward,
rollouts without one, a retried one whose old attempt's reply must no longer match, a running one, a
queued one. Expected orders are written out by hand.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from agl import semconv as sc
from agl.schemas import AttemptStatus, RolloutCreate, Span
from agl.store import SqliteLightningStore, StoreWithReadModel
from agl.store.read_model import RolloutSearch
from tests.store.conftest import FakeClock
from tests.store.remote_backends import PG_DSN, postgres_store, serve


def reply(rid: str, aid: str, text: str) -> Span:
    message = {"role": "assistant", "content": text}
    return Span.new(
        rid, aid, sc.SPAN_LLM_CALL, {sc.LLM_API: "chat.completions", sc.LLM_RESPONSE_MESSAGE: message}
    )


def reward(rid: str, aid: str, value: float, agent: str) -> Span:
    return Span.new(rid, aid, sc.SPAN_REWARD, {sc.REWARD_VALUE: value, sc.AGENT_NAME: agent})


async def fill(store: StoreWithReadModel, clock: FakeClock) -> dict[str, str]:
    """a..f, oldest first (name -> rollout id): a (reward 0.5, ran 3 s), b (0.9, 1 s) and c (0.5, 2 s)
    succeeded; d failed with a ValueError after 5 s; e failed once and runs again; f is queued."""
    v1 = (await store.add_resources({})).resources_id
    v2 = (await store.add_resources({})).resources_id
    creates = {
        "a": RolloutCreate(
            input={"q": "Apple pie", "n": 1}, group_id="g1", resources_id=v1, metadata={"step": 1}
        ),
        "b": RolloutCreate(
            input="ÉCOLE normale", mode="val", group_id="g1", resources_id=v1, metadata={"step": 1}
        ),
        "c": RolloutCreate(
            input={"q": "100% sure_thing"}, group_id="g2", resources_id=v2, metadata={"step": 2, "tag": "x"}
        ),
        "d": RolloutCreate(input={"q": "none"}, resources_id=v2, metadata={"step": 2}),
        "e": RolloutCreate(input={"q": "retried"}, retry={"max_attempts": 2, "retry_on": ["failed"]}),
    }
    ids = {}
    for name, create in creates.items():  # one second apart: created in this order
        ids[name] = (await store.enqueue_rollouts([create]))[0].rollout_id
        clock.advance(1)
    plans: dict[str, tuple[list[Any], AttemptStatus | None, float]] = {
        "a": (
            [lambda r, a: reply(r, a, "CRÈME brûlée"), lambda r, a: reward(r, a, 0.5, "solver")],
            AttemptStatus.SUCCEEDED,
            3,
        ),
        "b": (
            [lambda r, a: reply(r, a, "ok"), lambda r, a: reward(r, a, 0.9, "judge")],
            AttemptStatus.SUCCEEDED,
            1,
        ),
        "c": ([lambda r, a: reward(r, a, 0.5, "solver")], AttemptStatus.SUCCEEDED, 2),
        "d": (
            [lambda r, a: Span.new(r, a, sc.SPAN_EXCEPTION, {sc.EXCEPTION_TYPE: "ValueError"})],
            AttemptStatus.FAILED,
            5,
        ),
        "e": ([lambda r, a: reply(r, a, "a stale walrus")], AttemptStatus.FAILED, 1),  # retried below
    }
    for name, (spans, status, run_s) in plans.items():
        claimed = await store.dequeue("w")
        assert claimed is not None and claimed.rollout.rollout_id == ids[name]
        await store.add_spans([make(ids[name], claimed.attempt.attempt_id) for make in spans])
        clock.advance(run_s)
        await store.update_attempt(ids[name], claimed.attempt.attempt_id, status=status)
    again = await store.dequeue("w")  # e's second attempt: still running
    assert again is not None and again.rollout.rollout_id == ids["e"]
    await store.add_spans(
        [
            reply(ids["e"], again.attempt.attempt_id, "a fresh Otter"),
            reward(ids["e"], again.attempt.attempt_id, 0.1, "solver"),
        ]
    )
    ids["f"] = (await store.enqueue_rollouts([RolloutCreate(input={"q": "queued"})]))[0].rollout_id
    return ids


async def names(store: StoreWithReadModel, ids: dict[str, str], **query: Any) -> list[str]:
    by_id = {v: k for k, v in ids.items()}
    found = await store.search_rollouts(RolloutSearch(**query))
    assert found.total == len(found.items)
    return [by_id[x.rollout.rollout_id] for x in found.items]


async def test_search_filters_sorts_and_pages(store: StoreWithReadModel, clock: FakeClock) -> None:
    ids = await fill(store, clock)
    # sorts: no value (no reward, not ended) last; ties and the valueless newest first, either way
    assert await names(store, ids) == ["f", "e", "d", "c", "b", "a"]
    assert await names(store, ids, descending=False) == ["a", "b", "c", "d", "e", "f"]
    assert await names(store, ids, sort="reward") == ["b", "c", "a", "e", "f", "d"]
    assert await names(store, ids, sort="reward", descending=False) == ["e", "c", "a", "b", "f", "d"]
    assert await names(store, ids, sort="duration") == ["d", "a", "c", "b", "f", "e"]
    assert await names(store, ids, sort="duration", descending=False) == ["b", "c", "a", "d", "f", "e"]
    # text: case-insensitive substring of the id, the input (compact JSON, or a string as itself) or the
    # latest attempt's last reply; no wildcard characters
    assert await names(store, ids, text=ids["a"][3:9].upper()) == ["a"]
    assert await names(store, ids, text='"N":1') == ["a"]
    assert await names(store, ids, text="école") == ["b"]
    assert await names(store, ids, text="crème BRÛLÉE") == ["a"]  # letters past ASCII, in the reply
    assert await names(store, ids, text="otter") == ["e"]
    assert await names(store, ids, text="walrus") == []  # the failed attempt's reply is not e's any more
    assert await names(store, ids, text="%") == await names(store, ids, text="_") == ["c"]
    # filters
    assert await names(store, ids, status=["failed"]) == ["d"]
    assert await names(store, ids, status=[]) == []
    assert await names(store, ids, mode="val") == ["b"]
    assert await names(store, ids, group_id="g1", sort="reward", descending=False) == ["a", "b"]
    v1 = (await store.get_rollout(ids["a"])).resources_id
    assert await names(store, ids, resources_id=v1) == ["b", "a"]
    assert await names(store, ids, agent="solver") == ["e", "c", "a"]
    assert await names(store, ids, error_type="ValueError") == ["d"]
    # reward bounds (inclusive) on the latest attempt's final reward; no reward never matches
    assert await names(store, ids, reward_min=0.5) == ["c", "b", "a"]
    assert await names(store, ids, reward_max=0.5, sort="reward") == ["c", "a", "e"]
    assert await names(store, ids, reward_min=0.2, reward_max=0.6) == ["c", "a"]
    assert await names(store, ids, reward_min=0.95) == []
    assert (
        await names(store, ids, metadata={"step": 1})
        == await names(store, ids, metadata={"step": 1.0})
        == ["b", "a"]
    )
    assert await names(store, ids, metadata={"step": 2, "tag": "x"}) == ["c"]
    assert await names(store, ids, metadata={"step": "1"}) == []  # JSON types differ
    assert await names(store, ids, text='"q":', agent="solver", sort="reward", descending=False) == [
        "e",
        "c",
        "a",
    ]
    # pages: offset into the order, with the total of every match
    first = await store.search_rollouts(RolloutSearch(sort="reward", limit=4))
    rest = await store.search_rollouts(RolloutSearch(sort="reward", limit=4, offset=4))
    beyond = await store.search_rollouts(RolloutSearch(sort="reward", limit=4, offset=10))
    assert (first.total, rest.total, beyond.total, beyond.items) == (6, 6, 6, [])
    assert [x.rollout.rollout_id for x in first.items + rest.items] == [
        ids[n] for n in ["b", "c", "a", "e", "f", "d"]
    ]
    # each match carries its latest attempt's digest
    listed = {x.rollout.rollout_id: x for x in (await store.search_rollouts(RolloutSearch())).items}
    a, e, f = listed[ids["a"]], listed[ids["e"]], listed[ids["f"]]
    assert a.digest is not None and (a.digest.reply, a.digest.reward, a.digest.agent) == (
        "CRÈME brûlée",
        0.5,
        "solver",
    )
    attempts = (await store.query_attempts(rollout_id=ids["e"])).items
    assert e.digest is not None and (e.digest.attempt_id, e.digest.reply) == (
        attempts[-1].attempt_id,
        "a fresh Otter",
    )
    assert f.digest is None and f.rollout.status == "queuing"


def test_a_bad_search_names_its_field() -> None:
    for fields, field in (
        ({"sort": "size"}, "sort"),
        ({"limit": 0}, "limit"),
        ({"offset": -1}, "offset"),
        ({"metadata": {'a"b': 1}}, "metadata"),
        ({"status": ["done"]}, "status"),
    ):
        with pytest.raises(ValidationError, match=field):
            RolloutSearch(**fields)


async def test_the_server_refuses_a_bad_search_with_a_4xx(tmp_path: Path) -> None:
    store = SqliteLightningStore(tmp_path / "s.db", watchdog_interval_s=0)
    async with serve(store) as client, httpx.AsyncClient(base_url=client.url) as http:
        for body, field in (
            ({"sort": "size"}, "sort"),
            ({"metadata": {'a"b': 1}}, "metadata"),
            ({"limit": 10**6}, "limit"),
            ({"offset": 10**20}, "offset"),
        ):
            response = await http.post("/v1/agl/rollouts/search", json=body)
            assert response.status_code == 422 and field in response.text, response.text


async def test_a_sqlite_file_from_before_the_search_columns_gets_them_when_opened(tmp_path: Path) -> None:
    clock = FakeClock()
    path = tmp_path / "old.db"
    store = SqliteLightningStore(path, clock=clock, watchdog_interval_s=0)
    ids = await fill(store, clock)
    await store.aclose()
    with sqlite3.connect(path) as conn:  # what an older agl left: no search columns
        for column in ("attempt_id", "resources_id", "duration", "search_text"):
            conn.execute(f"ALTER TABLE rollouts DROP COLUMN {column}")
    store = SqliteLightningStore(path, clock=clock, watchdog_interval_s=0)
    try:
        await check_upgraded(store, ids)
    finally:
        await store.aclose()


async def test_a_postgres_schema_from_before_the_search_columns_gets_them_when_opened() -> None:
    import psycopg

    from agl.store.postgres import PostgresLightningStore

    clock = FakeClock()
    async with postgres_store(clock) as store:
        ids = await fill(store, clock)
        schema = store.schema  # type: ignore[attr-defined]
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            for column in ("attempt_id", "resources_id", "duration", "search_text"):
                conn.execute(f'ALTER TABLE "{schema}".rollouts DROP COLUMN {column}')
        reopened = PostgresLightningStore(PG_DSN, schema=schema, clock=clock, watchdog_interval_s=0)
        try:
            await check_upgraded(reopened, ids)
        finally:
            await reopened.aclose()


async def check_upgraded(store: StoreWithReadModel, ids: dict[str, str]) -> None:
    assert await names(store, ids, sort="reward") == ["b", "c", "a", "e", "f", "d"]
    assert await names(store, ids, sort="duration") == ["d", "a", "c", "b", "f", "e"]
    assert await names(store, ids, text="école") == ["b"]
    assert await names(store, ids, text="walrus") == []
    v1 = (await store.get_rollout(ids["a"])).resources_id
    assert await names(store, ids, resources_id=v1) == ["b", "a"]
