"""The digest's counts: model calls, their replies' tool calls and completion tokens, kept as spans arrive
on every backend; a call the gateway and a client-side tracer both recorded counts once; search filters
and sorts on the calls; a store from before the counts gets them from its spans when opened."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from agl import semconv as sc
from agl.adapter.behaviour import rollout_behaviour
from agl.schemas import AttemptStatus, RolloutCreate, Span
from agl.store import SqliteLightningStore, StoreWithReadModel
from agl.store._sql_schema import COUNT_COLUMNS
from agl.store.read_model import RolloutSearch
from tests.store.remote_backends import PG_DSN, postgres_store


def call(
    rid: str,
    aid: str,
    *,
    source: str = "gateway",
    response_id: str = "",
    tools: tuple[str, ...] = (),
    tokens: int = 0,
    token_ids: int | None = None,
) -> Span:
    """A model call span; ``tokens``: the usage reported, ``token_ids``: the engine's ids (their number)."""
    message: dict[str, Any] = {"role": "assistant", "content": "ok"}
    if tools:
        message["tool_calls"] = [
            {"id": f"c{n}", "type": "function", "function": {"name": t, "arguments": "{}"}}
            for n, t in enumerate(tools)
        ]
    attributes: dict[str, Any] = {
        sc.LLM_API: "chat.completions",
        sc.LLM_SOURCE: source,
        sc.LLM_RESPONSE_MESSAGE: message,
        sc.LLM_USAGE: {"completion_tokens": tokens},
    }
    if response_id:
        attributes[sc.LLM_RESPONSE_ID] = response_id
    if token_ids is not None:
        attributes[sc.LLM_COMPLETION_TOKEN_IDS] = list(range(token_ids))
    return Span.new(rid, aid, sc.SPAN_LLM_CALL, attributes)


# name -> the spans of its one attempt, and its (calls, tool calls, completion tokens)
PLANS: dict[str, tuple[list[Any], tuple[int, int, int]]] = {
    # two gateway calls, the first also recorded by a client-side tracer: two calls, the gateway's counts
    "twin": (
        [
            lambda r, a: call(r, a, response_id="x1", tools=("lookup", "add"), tokens=7),
            lambda r, a: call(
                r, a, source="openinference", response_id="x1", tools=("lookup", "add"), tokens=7
            ),
            lambda r, a: call(r, a, response_id="x2", tokens=99, token_ids=5),  # the engine's ids count
        ],
        (2, 2, 12),
    ),
    # only a tracer saw the calls: its counts
    "traced": (
        [
            lambda r, a, n=n: call(
                r, a, source="openinference", response_id=f"y{n}", tools=("t",) * n, tokens=4
            )
            for n in range(3)
        ],
        (3, 3, 12),
    ),
    # no model call: a digest (the reward) with no counts
    "reward": ([lambda r, a: Span.new(r, a, sc.SPAN_REWARD, {sc.REWARD_VALUE: 1.0})], (0, 0, 0)),
}


async def fill(store: StoreWithReadModel, together: bool) -> dict[str, str]:
    """Each plan's rollout, its spans added one by one or in one batch; and ``queued``, never run."""
    ids: dict[str, str] = {}
    for name, (plan, _) in PLANS.items():
        (rollout,) = await store.enqueue_rollouts([RolloutCreate(input=name)])
        claimed = await store.dequeue("w")
        assert claimed is not None and claimed.rollout.rollout_id == rollout.rollout_id
        spans = [make(rollout.rollout_id, claimed.attempt.attempt_id) for make in plan]
        for batch in [spans] if together else [[s] for s in spans]:
            await store.add_spans(batch)
        await store.update_attempt(
            rollout.rollout_id, claimed.attempt.attempt_id, status=AttemptStatus.SUCCEEDED
        )
        ids[name] = rollout.rollout_id
    ids["queued"] = (await store.enqueue_rollouts([RolloutCreate(input="queued")]))[0].rollout_id
    return ids


async def counts(store: StoreWithReadModel, ids: dict[str, str]) -> dict[str, tuple[int, int, int]]:
    """Each rollout's digest counts, as the search lists them (none listed: a rollout without a digest)."""
    listed = (await store.search_rollouts(RolloutSearch())).items
    by_id = {v: k for k, v in ids.items()}
    return {
        by_id[x.rollout.rollout_id]: (x.digest.calls, x.digest.tool_calls, x.digest.completion_tokens)
        for x in listed
        if x.digest is not None
    }


async def names(store: StoreWithReadModel, ids: dict[str, str], **query: Any) -> list[str]:
    by_id = {v: k for k, v in ids.items()}
    return [by_id[x.rollout.rollout_id] for x in (await store.search_rollouts(RolloutSearch(**query))).items]


@pytest.mark.parametrize("together", [False, True], ids=["span-by-span", "one-batch"])
async def test_counts_are_kept_as_spans_arrive_and_a_twin_counts_once(
    store: StoreWithReadModel, together: bool
) -> None:
    ids = await fill(store, together)
    assert await counts(store, ids) == {name: want for name, (_, want) in PLANS.items()}
    for name in PLANS:  # the same calls and completion tokens the behaviour metrics read from the spans
        spans = (await store.query_spans(rollout_id=ids[name], attempt_id="latest")).items
        (digest,) = (await store.query_digests(rollout_ids=[ids[name]])).items
        did = rollout_behaviour(spans)
        assert (digest.calls, digest.completion_tokens) == (did["calls"], did["completion_tokens"]), name


async def test_search_filters_and_sorts_on_calls(store: StoreWithReadModel) -> None:
    ids = await fill(store, together=False)  # calls: twin 2, traced 3, reward 0, queued 0 (no digest)
    assert await names(store, ids, calls_min=2) == ["traced", "twin"]
    assert await names(store, ids, calls_min=2, calls_max=2) == ["twin"]
    assert await names(store, ids, calls_max=0) == ["queued", "reward"]
    assert await names(store, ids, calls_min=3, calls_max=3) == ["traced"]
    assert await names(store, ids, calls_min=4) == []
    assert await names(store, ids, calls_max=2, reward_min=0.5) == ["reward"]
    assert await names(store, ids, sort="calls") == ["traced", "twin", "queued", "reward"]
    assert await names(store, ids, sort="calls", descending=False) == ["queued", "reward", "twin", "traced"]


def test_a_negative_or_fractional_calls_bound_names_its_field() -> None:
    for fields, field in (({"calls_min": -1}, "calls_min"), ({"calls_max": 1.5}, "calls_max")):
        with pytest.raises(ValidationError, match=field):
            RolloutSearch(**fields)


async def check_counted_again(store: StoreWithReadModel, ids: dict[str, str]) -> None:
    """The counts recomputed from the spans, and counted on from there as new spans arrive."""
    assert await counts(store, ids) == {name: want for name, (_, want) in PLANS.items()}
    assert await names(store, ids, calls_min=2) == ["traced", "twin"]
    attempt = (await store.query_attempts(rollout_id=ids["reward"])).items[-1].attempt_id
    await store.add_spans([call(ids["reward"], attempt, tools=("late",), tokens=3)])
    assert (await counts(store, ids))["reward"] == (1, 1, 3)


async def test_a_sqlite_file_from_before_the_counts_gets_them_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    store = SqliteLightningStore(path, watchdog_interval_s=0)
    ids = await fill(store, together=False)
    await store.aclose()
    with sqlite3.connect(path) as conn:  # what an older agl left: digests without counts
        for column in COUNT_COLUMNS:
            conn.execute(f"ALTER TABLE digests DROP COLUMN {column}")
    store = SqliteLightningStore(path, watchdog_interval_s=0)
    try:
        await check_counted_again(store, ids)
    finally:
        await store.aclose()
    with sqlite3.connect(path) as conn:  # a count the spans do not say: only a new count would undo it
        conn.execute("UPDATE digests SET gw_tokens=1000 WHERE rollout_id=?", (ids["reward"],))
    store = SqliteLightningStore(path, watchdog_interval_s=0)  # opened again: counted once, not again
    try:
        assert (await counts(store, ids))["reward"] == (1, 1, 1000)
    finally:
        await store.aclose()


async def test_a_postgres_schema_from_before_the_counts_gets_them_when_opened() -> None:
    import psycopg

    from agl.store.postgres import PostgresLightningStore

    async with postgres_store() as store:
        ids = await fill(store, together=True)
        schema = store.schema  # type: ignore[attr-defined]
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            for column in COUNT_COLUMNS:
                conn.execute(f'ALTER TABLE "{schema}".digests DROP COLUMN {column}')
        reopened = PostgresLightningStore(PG_DSN, schema=schema, watchdog_interval_s=0)
        try:
            await check_counted_again(reopened, ids)
        finally:
            await reopened.aclose()
