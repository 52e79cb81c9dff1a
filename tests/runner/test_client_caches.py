"""Frameworks' per-URL client caches are let go when a rollout ends: each rollout has its own gateway URL,
so LangChain's ChatOpenAI would otherwise keep an httpx client pair (and a TLS context each) per rollout."""

from __future__ import annotations

import asyncio

from langchain_openai import ChatOpenAI
from langchain_openai.chat_models import _client_utils

import agl
from agl.runner.client_caches import release_client_caches
from agl.schemas import LLM, AttemptStatus, RolloutCreate
from agl.store import InMemoryLightningStore


def _cached() -> int:
    caches = (_client_utils._cached_sync_httpx_client, _client_utils._cached_async_httpx_client)
    return sum(c.cache_info().currsize for c in caches)


async def test_a_finished_rollouts_chatopenai_clients_leave_the_cache() -> None:
    store = InMemoryLightningStore()
    await store.add_resources(
        {"main": LLM(endpoint="http://127.0.0.1:9/rollout/{rollout_id}/attempt/{attempt_id}/v1", model="m")}
    )
    release_client_caches()
    during: list[int] = []

    @agl.rollout
    async def agent(task: int, llm: LLM) -> float:
        ChatOpenAI(base_url=llm.endpoint, api_key="unused", model=llm.model)  # as the recipes' agents do
        during.append(_cached())
        await asyncio.sleep(0.01)
        return 1.0

    await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(12)])
    outcomes = await agl.Runner(agent, store, poll_interval_s=0.01, max_concurrency=4).run(max_rollouts=12)
    assert all(o.status == AttemptStatus.SUCCEEDED for o in outcomes)
    assert max(during) >= 2  # a rollout's own URL was cached while it ran (sync + async clients)...
    assert _cached() == 0  # ...and let go when it ended, instead of 24 clients for 12 rollouts


def test_release_counts_the_clients_it_lets_go_and_ignores_frameworks_not_imported() -> None:
    release_client_caches()
    for n in range(3):
        ChatOpenAI(base_url=f"http://127.0.0.1:9/rollout/r{n}/v1", api_key="unused", model="m")
    assert release_client_caches() == 6 and _cached() == 0
    assert release_client_caches() == 0
