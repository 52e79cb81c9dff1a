"""SQLite-only guarantees: durability across reopen and safety with several processes on one file."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading
from pathlib import Path

from agl.schemas import AttemptStatus, PromptTemplate, RolloutCreate, RolloutStatus, Span
from agl.store import SqliteLightningStore, SyncLightningStore, open_store


async def test_everything_committed_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "durable.db"
    store = SqliteLightningStore(path)
    created = await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(5)])
    claimed = await store.dequeue("w1")
    assert claimed is not None
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    await store.add_spans([Span.new(rid, aid, "s", {"i": i}) for i in range(3)])
    await store.update_attempt(rid, aid, status=AttemptStatus.SUCCEEDED)
    version = await store.add_resources({"p": PromptTemplate(template="kept")})
    await store.aclose()

    reopened = SqliteLightningStore(path)
    assert (await reopened.get_rollout(rid)).status == RolloutStatus.SUCCEEDED
    assert len((await reopened.query_spans(rollout_id=rid)).items) == 3
    assert (await reopened.get_latest_resources()) == version
    assert len((await reopened.query_rollouts(status=[RolloutStatus.QUEUING])).items) == 4
    nxt = await reopened.dequeue("w2")
    assert nxt is not None and nxt.rollout.rollout_id == created[1].rollout_id
    span = await reopened.add_span(Span.new(rid, aid, "late"))
    assert span.sequence_id == 4  # the counter survived too
    await reopened.aclose()


def _claim_all(path: str, worker: str, out: mp.Queue) -> None:  # type: ignore[type-arg]
    async def run() -> list[str]:
        store = SqliteLightningStore(path)
        got = []
        while (c := await store.dequeue(worker)) is not None:
            await store.add_span(Span.new(c.rollout.rollout_id, c.attempt.attempt_id, "work"))
            await store.update_attempt(
                c.rollout.rollout_id, c.attempt.attempt_id, status=AttemptStatus.SUCCEEDED
            )
            got.append(c.rollout.rollout_id)
        await store.aclose()
        return got

    out.put(asyncio.run(run()))


async def test_several_processes_share_one_file_without_double_claims(tmp_path: Path) -> None:
    path = str(tmp_path / "shared.db")
    store = SqliteLightningStore(path)
    created = await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(150)])
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()  # type: ignore[type-arg]
    procs = [ctx.Process(target=_claim_all, args=(path, f"p{i}", out)) for i in range(3)]
    for p in procs:
        p.start()
    results = [await asyncio.to_thread(out.get, True, 120) for _ in procs]
    for p in procs:
        p.join(30)
    claimed = [rid for r in results for rid in r]
    assert sorted(claimed) == sorted(r.rollout_id for r in created)
    # a waiter in this process sees completions made by the others
    done = await store.wait_for_rollouts([r.rollout_id for r in created], timeout_s=10)
    assert len(done) == 150
    assert (await store.statistics()).spans == 150
    await store.aclose()


def test_threads_with_their_own_loops_share_one_store(tmp_path: Path) -> None:
    store = SqliteLightningStore(tmp_path / "threads.db")
    sync = SyncLightningStore(store)
    sync.enqueue_rollouts([RolloutCreate(input=i) for i in range(60)])
    claimed: list[str] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        async def run() -> None:
            while (c := await store.dequeue(name)) is not None:
                with lock:
                    claimed.append(c.rollout.rollout_id)

        asyncio.run(run())

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(claimed) == 60 == len(set(claimed))
    sync.close()


def test_sync_facade_blocks_and_returns(tmp_path: Path) -> None:
    with SyncLightningStore(open_store(f"sqlite:///{tmp_path}/facade.db")) as store:
        rollout = store.enqueue_rollout({"q": 1})
        claimed = store.dequeue("w")
        assert claimed.rollout.rollout_id == rollout.rollout_id
        store.update_attempt(rollout.rollout_id, claimed.attempt.attempt_id, status=AttemptStatus.SUCCEEDED)
        assert store.get_rollout(rollout.rollout_id).status == RolloutStatus.SUCCEEDED


def test_open_store_urls(tmp_path: Path) -> None:
    import pytest

    from agl.errors import ConfigError
    from agl.store import InMemoryLightningStore

    assert isinstance(open_store("memory://"), InMemoryLightningStore)
    sqlite = open_store(f"sqlite:///{tmp_path}/a.db")
    assert isinstance(sqlite, SqliteLightningStore) and sqlite.path == f"{tmp_path}/a.db"
    asyncio.run(sqlite.aclose())
    with pytest.raises(ConfigError, match="unknown store URL"):
        open_store("mongodb://x")


def test_watchdog_prefilter_passes_every_attempt_the_verdict_marks() -> None:
    """The SQL stores skip reading an attempt in full when ``_may_be_overdue`` says it cannot be marked:
    it must say so for none that ``watchdog_verdict`` marks, and skip the ones plainly within limits."""
    import itertools

    from agl.schemas import Attempt, RetryConfig, Rollout
    from agl.store._sql import _may_be_overdue
    from agl.store.states import watchdog_verdict

    skipped = 0
    for timeout_s, silence_s, last_beat, now in itertools.product(
        (None, 5.0), (None, 2.0), (None, 101.0, 104.5), (100.5, 103.0, 106.0)
    ):
        retry = RetryConfig(timeout_s=timeout_s, heartbeat_timeout_s=silence_s)
        rollout = Rollout(rollout_id="ro-1", created_at=99.0, updated_at=99.0, retry=retry)
        attempt = Attempt(
            rollout_id="ro-1",
            attempt_id="at-1",
            attempt_number=1,
            started_at=100.0,
            last_heartbeat_at=last_beat,
        )
        may = _may_be_overdue(attempt.model_dump_json(), rollout.model_dump_json(), now)
        if watchdog_verdict(attempt, retry, now) is not None:
            assert may, (timeout_s, silence_s, last_beat, now)
        skipped += not may
    assert skipped > 0
    assert _may_be_overdue("{}", "not json", 0.0)  # a shape it cannot read goes to the models
