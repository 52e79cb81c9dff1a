"""PostgreSQL specifics: several store servers sharing one database never double-claim or lose a rollout."""

from __future__ import annotations

import asyncio

from agl.schemas import AttemptStatus, RolloutCreate, Span
from agl.store import open_store
from agl.store.postgres import PostgresLightningStore
from tests.store.remote_backends import PG_DSN, postgres_store, serve
from tests.support.waiting import until


async def test_two_servers_one_database_split_runners() -> None:
    async with postgres_store() as first_inner:
        assert isinstance(first_inner, PostgresLightningStore)
        second_inner = PostgresLightningStore(PG_DSN, schema=first_inner.schema, watchdog_interval_s=0)
        async with serve(first_inner, close_inner=False) as a, serve(second_inner) as b:
            created = await a.enqueue_rollouts([RolloutCreate(input=i) for i in range(120)])
            claimed: list[str] = []

            async def runner(client, name: str) -> None:  # type: ignore[no-untyped-def]
                while (c := await client.dequeue(name)) is not None:
                    claimed.append(c.rollout.rollout_id)
                    await client.add_spans([Span.new(c.rollout.rollout_id, c.attempt.attempt_id, "work")])
                    await client.update_attempt(
                        c.rollout.rollout_id, c.attempt.attempt_id, status=AttemptStatus.SUCCEEDED
                    )

            await asyncio.gather(*(runner(a if i % 2 else b, f"r{i}") for i in range(12)))
            assert sorted(claimed) == sorted(r.rollout_id for r in created)  # each exactly once
            done = await b.wait_for_rollouts([r.rollout_id for r in created], timeout_s=10)
            assert len(done) == 120
            stats = await a.statistics()
            assert stats.spans == 120 and stats.rollouts_by_status == {"succeeded": 120}


async def test_open_store_postgres_url_with_schema() -> None:
    async with postgres_store() as owner:
        assert isinstance(owner, PostgresLightningStore)
        await owner.enqueue_rollout("x")
        other = open_store(f"{PG_DSN}?schema={owner.schema}")
        assert isinstance(other, PostgresLightningStore) and other.schema == owner.schema
        assert (await other.statistics()).rollouts_by_status == {"queuing": 1}
        await other.aclose()


async def test_a_completion_on_one_store_wakes_a_waiter_on_another_without_polling() -> None:
    """LISTEN/NOTIFY: the waiting store never polls, so only the other store's NOTIFY can wake it."""
    async with postgres_store() as first:
        assert isinstance(first, PostgresLightningStore)
        second = PostgresLightningStore(PG_DSN, schema=first.schema, watchdog_interval_s=0)
        second.cross_process_poll_s = None
        try:
            (rollout,) = await first.enqueue_rollouts([RolloutCreate(input=1)])
            waiter = asyncio.create_task(second.wait_for_rollouts([rollout.rollout_id], timeout_s=60))
            # registered: from here on a notification reaches it
            await until(lambda: bool(second._waiters._waiters), "the waiter to register")
            claimed = await first.dequeue("w")
            assert claimed is not None
            await first.update_attempt(
                rollout.rollout_id, claimed.attempt.attempt_id, status=AttemptStatus.SUCCEEDED
            )
            (done,) = await asyncio.wait_for(waiter, 30)
            assert done.rollout_id == rollout.rollout_id and done.status == "succeeded"
        finally:
            await second.aclose()


async def test_notify_splits_many_long_ids_under_the_payload_limit() -> None:
    """300 cancellations committed together need several NOTIFY payloads; every waiter id arrives."""
    async with postgres_store() as first:
        assert isinstance(first, PostgresLightningStore)
        second = PostgresLightningStore(PG_DSN, schema=first.schema, watchdog_interval_s=0)
        second.cross_process_poll_s = None
        try:
            ids = [f"ro-{i:04d}-" + "x" * 80 for i in range(300)]
            await first.enqueue_rollouts([RolloutCreate(input=i, rollout_id=r) for i, r in enumerate(ids)])
            waiter = asyncio.create_task(second.wait_for_rollouts(ids, timeout_s=60))
            await until(lambda: bool(second._waiters._waiters), "the waiter to register")
            await asyncio.gather(*(first.cancel_rollout(r) for r in ids))
            done = await asyncio.wait_for(waiter, 30)
            assert sorted(r.rollout_id for r in done) == ids
        finally:
            await second.aclose()
