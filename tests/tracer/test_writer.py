"""The span writer: batches split around a bad span, outages ridden out until the deadline, counters."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import pytest

from agl.errors import StoreUnavailableError
from agl.schemas import RolloutCreate, Span
from agl.store import InMemoryLightningStore
from agl.tracer.writer import SpanTally, SpanWriter
from tests.support.waiting import until


class FlakyStore(InMemoryLightningStore):
    """A real in-memory store that is unreachable while ``down`` is set; counts its span writes."""

    def __init__(self) -> None:
        super().__init__(watchdog_interval_s=0)
        self.down = False
        self.calls: list[int] = []  # batch sizes of add_spans calls
        self.refused = asyncio.Event()

    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        self.calls.append(len(spans))
        if self.down:
            self.refused.set()
            raise StoreUnavailableError("store down")
        return await super().add_spans(spans)


async def _attempt(store: InMemoryLightningStore) -> tuple[str, str]:
    started = await store.start_rollout(RolloutCreate(input="x"))
    return started.rollout.rollout_id, started.attempt.attempt_id


def _span(rid: str, aid: str, i: int) -> Span:
    return Span(
        rollout_id=rid, attempt_id=aid, trace_id="a" * 32, span_id=f"{i:016x}", name=f"s{i}",
        start_time_ns=i, end_time_ns=i + 1,
    )  # fmt: skip


async def test_a_rejected_span_is_split_out_and_the_others_are_written() -> None:
    store = FlakyStore()
    rid, aid = await _attempt(store)
    writer, tally = SpanWriter(store, batch_size=64), SpanTally()
    spans = [_span(rid, aid, i) for i in range(20)]
    spans[3] = _span("ro-deleted", aid, 3)  # the store answers NotFoundError (a 4xx over HTTP) for these
    spans[17] = _span("ro-deleted", aid, 17)

    def broken() -> Span:
        raise ValueError("a converter bug")

    await writer.put([*spans, broken], tally)
    await writer.flush()
    stored = (await store.query_spans(rollout_id=rid)).items
    assert sorted(s.name for s in stored) == sorted(f"s{i}" for i in range(20) if i not in (3, 17))
    assert (tally.written, tally.failed) == (18, 3)
    assert (writer.stats.written, writer.stats.failed, writer.stats.dropped) == (18, 3, 0)
    assert store.calls[0] == 20 and len(store.calls) <= 2 * 2 * 5 + 1  # bisected, not span by span
    await writer.aclose()


async def test_an_outage_is_ridden_out_and_the_spans_written_in_order_after_it() -> None:
    store = FlakyStore()
    rid, aid = await _attempt(store)
    writer = SpanWriter(store, batch_size=8, backoff_s=0.01, max_backoff_s=0.05)
    store.down = True
    for i in range(30):
        assert writer.submit(_span(rid, aid, i))
    await asyncio.wait_for(store.refused.wait(), 10)
    flushed = asyncio.ensure_future(writer.flush())
    refused = len(store.calls)
    # a flush waits through the outage rather than give the spans up: still waiting after 3 more retries
    await until(lambda: len(store.calls) >= refused + 3, "the writer to retry through the outage")
    assert not flushed.done() and writer.outage.down and writer.queued == 30
    store.down = False
    await asyncio.wait_for(flushed, 10)
    stored = (await store.query_spans(rollout_id=rid)).items
    assert [s.name for s in stored] == [f"s{i}" for i in range(30)]  # in the order they were queued
    assert writer.stats.written == 30 and writer.stats.failed == 0 and writer.stats.store_errors >= 2
    assert writer.outage.outages == 1 and not writer.outage.down
    await writer.aclose()


async def test_past_the_deadline_spans_count_failed_and_a_full_queue_drops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FlakyStore()
    rid, aid = await _attempt(store)
    writer = SpanWriter(store, queue_size=4, deadline_s=0.3, backoff_s=0.01, max_backoff_s=0.05)
    store.down = True
    started = time.monotonic()
    tally = SpanTally()
    accepted = [writer.submit(_span(rid, aid, i), tally) for i in range(6)]
    assert accepted == [True] * 4 + [False] * 2 and writer.stats.dropped == 2
    with caplog.at_level(logging.ERROR, logger="agl.tracer.writer"):
        await asyncio.wait_for(writer.flush(), 10)
    assert 0.3 <= time.monotonic() - started < 5
    assert (tally.written, tally.failed) == (0, 6) and writer.stats.failed == 4
    assert any("unreachable for" in r.getMessage() for r in caplog.records)
    store.down = False  # back: new spans flow again
    writer.submit(_span(rid, aid, 9))
    await writer.flush()
    assert writer.stats.written == 1

    store.down = True  # closing while the store is down gives up after the close timeout
    store.refused.clear()
    writer.submit(_span(rid, aid, 10))
    await asyncio.wait_for(store.refused.wait(), 10)
    await asyncio.wait_for(writer.aclose(timeout_s=0.1), 5)
    assert writer.stats.failed == 5 and writer.queued == 0


async def test_put_waits_for_room_instead_of_dropping() -> None:
    store = FlakyStore()
    rid, aid = await _attempt(store)
    writer = SpanWriter(store, queue_size=2, batch_size=2, backoff_s=0.01, max_backoff_s=0.02)
    store.down = True
    put = asyncio.ensure_future(writer.put([_span(rid, aid, i) for i in range(7)]))
    await asyncio.wait_for(store.refused.wait(), 10)
    await until(lambda: len(store.calls) >= 3, "the writer to retry the stuck batch")
    assert not put.done()  # 2 in the stuck batch, 2 queued: the rest wait for room
    assert writer.queued == 4
    store.down = False
    await asyncio.wait_for(put, 10)
    await writer.flush()
    assert writer.stats.written == 7 and writer.stats.dropped == 0
    await writer.aclose()


def test_bad_settings_are_named() -> None:
    store = InMemoryLightningStore(watchdog_interval_s=0)
    with pytest.raises(ValueError, match="queue_size"):
        SpanWriter(store, queue_size=0)
    with pytest.raises(ValueError, match="deadline_s"):
        SpanWriter(store, deadline_s=0)
