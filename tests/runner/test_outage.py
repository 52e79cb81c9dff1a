"""A runner outlives a store outage far longer than its client's retries, and finishes the work after it."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

import agl
from agl.errors import StoreUnavailableError
from agl.schemas import AttemptStatus, RetryConfig, RolloutCreate, RolloutStatus
from agl.store.client import LightningStoreClient
from agl.tracer.writer import GaveUp, StoreOutage
from tests.runner.store_process import StoreProcess
from tests.support.waiting import until

OUTAGE_S = 4.0  # the client below gives up after ~0.15 s, so this is ~25 times its retry window


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_runner_survives_a_store_restart_and_finishes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agl.tracer.writer")
    server = StoreProcess(tmp_path / "store.db")
    await asyncio.to_thread(server.start)
    client = LightningStoreClient(server.url, retries=1, backoff_s=0.05, timeout_s=5)
    # a claim whose answer died with the server is handed out again once its heartbeats stop
    retry = RetryConfig(heartbeat_timeout_s=OUTAGE_S + 6, max_attempts=3)
    rollouts = await client.enqueue_rollouts([RolloutCreate(input=i, retry=retry) for i in range(8)])
    in_flight = asyncio.Event()

    @agl.rollout
    async def agent(task: int) -> float:
        in_flight.set()
        agl.emit_object({"task": task})
        await asyncio.sleep(0.8)
        return float(task)

    runner = agl.Runner(
        agent,
        client,
        max_concurrency=2,
        poll_interval_s=0.02,
        heartbeat_interval_s=0.3,
        store_backoff_s=0.1,
        max_store_backoff_s=1.0,
        handle_signals=False,
    )
    run = asyncio.create_task(runner.run(max_rollouts=8))
    try:
        await asyncio.wait_for(in_flight.wait(), 30)
        await asyncio.to_thread(server.kill)  # two attempts are mid-run
        killed_at = time.monotonic()
        # the outage as the runner lived it: it noticed the store gone and has ridden that out for OUTAGE_S
        await until(
            lambda: run.done() or runner.outage.down_for() >= OUTAGE_S,
            f"the runner to ride out {OUTAGE_S:g}s of outage",
            timeout_s=60,
        )
        assert not run.done(), run  # the old runner raised StoreUnavailableError and exited here
        await asyncio.to_thread(server.start)
        outcomes = await asyncio.wait_for(run, 60)
    finally:
        runner.stop()
        server.stop()
    assert time.monotonic() - killed_at >= OUTAGE_S
    assert len(outcomes) == 8 and all(o.status == AttemptStatus.SUCCEEDED for o in outcomes)
    assert runner.stats.spans_lost == 0 and runner.outage.outages == 1

    await asyncio.to_thread(server.start)
    try:
        for rollout in rollouts:
            stored = await client.get_rollout(rollout.rollout_id)
            assert stored.status == RolloutStatus.SUCCEEDED, stored
            names = {s.name for s in (await client.query_spans(rollout_id=rollout.rollout_id)).items}
            assert {agl.semconv.SPAN_OBJECT, agl.semconv.SPAN_REWARD} <= names
    finally:
        await client.aclose()
        server.stop()
    messages = [r.getMessage() for r in caplog.records if r.name == "agl.tracer.writer"]
    assert sum("store unreachable" in m for m in messages) == 1, messages  # once per state change
    assert sum("reachable again" in m for m in messages) == 1, messages


async def test_backoff_is_capped_jittered_and_gives_up_on_deadline_or_stop() -> None:
    outage = StoreOutage("w", backoff_s=0.1, max_backoff_s=0.4)
    delays = [outage.delay(n) for n in range(8)]
    assert 0.05 <= delays[0] <= 0.1 and all(0.2 <= d <= 0.4 for d in delays[3:])
    assert len({round(d, 6) for d in delays[3:]}) > 1  # jittered, not lock-step across runners

    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise StoreUnavailableError("down")

    started = time.monotonic()
    with pytest.raises(GaveUp, match="unreachable for"):
        await outage.call("testing", down, deadline_s=0.5)
    assert 0.45 <= time.monotonic() - started < 1.5 and calls >= 3 and outage.down
    stop = asyncio.Event()
    stop.set()
    with pytest.raises(GaveUp, match="stopping"):
        await outage.call("testing", down, stop=stop)

    async def up() -> int:
        return 7

    assert await outage.call("testing", up) == 7 and not outage.down and outage.outages == 1
    with pytest.raises(ValueError, match="backoff_s"):
        StoreOutage("w", backoff_s=1.0, max_backoff_s=0.5)
