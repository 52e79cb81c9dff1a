"""The store's attempt digests (what the rollout list searches, filters and sorts on) say what the
spans say, on every backend and through the HTTP client; and the list's search follows new spans, late
spans and retries without serving a stale answer."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl import semconv as sc
from agl.dashboard import create_dashboard, training
from agl.dashboard.views import reward_facts
from agl.schemas import AttemptStatus, RolloutCreate, Span
from agl.store import InMemoryLightningStore, SqliteLightningStore, StoreWithReadModel
from tests.store.remote_backends import postgres_store, serve

KINDS = ["memory", "sqlite", "postgres", "http-sqlite"]


@contextlib.asynccontextmanager
async def backend(kind: str, tmp_path: Path) -> AsyncIterator[StoreWithReadModel]:
    if kind == "postgres":
        async with postgres_store() as pg:
            yield pg
        return
    if kind == "http-sqlite":
        async with serve(SqliteLightningStore(tmp_path / "h.db", watchdog_interval_s=0)) as client:
            yield client
        return
    store: StoreWithReadModel = (
        InMemoryLightningStore(watchdog_interval_s=0)
        if kind == "memory"
        else SqliteLightningStore(tmp_path / "s.db", watchdog_interval_s=0)
    )
    try:
        yield store
    finally:
        await store.aclose()


def call(
    rid: str, aid: str, text: str | None, *, source: str = "gateway", response_id: str = "", tools: Any = None
) -> Span:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tools:
        message["tool_calls"] = [
            {"id": "c1", "type": "function", "function": {"name": t, "arguments": "{}"}} for t in tools
        ]
    attributes = {sc.LLM_API: "chat.completions", sc.LLM_SOURCE: source, sc.LLM_RESPONSE_MESSAGE: message}
    if response_id:
        attributes[sc.LLM_RESPONSE_ID] = response_id
    return Span.new(rid, aid, sc.SPAN_LLM_CALL, attributes)


def reward(
    rid: str, aid: str, value: float, *, agent: str | None = None, response_id: str | None = None
) -> Span:
    attributes: dict[str, Any] = {sc.REWARD_VALUE: value}
    if agent:
        attributes[sc.AGENT_NAME] = agent
    if response_id:
        attributes[sc.REWARD_RESPONSE_ID] = response_id
    return Span.new(rid, aid, sc.SPAN_REWARD, attributes)


def error(rid: str, aid: str, kind: str) -> Span:
    return Span.new(rid, aid, sc.SPAN_EXCEPTION, {sc.EXCEPTION_TYPE: kind})


# each plan: the spans of one attempt, added in this order (each its own batch, then all at once)
PLANS: list[list[Any]] = [
    # the gateway's call, then a tracer's record of the same response: the gateway's text wins
    [
        lambda r, a: call(r, a, "gateway says 4", response_id="x1"),
        lambda r, a: call(r, a, "traced 4", source="openinference", response_id="x1"),
    ],
    # a gateway call, then a direct call only a tracer saw: that one is the last reply
    [
        lambda r, a: call(r, a, "first", response_id="x2"),
        lambda r, a: call(r, a, "direct last", source="openinference", response_id="y2"),
    ],
    # tool calls only; linked and unlinked rewards; the agent is named on the second reward span
    [
        lambda r, a: call(r, a, None, tools=["lookup", "add"]),
        lambda r, a: reward(r, a, 0.25),
        lambda r, a: reward(r, a, 0.75, agent="solver"),
        lambda r, a: reward(r, a, 0.1, response_id="z", agent="judge"),
    ],
    # only a reward for one response: it is the final reward
    [lambda r, a: reward(r, a, 0.4, response_id="z")],
    # two exceptions: the last one's type
    [
        lambda r, a: error(r, a, "KeyError"),
        lambda r, a: call(r, a, "oops"),
        lambda r, a: error(r, a, "ValueError"),
    ],
    # nothing a digest keeps
    [lambda r, a: Span.new(r, a, "tool", {"x": 1})],
]


def expected(spans: list[Span]) -> tuple[str, str | None, float | None, str | None]:
    """(reply, error type, reward, agent) as the dashboard's own span readers say."""
    errors = [s for s in spans if s.name == sc.SPAN_EXCEPTION]
    kind = str(errors[-1].attributes.get(sc.EXCEPTION_TYPE)) if errors else None
    rewarded, agent = reward_facts([s for s in spans if s.name == sc.SPAN_REWARD])
    return training.output_text(spans), kind, rewarded, agent


@pytest.mark.parametrize("together", [False, True], ids=["span-by-span", "one-batch"])
@pytest.mark.parametrize("kind", KINDS)
async def test_digests_say_what_the_spans_say(kind: str, together: bool, tmp_path: Path) -> None:
    async with backend(kind, tmp_path) as store:
        created = await store.enqueue_rollouts([RolloutCreate(input=n) for n in range(len(PLANS))])
        ids = [r.rollout_id for r in created]
        for rid, plan in zip(ids, PLANS, strict=True):
            claimed = await store.dequeue("w")
            assert claimed is not None
            spans = [make(rid, claimed.attempt.attempt_id) for make in plan]
            for batch in [spans] if together else [[s] for s in spans]:
                await store.add_spans(batch)
        digests = {d.rollout_id: d for d in (await store.query_digests(rollout_ids=ids)).items}
        assert set(digests) == set(ids[:-1])  # the last one has nothing to keep
        for rid in ids[:-1]:
            spans = (await store.query_spans(rollout_id=rid, attempt_id="latest")).items
            d = digests[rid]
            assert (d.reply or "", d.error_type, d.reward, d.agent) == expected(spans), rid
        assert digests[ids[0]].reply == "gateway says 4" and digests[ids[1]].reply == "direct last"
        assert digests[ids[2]].reply == " [tool call lookup] [tool call add]"
        assert (digests[ids[2]].reward, digests[ids[2]].agent) == (0.75, "solver")


@pytest.mark.parametrize("kind", KINDS)
async def test_stamps_name_what_changed_and_a_retry_starts_a_new_digest(kind: str, tmp_path: Path) -> None:
    async with backend(kind, tmp_path) as store:
        a, b = await store.enqueue_rollouts(
            [
                RolloutCreate(input="a", retry={"max_attempts": 2, "retry_on": ["failed"]}),
                RolloutCreate(input="b"),
            ]
        )
        first_a, first_b = await store.dequeue("w"), await store.dequeue("w")
        assert first_a is not None and first_b is not None
        await store.add_spans([call(a.rollout_id, first_a.attempt.attempt_id, "a says 1")])
        await store.add_spans([call(b.rollout_id, first_b.attempt.attempt_id, "b says 1")])
        everything = (await store.query_digests()).items
        assert [d.rollout_id for d in everything] == [a.rollout_id, b.rollout_id]
        seen = everything[-1].stamp
        assert (await store.query_digests(after=seen)).items == []
        # a finished rollout's late span: only that digest is new
        await store.update_attempt(b.rollout_id, first_b.attempt.attempt_id, status=AttemptStatus.SUCCEEDED)
        await store.add_spans([call(b.rollout_id, first_b.attempt.attempt_id, "b says 2")])
        (changed,) = (await store.query_digests(after=seen)).items
        assert (changed.rollout_id, changed.reply) == (b.rollout_id, "b says 2") and changed.stamp > seen
        # pages: by stamp, ``next_cursor`` is the stamp to continue after
        page = await store.query_digests(limit=1)
        assert page.next_cursor is not None and len(page.items) == 1
        rest = await store.query_digests(after=int(page.next_cursor))
        assert [d.rollout_id for d in page.items + rest.items] == [a.rollout_id, b.rollout_id]
        # a retry: the new attempt has no digest yet, and the old one's is no longer the rollout's
        await store.update_attempt(a.rollout_id, first_a.attempt.attempt_id, status=AttemptStatus.FAILED)
        again = await store.dequeue("w")
        assert again is not None and again.rollout.rollout_id == a.rollout_id
        assert [d.rollout_id for d in (await store.query_digests()).items] == [b.rollout_id]
        await store.add_spans([call(a.rollout_id, again.attempt.attempt_id, "a says 2")])
        (retried,) = (await store.query_digests(rollout_ids=[a.rollout_id])).items
        assert (retried.attempt_id, retried.reply) == (again.attempt.attempt_id, "a says 2")


async def test_a_store_file_from_before_digests_gets_them_when_opened(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    store = SqliteLightningStore(path, watchdog_interval_s=0)
    (rollout,) = await store.enqueue_rollouts([RolloutCreate(input="q")])
    claimed = await store.dequeue("w")
    assert claimed is not None
    aid = claimed.attempt.attempt_id
    await store.add_spans(
        [call(rollout.rollout_id, aid, "old reply"), reward(rollout.rollout_id, aid, 0.5, agent="x")]
    )
    await store.aclose()
    with sqlite3.connect(path) as conn:  # what an older agl left: no digests table, no counter
        conn.execute("DROP TABLE digests")
        conn.execute("DELETE FROM counters WHERE name='digests'")
    for _ in range(2):  # the second opening finds them written and writes nothing
        store = SqliteLightningStore(path, watchdog_interval_s=0)
        (d,) = (await store.query_digests()).items
        assert (d.rollout_id, d.reply, d.reward, d.agent) == (rollout.rollout_id, "old reply", 0.5, "x")
        await store.aclose()


async def assert_found(get: Any, query: str, want: list[str]) -> None:
    """The search answers from the store: what was just written is found at once."""
    found = [r["rollout_id"] for r in (await get(q=query))["items"]]
    assert found == want, f"search {query!r} found {found}, not {want}"


@pytest.mark.parametrize("kind", KINDS)
async def test_search_follows_new_late_and_retried_spans(kind: str, tmp_path: Path) -> None:
    async with backend(kind, tmp_path) as store:
        a, b = await store.enqueue_rollouts(
            [
                RolloutCreate(input="alpha", retry={"max_attempts": 2, "retry_on": ["failed"]}),
                RolloutCreate(input="beta"),
            ]
        )
        first_a, first_b = await store.dequeue("w"), await store.dequeue("w")
        assert first_a is not None and first_b is not None
        aid_a, aid_b = first_a.attempt.attempt_id, first_b.attempt.attempt_id
        await store.add_spans([call(a.rollout_id, aid_a, "the walrus sings")])
        await store.add_spans(
            [call(b.rollout_id, aid_b, "the heron waits"), error(b.rollout_id, aid_b, "KeyError")]
        )
        app = create_dashboard(store)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ui") as http:

            async def get(**params: Any) -> dict[str, Any]:
                response = await http.get("/ui/api/rollouts", params=params)
                assert response.status_code == 200, response.text
                return response.json()  # type: ignore[no-any-return]

            # a fresh dashboard: its first search finds the replies
            assert [r["rollout_id"] for r in (await get(q="WALRUS"))["items"]] == [a.rollout_id]
            assert [r["rollout_id"] for r in (await get(error="KeyError"))["items"]] == [b.rollout_id]
            # a running rollout's new reply replaces its old one in the search
            await store.add_spans([call(a.rollout_id, aid_a, "the otter swims")])
            await assert_found(get, "otter", [a.rollout_id])
            assert (await get(q="walrus"))["items"] == []
            # a finished rollout's late spans are searched too
            await store.update_attempt(b.rollout_id, aid_b, status=AttemptStatus.SUCCEEDED)
            await assert_found(get, "heron", [b.rollout_id])
            await store.add_spans(
                [call(b.rollout_id, aid_b, "the crane flies"), error(b.rollout_id, aid_b, "OSError")]
            )
            await assert_found(get, "crane", [b.rollout_id])
            assert [r["rollout_id"] for r in (await get(error="OSError"))["items"]] == [b.rollout_id]
            # a retried rollout: the failed attempt's reply is not the rollout's any more
            await store.update_attempt(a.rollout_id, aid_a, status=AttemptStatus.FAILED)
            again = await store.dequeue("w")
            assert again is not None and again.rollout.rollout_id == a.rollout_id
            await assert_found(get, "otter", [])
            await store.add_spans([call(a.rollout_id, again.attempt.attempt_id, "the lynx hides")])
            await assert_found(get, "lynx", [a.rollout_id])
