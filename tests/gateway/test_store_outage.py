"""The store goes down for 20 s while agents call the model through the gateway: no LLM-call span is lost.

Real parts: ``agl store serve`` on SQLite in a child process (killed and restarted on the same port and
file), the gateway and a scripted upstream over HTTP, and ``agl.Runner`` running agents that use the
openai SDK. The gateway's span writer holds the spans of the calls made during the outage and writes
them once the store is back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import openai
import pytest

import agl
from agl import semconv as sc
from agl.gateway import Gateway, GatewayConfig
from agl.schemas import AttemptStatus, RetryConfig, RolloutCreate
from agl.store.client import LightningStoreClient
from tests.runner.store_process import StoreProcess
from tests.support.openai_upstream import OpenAIUpstream

OUTAGE_S = 20.0
AGENTS = 4


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_no_llm_call_span_is_lost_through_a_20s_store_outage(
    tmp_path: Path, upstream: OpenAIUpstream
) -> None:
    server = StoreProcess(tmp_path / "store.db")
    await asyncio.to_thread(server.start)
    # a client that gives up fast, so the writers (not the client) ride out the outage
    client = LightningStoreClient(server.url, retries=1, backoff_s=0.05, timeout_s=5)
    gateway = Gateway(client, [upstream.base_url], GatewayConfig(health_interval_s=0.5)).start()
    calls: dict[int, int] = {}  # task -> model calls answered
    outage_calls = 0
    all_calling, store_back = asyncio.Event(), asyncio.Event()
    down = False

    @agl.rollout
    async def agent(task: int, llm: agl.LLM) -> float:
        nonlocal outage_calls
        model = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
        try:
            after = 0
            while after < 2:  # call on through the outage, and twice more once the store is back
                reply = await model.chat.completions.create(
                    model=llm.model, messages=[{"role": "user", "content": f"task {task}"}], max_tokens=4
                )
                assert reply.choices[0].message.content
                calls[task] = calls.get(task, 0) + 1
                outage_calls += down
                if len(calls) == AGENTS:
                    all_calling.set()  # every attempt has been attributed once (the gateway caches it)
                after += store_back.is_set()
                await asyncio.sleep(0.25)
        finally:
            await model.close()
        return 1.0

    runner = agl.Runner(
        agent,
        client,
        max_concurrency=AGENTS,
        poll_interval_s=0.02,
        heartbeat_interval_s=0.5,
        store_backoff_s=0.1,
        max_store_backoff_s=1.0,
        handle_signals=False,
    )
    run: asyncio.Task[list[agl.AttemptOutcome]] | None = None
    try:
        resources = await client.add_resources(
            {"llm": agl.LLM(endpoint=gateway.endpoint_template, model=upstream.model)}
        )
        retry = RetryConfig(heartbeat_timeout_s=OUTAGE_S + 40, timeout_s=120)
        rollouts = await client.enqueue_rollouts(
            [RolloutCreate(input=i, retry=retry, resources_id=resources.resources_id) for i in range(AGENTS)]
        )
        run = asyncio.create_task(runner.run(max_rollouts=AGENTS))
        await asyncio.wait_for(all_calling.wait(), 60)

        await asyncio.to_thread(server.kill)
        down, killed_at = True, time.monotonic()
        await asyncio.sleep(OUTAGE_S)  # the outage itself: agents keep calling the model meanwhile
        stats = gateway.stats()
        assert outage_calls >= AGENTS * 10, outage_calls  # plenty of calls were made with the store gone
        assert stats["queued_spans"] >= outage_calls - AGENTS and stats["span_store_errors"] > 0, stats
        assert stats["failed_spans"] == 0 and stats["dropped_spans"] == 0, stats

        await asyncio.to_thread(server.start)
        down = False
        store_back.set()
        outcomes = await asyncio.wait_for(run, 60)
        assert time.monotonic() - killed_at >= OUTAGE_S
        assert [o.status for o in outcomes] == [AttemptStatus.SUCCEEDED] * AGENTS, outcomes
        await asyncio.wait_for(gateway.flush(), 30)

        stored: dict[int, int] = {}
        for rollout in rollouts:
            spans = (await client.query_spans(rollout_id=rollout.rollout_id, name=sc.SPAN_LLM_CALL)).items
            stored[rollout.input] = len(spans)
        assert stored == calls, (stored, calls)  # 0 LLM-call spans lost, per rollout
        stats = gateway.stats()
        assert stats["recorded_spans"] == sum(calls.values()) and stats["queued_spans"] == 0, stats
        assert stats["failed_spans"] == 0 and stats["dropped_spans"] == 0, stats
        assert runner.stats.spans_lost == 0
        assert gateway.spans.outage.outages == 1 and not gateway.spans.outage.down
    finally:
        if run is not None and not run.done():
            runner.stop()
            await asyncio.gather(run, return_exceptions=True)
        await asyncio.to_thread(gateway.stop)
        await client.aclose()
        await asyncio.to_thread(server.stop)
