"""The rollout list's search, sorts and filters give the same answers on every store backend.

Each backend gets the same rollouts, written through the store API with a stepping clock (so creation
times and durations are distinct and known): ties in reward, rollouts without one, a running one, a
failed one, one whose last reply holds the search word. The expected orders are written out by hand.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agl import semconv as sc
from agl.dashboard import create_dashboard
from agl.schemas import AttemptStatus, RolloutCreate, Span
from agl.store import InMemoryLightningStore, SqliteLightningStore, StoreWithReadModel
from tests.store.remote_backends import postgres_store


class Clock:
    """Store time that moves one second per reading: every timestamp differs and is predictable."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@contextlib.asynccontextmanager
async def backend(kind: str, tmp_path: Path, clock: Callable[[], float]) -> AsyncIterator[StoreWithReadModel]:
    if kind == "postgres":
        async with postgres_store(clock) as pg:
            yield pg
        return
    store: StoreWithReadModel = (
        InMemoryLightningStore(clock=clock, watchdog_interval_s=0)
        if kind == "memory"
        else SqliteLightningStore(tmp_path / "s.db", clock=clock, watchdog_interval_s=0)
    )
    try:
        yield store
    finally:
        await store.aclose()


def reply(rid: str, aid: str, text: str) -> Span:
    return Span.new(
        rid,
        aid,
        sc.SPAN_LLM_CALL,
        {
            sc.LLM_API: "chat.completions",
            sc.LLM_REQUEST_MESSAGES: [{"role": "user", "content": "q"}],
            sc.LLM_RESPONSE_MESSAGE: {"role": "assistant", "content": text},
        },
    )


def reward(rid: str, aid: str, value: float, agent: str | None = None) -> Span:
    return Span.new(
        rid, aid, sc.SPAN_REWARD, {sc.REWARD_VALUE: value, **({sc.AGENT_NAME: agent} if agent else {})}
    )


async def fill(store: StoreWithReadModel) -> list[str]:
    """r0..r7, oldest first: rewards 0.5, 0.9 (agent a1), 0.5, none, failed, 0.1 ("zebra" reply),
    running with 0.7 so far, queued."""
    created = await store.enqueue_rollouts([RolloutCreate(input={"n": n, "word": f"w{n}"}) for n in range(8)])
    ids = [r.rollout_id for r in created]
    plan: list[tuple[list[Callable[[str, str], Span]], AttemptStatus | None]] = [
        ([lambda r, a: reward(r, a, 0.5)], AttemptStatus.SUCCEEDED),
        ([lambda r, a: reward(r, a, 0.9, "a1")], AttemptStatus.SUCCEEDED),
        ([lambda r, a: reward(r, a, 0.5)], AttemptStatus.SUCCEEDED),
        ([lambda r, a: reply(r, a, "no reward here")], AttemptStatus.SUCCEEDED),
        (
            [lambda r, a: Span.new(r, a, sc.SPAN_EXCEPTION, {sc.EXCEPTION_TYPE: "ValueError"})],
            AttemptStatus.FAILED,
        ),
        (
            [lambda r, a: reply(r, a, "A Zebra crossed"), lambda r, a: reward(r, a, 0.1)],
            AttemptStatus.SUCCEEDED,
        ),
        ([lambda r, a: reward(r, a, 0.7)], None),  # still running
    ]
    for n, (spans, status) in enumerate(plan):
        claimed = await store.dequeue("w")
        assert claimed is not None and claimed.rollout.rollout_id == ids[n]
        rid, aid = ids[n], claimed.attempt.attempt_id
        await store.add_spans([make(rid, aid) for make in spans])
        for _ in range(n % 3):  # different run times: r2 and r5 run longest
            await store.heartbeat(rid, aid)
        if status is not None:
            await store.update_attempt(rid, aid, status=status)
    return ids


def names(page: dict[str, Any], ids: list[str]) -> list[str]:
    return [f"r{ids.index(r['rollout_id'])}" for r in page["items"]]


@pytest.mark.parametrize("kind", ["memory", "sqlite", "postgres"])
async def test_sorts_search_filters_and_pages_agree_on_every_backend(kind: str, tmp_path: Path) -> None:
    async with backend(kind, tmp_path, Clock()) as store:
        ids = await fill(store)
        app = create_dashboard(store)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://ui") as http:

            async def get(**params: Any) -> dict[str, Any]:
                response = await http.get("/ui/api/rollouts", params=params)
                assert response.status_code == 200, response.text
                return response.json()  # type: ignore[no-any-return]

            # rewards high to low, ties newest first, no reward last (newest first)
            by_reward = ["r1", "r6", "r2", "r0", "r5", "r7", "r4", "r3"]
            assert names(await get(sort="reward"), ids) == by_reward
            assert names(await get(sort="reward", order="asc"), ids) == [
                "r5",
                "r2",
                "r0",
                "r6",
                "r1",
                "r7",
                "r4",
                "r3",
            ]
            assert names(await get(sort="created", order="asc"), ids) == [f"r{n}" for n in range(8)]
            slow = await get(sort="duration")
            durations = [r["duration_s"] for r in slow["items"]]
            assert durations[:6] == sorted(durations[:6], reverse=True) and durations[6:] == [None, None]
            assert names(slow, ids)[6:] == ["r7", "r6"]  # not ended: newest first
            assert names(await get(sort="reward", status="succeeded"), ids) == ["r1", "r2", "r0", "r5", "r3"]
            assert names(await get(q="ZEBRA"), ids) == ["r5"]  # the last reply, any case
            assert names(await get(q='"word": "w4"'.replace(" ", "")), ids) == ["r4"]  # the input as JSON
            assert names(await get(q=ids[3][-6:]), ids) == ["r3"]  # the id
            assert names(await get(error="ValueError"), ids) == ["r4"]
            assert [(r["agent"], r["reward"]) for r in (await get(agent="a1"))["items"]] == [("a1", 0.9)]
            # numeric filters on the reward (inclusive; no reward never matches), with a sort or alone
            assert names(await get(reward_max="0.5"), ids) == ["r5", "r2", "r0"]
            assert names(await get(reward_min="0.6", sort="reward", order="asc"), ids) == ["r6", "r1"]
            bad = await http.get("/ui/api/rollouts", params={"reward_min": "high"})
            assert bad.status_code == 422 and bad.json()["error"]["field"] == "reward_min"
            seen: list[str] = []
            cursor = ""
            while True:
                page = await get(sort="reward", limit=3, cursor=cursor)
                seen += names(page, ids)
                assert page["total"] == 8
                if not (cursor := page["next_cursor"]):
                    break
            assert seen == by_reward
            # the running rollout finishes with a new best reward: the next answer follows (no cache)
            (attempt,) = (await store.query_attempts(rollout_id=ids[6])).items
            await store.add_spans([reward(ids[6], attempt.attempt_id, 1.0)])
            await store.update_attempt(ids[6], attempt.attempt_id, status=AttemptStatus.SUCCEEDED)
            assert names(await get(sort="reward"), ids)[:2] == ["r6", "r1"]
