"""PostgreSQL specifics: several store servers sharing one database never double-claim or lose a rollout."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest

from agl.errors import ConflictError, NotFoundError, StaleAttemptError, StoreError
from agl.schemas import AttemptStatus, RolloutCreate, RolloutStatus, Span
from agl.store import open_store
from agl.store._sqlite_thread import GroupCommitThread
from agl.store.postgres import PostgresLightningStore, _PipelinedGroupCommit
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


@pytest.fixture
def groups(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """Each group the PostgreSQL store ran: (its number of calls, whether it was run again carefully)."""
    seen: list[tuple[int, bool]] = []
    pipelined = _PipelinedGroupCommit._run_group
    careful = GroupCommitThread._run_group

    def run_group(self: Any, batch: list[Any]) -> None:
        seen.append((len(batch), False))
        pipelined(self, batch)

    def run_carefully(self: Any, batch: list[Any]) -> None:
        if isinstance(self, _PipelinedGroupCommit):
            seen[-1] = (len(batch), True)
        careful(self, batch)

    monkeypatch.setattr(_PipelinedGroupCommit, "_run_group", run_group)
    monkeypatch.setattr(GroupCommitThread, "_run_group", run_carefully)
    return seen


async def _hold_the_database_thread(store: PostgresLightningStore, seconds: float) -> asyncio.Task[None]:
    """A call that keeps a database thread busy; with one connection the calls queued meanwhile share a group."""
    started = asyncio.Event()
    loop = asyncio.get_running_loop()

    def hold(t: Any, _: list[str]) -> None:
        loop.call_soon_threadsafe(started.set)
        time.sleep(seconds)

    task = asyncio.create_task(store._tx(hold, write=False))
    await started.wait()
    return task


async def test_a_call_failing_after_it_wrote_is_undone_alone(groups: list[tuple[int, bool]]) -> None:
    """Pipelined groups run without savepoints; a call that fails after writing sends its group round
    again the careful way, and only that call's writes are lost."""
    async with postgres_store(connections=1) as store:  # one connection: held, the rest queue
        assert isinstance(store, PostgresLightningStore)
        rollouts = await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(3)])

        def write_then_fail(t: Any, _: list[str]) -> None:
            t.touch_worker("doomed", 1.0)
            raise ConflictError("refused after writing")

        held = await _hold_the_database_thread(store, 0.3)
        claims = [asyncio.create_task(store.dequeue(f"w{i}")) for i in range(2)]
        failing = asyncio.create_task(store._tx(write_then_fail))
        claims.append(asyncio.create_task(store.dequeue("w2")))
        await held
        claimed = [await c for c in claims]
        with pytest.raises(ConflictError, match="refused after writing"):
            await failing
        assert sorted(c.rollout.rollout_id for c in claimed if c) == sorted(r.rollout_id for r in rollouts)
        workers = {w.worker_id for w in (await store.query_workers()).items}
        assert workers == {"w0", "w1", "w2"}  # "doomed" was rolled back, the claims were not
        assert (4, True) in groups  # the four calls shared a group, and it was run again


async def test_a_database_error_fails_only_its_call(groups: list[tuple[int, bool]]) -> None:
    async with postgres_store(connections=1) as store:  # one connection: held, the rest queue
        assert isinstance(store, PostgresLightningStore)
        await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(2)])

        def bad_sql(t: Any, _: list[str]) -> None:
            t.conn.execute("UPDATE rollouts SET no_such_column=1")

        held = await _hold_the_database_thread(store, 0.3)
        first = asyncio.create_task(store.dequeue("w0"))
        failing = asyncio.create_task(store._tx(bad_sql))
        second = asyncio.create_task(store.dequeue("w1"))
        await held
        assert await first is not None and await second is not None
        with pytest.raises(StoreError, match="no_such_column"):
            await failing
        assert (await store.statistics()).rollouts_by_status == {"preparing": 2}
        assert (3, True) in groups


async def test_a_read_sees_the_span_counters_and_digests_of_its_group(
    groups: list[tuple[int, bool]],
) -> None:
    """Span counters and digests wait for the group's end; a read queued after a span batch sees them."""
    async with postgres_store(connections=1) as store:  # one connection: held, the rest queue
        assert isinstance(store, PostgresLightningStore)
        await store.enqueue_rollouts([RolloutCreate(input=1)])
        claim = await store.dequeue("w")
        assert claim is not None
        rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
        held = await _hold_the_database_thread(store, 0.3)
        batch = [Span.new(rid, aid, "agl.reward", {"agl.reward.value": 0.5}), Span.new(rid, aid, "step")]
        added = asyncio.create_task(store.add_spans(batch))
        stats = asyncio.create_task(store.statistics())
        digests = asyncio.create_task(store.query_digests(rollout_ids=[rid]))
        more = asyncio.create_task(
            store.add_spans([Span.new(rid, aid, "agl.reward", {"agl.reward.value": 2.0})])
        )
        await held
        assert len(await added) == 2 and len(await more) == 1
        assert (await stats).spans == 2 and (await stats).span_bytes > 0
        (digest,) = (await digests).items
        assert digest.reward == 0.5
        final = await store.statistics()
        (latest,) = (await store.query_digests(rollout_ids=[rid])).items
        assert final.spans == 3 and latest.reward == 2.0 and latest.stamp > digest.stamp
        assert (4, False) in groups  # one pipelined group held the four calls


async def test_digest_counts_add_up_across_a_group_and_across_servers(groups: list[tuple[int, bool]]) -> None:
    """Calls recorded by the gateway and a tracer, written at once through two servers on one schema
    and, on the first, in groups of calls: every call counts once, none is lost to another writer."""
    async with postgres_store(connections=1) as first:
        assert isinstance(first, PostgresLightningStore)
        second = PostgresLightningStore(PG_DSN, schema=first.schema, watchdog_interval_s=0)
        try:
            await first.enqueue_rollouts([RolloutCreate(input=0)])
            claimed = await first.dequeue("w")
            assert claimed is not None
            rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id

            def call(response_id: str, source: str) -> Span:
                reply = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "t"}}]}
                return Span.new(
                    rid,
                    aid,
                    "agl.llm.call",
                    {
                        "agl.llm.api": "chat.completions",
                        "agl.llm.source": source,
                        "agl.llm.response_id": response_id,
                        "agl.llm.response.message": reply,
                        "agl.llm.usage": {"completion_tokens": 2},
                    },
                )

            async def writer(store: PostgresLightningStore, n: int) -> None:
                for k in range(5):
                    await store.add_spans([call(f"{n}-{k}", "gateway"), call(f"{n}-{k}", "openinference")])

            held = await _hold_the_database_thread(first, 0.3)  # the first's calls queue, then share groups
            await asyncio.gather(*(writer(first if n % 2 else second, n) for n in range(8)), held)
            (digest,) = (await second.query_digests(rollout_ids=[rid])).items
            assert (digest.calls, digest.tool_calls, digest.completion_tokens) == (40, 40, 80)
            assert any(n > 1 for n, _ in groups)
        finally:
            await second.aclose()


async def test_nul_in_a_text_column_is_stored_as_replacement_character() -> None:
    """The Python API takes ids unchecked; PostgreSQL text cannot hold NUL, so it becomes U+FFFD there."""
    async with postgres_store() as store:
        await store.enqueue_rollouts([RolloutCreate(input="nul \u0000 inside")])
        claim = await store.dequeue("w\u0000")
        assert claim is not None and claim.rollout.input == "nul \u0000 inside"
        assert (await store.get_worker("w\ufffd")).current_rollout_id == claim.rollout.rollout_id


async def test_span_json_is_compressed_with_lz4_where_the_server_has_it() -> None:
    async with postgres_store() as store:
        assert isinstance(store, PostgresLightningStore)
        with psycopg.connect(PG_DSN, autocommit=True) as conn:
            (lz4,) = conn.execute(
                "SELECT 'lz4' = ANY(enumvals) FROM pg_settings WHERE name='default_toast_compression'"
            ).fetchone() or (False,)
            row = conn.execute(
                "SELECT attcompression FROM pg_attribute WHERE attrelid=%s::regclass AND attname='data'",
                (f'"{store.schema}".spans',),
            ).fetchone()
        assert row is not None
        (method,) = row
        assert method == ("l" if lz4 else "")


async def test_calls_of_one_group_read_their_rows_together(
    groups: list[tuple[int, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rows a group's calls name are read once for all; a call whose rollout an earlier call of the
    group wrote reads again, so it sees that write (a duplicate span, a finished attempt)."""
    import agl.store.postgres as pg

    read_aheads: list[int] = []
    original = pg.read_ahead

    def counting(conn: Any, reads: Any, claims: int = 0) -> Any:
        if reads:  # the dequeues before read the queue head only
            read_aheads.append(len(reads))
        return original(conn, reads, claims)

    monkeypatch.setattr(pg, "read_ahead", counting)
    async with postgres_store(connections=1) as store:  # one connection: held, the rest queue
        assert isinstance(store, PostgresLightningStore)
        await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(3)])
        c0, c1, c2 = [await store.dequeue(f"w{i}") for i in range(3)]
        assert c0 is not None and c1 is not None and c2 is not None
        ids = [(c.rollout.rollout_id, c.attempt.attempt_id) for c in (c0, c1, c2)]
        s, t = Span.new(*ids[1], "s"), Span.new(*ids[1], "t")
        held = await _hold_the_database_thread(store, 0.3)
        calls = [
            store.heartbeat(*ids[0]),
            store.add_spans([Span.new(*ids[1], "r"), s]),
            store.add_spans([s, t]),  # s again: the first call stored it
            store.update_attempt(*ids[2], status=AttemptStatus.SUCCEEDED),
            store.heartbeat(*ids[2]),  # after the attempt finished
            store.heartbeat("ro-missing", "at-missing"),
        ]
        tasks = [asyncio.create_task(c) for c in calls]
        await held
        results: list[Any] = await asyncio.gather(*tasks, return_exceptions=True)
        assert results[0].rollout_id == ids[0][0]
        assert [x.sequence_id for x in results[1]] == [1, 2]
        assert [(x.span_id, x.sequence_id) for x in results[2]] == [(t.span_id, 3)]
        assert results[3].status == "succeeded"
        assert isinstance(results[4], StaleAttemptError)
        assert isinstance(results[5], NotFoundError)
        assert (6, False) in groups and read_aheads == [6]  # one pipelined group, one read for six calls
        assert (await store.statistics()).spans == 3
        assert (await store.get_worker("w2")).current_attempt_id is None


async def test_claims_of_one_group_read_the_queue_head_once(
    groups: list[tuple[int, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group's dequeues take the queue's first rollouts from one read, in queue order; a head that an
    earlier call of the group wrote (here cancelled) is not handed out: the queue is asked again."""
    import agl.store.postgres as pg

    claims_read: list[int] = []
    original = pg._queue_heads

    def counting(conn: Any, claims: int) -> Any:
        claims_read.append(claims)
        return original(conn, claims)

    monkeypatch.setattr(pg, "_queue_heads", counting)
    async with postgres_store(connections=1) as store:
        assert isinstance(store, PostgresLightningStore)
        queued = await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(6)])
        held = await _hold_the_database_thread(store, 0.3)
        first = [asyncio.create_task(store.dequeue(w)) for w in ("w0", "w1")]
        cancel = asyncio.create_task(
            store.update_rollout(queued[2].rollout_id, status=RolloutStatus.CANCELLED)
        )
        then = [asyncio.create_task(store.dequeue(w)) for w in ("w2", "w3")]
        await held
        claims = await asyncio.gather(*first, *then)
        assert (await cancel).status == RolloutStatus.CANCELLED
        assert [c.rollout.rollout_id if c else None for c in claims] == [
            queued[i].rollout_id for i in (0, 1, 3, 4)
        ]
        assert (5, False) in groups and claims_read == [4]  # one read for the group's four claims
        assert [c.attempt.worker_id if c else None for c in claims] == ["w0", "w1", "w2", "w3"]


async def test_a_second_connection_runs_calls_while_the_first_is_busy() -> None:
    """Calls queue for any free connection, not behind the group that one connection is running."""
    async with postgres_store(connections=2) as store:
        assert isinstance(store, PostgresLightningStore)
        await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(2)])
        held = await _hold_the_database_thread(store, 3.0)
        started = time.perf_counter()
        claimed = await store.dequeue("w0")
        assert claimed is not None and not held.done()
        assert time.perf_counter() - started < 2.0
        await held


async def test_connections_must_be_a_small_whole_number() -> None:
    for bad in (0, "two", 65):
        with pytest.raises(ValueError, match="connections"):
            PostgresLightningStore(PG_DSN, schema="agl_test_never", connections=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("writers", ["two connections", "two servers"])
async def test_span_batches_written_side_by_side_get_distinct_sequence_ids(writers: str) -> None:
    """A batch's sequence ids come from the rollout's counter: a read of it locks the row until COMMIT,
    so two transactions at once (two connections of a store, or two stores on one schema) never take the
    same ids."""
    async with postgres_store(connections=2 if writers == "two connections" else 1) as first:
        assert isinstance(first, PostgresLightningStore)
        other = first
        if writers == "two servers":
            other = PostgresLightningStore(PG_DSN, schema=first.schema, watchdog_interval_s=0)
        try:
            await first.enqueue_rollouts([RolloutCreate(input=0)])
            claimed = await first.dequeue("w")
            assert claimed is not None
            rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id

            async def writer(store: PostgresLightningStore) -> None:
                for _ in range(10):
                    await store.add_spans([Span.new(rid, aid, "step"), Span.new(rid, aid, "step")])

            await asyncio.gather(*(writer(first if i % 2 else other) for i in range(10)))
            spans = (await first.query_spans(rollout_id=rid, limit=1000)).items
            assert sorted(s.sequence_id or 0 for s in spans) == list(range(1, 201))
        finally:
            if other is not first:
                await other.aclose()
