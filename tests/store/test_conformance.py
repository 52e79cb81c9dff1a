"""The backend contract: every store backend (lifecycle core and read model) must pass every test here."""

from __future__ import annotations

import asyncio
import time

import pytest

from agl import semconv as sc
from agl.errors import (
    ConflictError,
    InvalidSpanError,
    InvalidTransitionError,
    NotFoundError,
    StaleAttemptError,
    StoreError,
)
from agl.schemas import (
    LLM,
    AttemptStatus,
    JsonResource,
    PromptTemplate,
    RetryConfig,
    RolloutCreate,
    RolloutStatus,
    Span,
    WorkerStatus,
)
from agl.store import StoreWithReadModel
from tests.store.conftest import FakeClock
from tests.support.waiting import until

A = AttemptStatus
R = RolloutStatus


async def _claim(store: StoreWithReadModel, worker: str = "w1", **fields: object):  # type: ignore[no-untyped-def]
    rollout = await store.enqueue_rollout({"task": 1}, **fields)
    claimed = await store.dequeue(worker)
    assert claimed is not None and claimed.rollout.rollout_id == rollout.rollout_id
    return claimed


def _span(rollout_id: str, attempt_id: str, name: str = "step", **attrs: object) -> Span:
    return Span.new(rollout_id, attempt_id, name, dict(attrs))


async def _all(query, **kwargs):  # type: ignore[no-untyped-def]
    """Every item of a paginated query, following cursors."""
    items, cursor = [], None
    while True:
        page = await query(cursor=cursor, **kwargs)
        items += page.items
        cursor = page.next_cursor
        if cursor is None:
            return items


# ----- enqueue -----------------------------------------------------------------------------


async def test_enqueue_creates_queuing_rollout(store: StoreWithReadModel) -> None:
    rollout = await store.enqueue_rollout({"q": "2+2"}, mode="val", metadata={"k": 1})
    assert rollout.status == R.QUEUING
    assert rollout.input == {"q": "2+2"} and rollout.mode == "val" and rollout.metadata == {"k": 1}
    assert (await store.get_rollout(rollout.rollout_id)) == rollout


async def test_enqueue_batch_keeps_order(store: StoreWithReadModel) -> None:
    created = await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(20)])
    claimed = [await store.dequeue("w") for _ in range(20)]
    assert [c.rollout.rollout_id for c in claimed if c] == [r.rollout_id for r in created]


async def test_enqueue_same_id_same_content_is_idempotent(store: StoreWithReadModel) -> None:
    first = await store.enqueue_rollout({"x": 1}, rollout_id="ro-fixed")
    again = await store.enqueue_rollout({"x": 1}, rollout_id="ro-fixed")
    assert again.rollout_id == first.rollout_id
    page = await store.query_rollouts()
    assert len(page.items) == 1


async def test_enqueue_same_id_other_content_conflicts(store: StoreWithReadModel) -> None:
    await store.enqueue_rollout({"x": 1}, rollout_id="ro-fixed")
    with pytest.raises(ConflictError, match="ro-fixed"):
        await store.enqueue_rollout({"x": 2}, rollout_id="ro-fixed")


async def test_enqueue_unknown_resources_rejected_and_nothing_stored(store: StoreWithReadModel) -> None:
    with pytest.raises(NotFoundError, match="rs-missing"):
        await store.enqueue_rollouts(
            [RolloutCreate(input=1), RolloutCreate(input=2, resources_id="rs-missing")]
        )
    assert (await store.query_rollouts()).items == []


async def test_enqueue_resolves_latest_resources(store: StoreWithReadModel) -> None:
    await store.add_resources({"p": PromptTemplate(template="v1")})
    latest = await store.add_resources({"p": PromptTemplate(template="v2")})
    rollout = await store.enqueue_rollout(1)
    assert rollout.resources_id == latest.resources_id


async def test_enqueue_malformed_request_names_field(store: StoreWithReadModel) -> None:
    with pytest.raises(StoreError, match="retry"):
        await store.enqueue_rollouts([{"input": 1, "retry": {"max_attempts": 0}}])  # type: ignore[list-item]


async def test_retry_config_rejects_unknown_failure_kind() -> None:
    with pytest.raises(ValueError, match="unknown failure kinds"):
        RetryConfig(retry_on=["exploded"])


# ----- dequeue and start -------------------------------------------------------------------


async def test_dequeue_empty_returns_none(store: StoreWithReadModel) -> None:
    assert await store.dequeue("w1") is None


async def test_dequeue_creates_preparing_attempt(store: StoreWithReadModel) -> None:
    claimed = await _claim(store)
    assert claimed.rollout.status == R.PREPARING
    assert claimed.attempt.status == A.PREPARING
    assert claimed.attempt.attempt_number == 1 and claimed.attempt.worker_id == "w1"
    assert (await store.get_rollout(claimed.rollout.rollout_id)).num_attempts == 1


async def test_dequeue_marks_worker_busy_then_idle(store: StoreWithReadModel) -> None:
    claimed = await _claim(store, "w9")
    worker = await store.get_worker("w9")
    assert worker.status == WorkerStatus.BUSY and worker.current_attempt_id == claimed.attempt.attempt_id
    await store.update_attempt(claimed.rollout.rollout_id, claimed.attempt.attempt_id, status=A.SUCCEEDED)
    worker = await store.get_worker("w9")
    assert worker.status == WorkerStatus.IDLE and worker.current_attempt_id is None


async def test_dequeue_skips_cancelled_rollouts(store: StoreWithReadModel) -> None:
    first = await store.enqueue_rollout(1)
    second = await store.enqueue_rollout(2)
    await store.cancel_rollout(first.rollout_id)
    claimed = await store.dequeue("w")
    assert claimed is not None and claimed.rollout.rollout_id == second.rollout_id
    assert await store.dequeue("w") is None


async def test_concurrent_dequeuers_never_double_claim(store: StoreWithReadModel) -> None:
    n = 120
    await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(n)])

    async def worker(name: str) -> list[str]:
        got = []
        while (claimed := await store.dequeue(name)) is not None:
            got.append(claimed.rollout.rollout_id)
        return got

    results = await asyncio.gather(*(worker(f"w{i}") for i in range(16)))
    claimed = [rid for r in results for rid in r]
    assert len(claimed) == n and len(set(claimed)) == n


async def test_start_rollout_bypasses_queue(store: StoreWithReadModel) -> None:
    queued = await store.enqueue_rollout("queued")
    started = await store.start_rollout(RolloutCreate(input="online"), worker_id="w1")
    assert started.rollout.status == R.PREPARING and started.attempt.attempt_number == 1
    claimed = await store.dequeue("w2")
    assert claimed is not None and claimed.rollout.rollout_id == queued.rollout_id
    assert await store.dequeue("w2") is None


async def test_start_rollout_duplicate_id_conflicts(store: StoreWithReadModel) -> None:
    await store.start_rollout(RolloutCreate(input=1, rollout_id="ro-online"))
    with pytest.raises(ConflictError):
        await store.start_rollout(RolloutCreate(input=1, rollout_id="ro-online"))


# ----- the state machine -------------------------------------------------------------------


async def test_first_span_moves_attempt_and_rollout_to_running(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    await store.add_span(_span(c.rollout.rollout_id, c.attempt.attempt_id))
    rollout = await store.get_rollout(c.rollout.rollout_id)
    attempts = (await store.query_attempts(rollout_id=rollout.rollout_id)).items
    assert rollout.status == R.RUNNING and rollout.started_at is not None
    assert attempts[0].status == A.RUNNING


async def test_explicit_running_then_succeeded(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    rid, aid = c.rollout.rollout_id, c.attempt.attempt_id
    await store.update_attempt(rid, aid, status=A.RUNNING)
    attempt = await store.update_attempt(rid, aid, status=A.SUCCEEDED)
    rollout = await store.get_rollout(rid)
    assert attempt.status == A.SUCCEEDED and attempt.ended_at is not None
    assert rollout.status == R.SUCCEEDED and rollout.ended_at is not None


async def test_failure_without_retry_fails_rollout(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    await store.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status=A.FAILED, error="boom")
    rollout = await store.get_rollout(c.rollout.rollout_id)
    attempt = (await store.query_attempts(rollout_id=rollout.rollout_id)).items[0]
    assert rollout.status == R.FAILED and attempt.error == "boom"


async def test_retryable_failure_requeues_with_new_attempt(store: StoreWithReadModel) -> None:
    c = await _claim(store, retry=RetryConfig(max_attempts=3, retry_on=["failed"]))
    rid = c.rollout.rollout_id
    await store.update_attempt(rid, c.attempt.attempt_id, status=A.FAILED)
    assert (await store.get_rollout(rid)).status == R.REQUEUING
    again = await store.dequeue("w2")
    assert again is not None and again.rollout.rollout_id == rid
    assert again.attempt.attempt_number == 2 and again.attempt.attempt_id != c.attempt.attempt_id


async def test_retries_stop_at_max_attempts(store: StoreWithReadModel) -> None:
    c = await _claim(store, retry=RetryConfig(max_attempts=2, retry_on=["failed"]))
    rid = c.rollout.rollout_id
    await store.update_attempt(rid, c.attempt.attempt_id, status=A.FAILED)
    second = await store.dequeue("w")
    assert second is not None
    await store.update_attempt(rid, second.attempt.attempt_id, status=A.FAILED)
    assert (await store.get_rollout(rid)).status == R.FAILED
    assert await store.dequeue("w") is None


async def test_failure_kind_not_in_retry_on_is_final(store: StoreWithReadModel) -> None:
    c = await _claim(store, retry=RetryConfig(max_attempts=3, retry_on=["timeout"]))
    await store.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status=A.FAILED)
    assert (await store.get_rollout(c.rollout.rollout_id)).status == R.FAILED


async def test_update_after_final_is_stale(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    rid, aid = c.rollout.rollout_id, c.attempt.attempt_id
    await store.update_attempt(rid, aid, status=A.SUCCEEDED)
    with pytest.raises(StaleAttemptError, match=aid):
        await store.update_attempt(rid, aid, status=A.FAILED)
    assert (await store.get_rollout(rid)).status == R.SUCCEEDED


async def test_repeating_the_same_final_status_is_idempotent(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    rid, aid = c.rollout.rollout_id, c.attempt.attempt_id
    await store.update_attempt(rid, aid, status=A.SUCCEEDED)
    again = await store.update_attempt(rid, aid, status=A.SUCCEEDED)
    assert again.status == A.SUCCEEDED


async def test_invalid_rollout_transition_names_states(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    await store.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status=A.SUCCEEDED)
    with pytest.raises(InvalidTransitionError, match="succeeded to running"):
        await store.update_rollout(c.rollout.rollout_id, status=R.RUNNING)


async def test_queued_rollout_cannot_jump_to_succeeded(store: StoreWithReadModel) -> None:
    rollout = await store.enqueue_rollout(1)
    with pytest.raises(InvalidTransitionError):
        await store.update_rollout(rollout.rollout_id, status=R.SUCCEEDED)
    assert (await store.get_rollout(rollout.rollout_id)).status == R.QUEUING


async def test_cancel_queued_rollout(store: StoreWithReadModel) -> None:
    rollout = await store.enqueue_rollout(1)
    cancelled = await store.cancel_rollout(rollout.rollout_id)
    assert cancelled.status == R.CANCELLED and cancelled.ended_at is not None


async def test_cancel_running_rollout_ends_attempt_and_makes_it_stale(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    rid, aid = c.rollout.rollout_id, c.attempt.attempt_id
    await store.update_attempt(rid, aid, status=A.RUNNING)
    await store.cancel_rollout(rid)
    attempt = (await store.query_attempts(rollout_id=rid)).items[0]
    assert attempt.status.is_terminal
    with pytest.raises(StaleAttemptError):
        await store.update_attempt(rid, aid, status=A.SUCCEEDED)
    with pytest.raises(StaleAttemptError):
        await store.heartbeat(rid, aid)
    assert (await store.get_rollout(rid)).status == R.CANCELLED


async def test_cancel_finished_rollout_is_invalid(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    await store.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status=A.SUCCEEDED)
    with pytest.raises(InvalidTransitionError):
        await store.cancel_rollout(c.rollout.rollout_id)


async def test_unknown_ids_raise_not_found(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    with pytest.raises(NotFoundError, match="ro-nope"):
        await store.get_rollout("ro-nope")
    with pytest.raises(NotFoundError, match="at-nope"):
        await store.update_attempt(c.rollout.rollout_id, "at-nope", status=A.RUNNING)
    with pytest.raises(NotFoundError):
        await store.heartbeat("ro-nope", c.attempt.attempt_id)
    with pytest.raises(NotFoundError):
        await store.update_rollout("ro-nope", status=R.CANCELLED)


async def test_attempt_of_another_rollout_is_not_found(store: StoreWithReadModel) -> None:
    a = await _claim(store)
    b = await _claim(store)
    with pytest.raises(NotFoundError):
        await store.update_attempt(a.rollout.rollout_id, b.attempt.attempt_id, status=A.SUCCEEDED)


async def test_update_rollout_merges_metadata(store: StoreWithReadModel) -> None:
    rollout = await store.enqueue_rollout(1, metadata={"a": 1})
    updated = await store.update_rollout(rollout.rollout_id, metadata={"b": 2})
    assert updated.metadata == {"a": 1, "b": 2}
    assert (await store.get_rollout(rollout.rollout_id)).metadata == {"a": 1, "b": 2}


async def test_update_attempt_merges_metadata(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    await store.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, metadata={"host": "a"})
    attempt = (await store.query_attempts(rollout_id=c.rollout.rollout_id)).items[0]
    assert attempt.metadata == {"host": "a"}


# ----- watchdog (controlled clock) ---------------------------------------------------------


async def test_watchdog_times_out_long_attempt_and_retries(
    store: StoreWithReadModel, clock: FakeClock
) -> None:
    c = await _claim(store, retry=RetryConfig(max_attempts=2, timeout_s=10))
    clock.advance(5)
    assert await store.run_watchdog() == []
    clock.advance(6)
    marked = await store.run_watchdog()
    assert [m.attempt_id for m in marked] == [c.attempt.attempt_id] and marked[0].status == A.TIMEOUT
    assert (await store.get_rollout(c.rollout.rollout_id)).status == R.REQUEUING
    again = await store.dequeue("w2")
    assert again is not None and again.attempt.attempt_number == 2


async def test_watchdog_marks_silent_attempt_unresponsive(
    store: StoreWithReadModel, clock: FakeClock
) -> None:
    c = await _claim(store, retry=RetryConfig(heartbeat_timeout_s=5, retry_on=[]))
    clock.advance(6)
    marked = await store.run_watchdog()
    assert marked[0].status == A.UNRESPONSIVE
    assert (await store.get_rollout(c.rollout.rollout_id)).status == R.FAILED


async def test_heartbeats_keep_attempt_alive(store: StoreWithReadModel, clock: FakeClock) -> None:
    c = await _claim(store, retry=RetryConfig(heartbeat_timeout_s=5))
    for _ in range(4):
        clock.advance(4)
        rollout = await store.heartbeat(c.rollout.rollout_id, c.attempt.attempt_id)
        assert rollout.rollout_id == c.rollout.rollout_id
        assert await store.run_watchdog() == []


async def test_spans_count_as_heartbeats(store: StoreWithReadModel, clock: FakeClock) -> None:
    c = await _claim(store, retry=RetryConfig(heartbeat_timeout_s=5))
    for _ in range(3):
        clock.advance(4)
        await store.add_span(_span(c.rollout.rollout_id, c.attempt.attempt_id))
        assert await store.run_watchdog() == []
    clock.advance(6)
    assert len(await store.run_watchdog()) == 1


async def test_watchdog_leaves_finished_attempts_alone(store: StoreWithReadModel, clock: FakeClock) -> None:
    c = await _claim(store, retry=RetryConfig(timeout_s=1))
    await store.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status=A.SUCCEEDED)
    clock.advance(100)
    assert await store.run_watchdog() == []
    assert (await store.get_rollout(c.rollout.rollout_id)).status == R.SUCCEEDED


async def test_superseded_attempt_cannot_change_outcome(store: StoreWithReadModel, clock: FakeClock) -> None:
    c = await _claim(store, retry=RetryConfig(max_attempts=2, timeout_s=10))
    rid, old = c.rollout.rollout_id, c.attempt.attempt_id
    clock.advance(11)
    await store.run_watchdog()
    new = await store.dequeue("w2")
    assert new is not None
    late = await store.add_span(_span(rid, old, "late"))  # late spans are kept, under their attempt
    assert late.attempt_id == old
    with pytest.raises(StaleAttemptError):
        await store.update_attempt(rid, old, status=A.SUCCEEDED)
    await store.update_attempt(rid, new.attempt.attempt_id, status=A.FAILED)
    rollout = await store.get_rollout(rid)
    assert rollout.status == R.FAILED
    latest = await store.query_spans(rollout_id=rid, attempt_id="latest")
    assert latest.items == []


async def test_background_watchdog_runs_without_calls(store: StoreWithReadModel) -> None:
    owner = getattr(store, "inner_store", store)  # over HTTP the server-side store owns the watchdog
    owner.clock = time.time  # type: ignore[method-assign]
    owner.watchdog_interval_s = 0.05
    c = await _claim(store, retry=RetryConfig(timeout_s=0.1))
    await store.start()
    done = await store.wait_for_rollouts([c.rollout.rollout_id], timeout_s=5)
    assert [r.status for r in done] == [R.FAILED]


# ----- spans -------------------------------------------------------------------------------


async def test_sequence_ids_increase_per_rollout(store: StoreWithReadModel) -> None:
    a = await _claim(store)
    b = await _claim(store)
    stored = await store.add_spans(
        [_span(a.rollout.rollout_id, a.attempt.attempt_id) for _ in range(3)]
        + [_span(b.rollout.rollout_id, b.attempt.attempt_id) for _ in range(2)]
    )
    assert [s.sequence_id for s in stored] == [1, 2, 3, 1, 2]


async def test_sequence_ids_continue_across_attempts(store: StoreWithReadModel) -> None:
    c = await _claim(store, retry=RetryConfig(max_attempts=2, retry_on=["failed"]))
    rid = c.rollout.rollout_id
    await store.add_spans([_span(rid, c.attempt.attempt_id) for _ in range(2)])
    await store.update_attempt(rid, c.attempt.attempt_id, status=A.FAILED)
    second = await store.dequeue("w")
    assert second is not None
    span = await store.add_span(_span(rid, second.attempt.attempt_id))
    assert span.sequence_id == 3


async def test_preassigned_sequence_id_kept_and_counter_bumped(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    rid, aid = c.rollout.rollout_id, c.attempt.attempt_id
    explicit = await store.add_span(_span(rid, aid).model_copy(update={"sequence_id": 10}))
    after = await store.add_span(_span(rid, aid))
    assert explicit.sequence_id == 10 and after.sequence_id == 11


async def test_next_sequence_id_reserves(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    rid = c.rollout.rollout_id
    assert [await store.next_sequence_id(rid) for _ in range(3)] == [1, 2, 3]
    span = await store.add_span(_span(rid, c.attempt.attempt_id))
    assert span.sequence_id == 4


async def test_duplicate_spans_ignored(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    span = _span(c.rollout.rollout_id, c.attempt.attempt_id)
    first = await store.add_spans([span])
    second = await store.add_spans([span, span])
    assert len(first) == 1 and second == []
    assert (await store.statistics()).spans == 1


async def test_malformed_span_rejects_batch_naming_field(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    good = _span(c.rollout.rollout_id, c.attempt.attempt_id).model_dump()
    bad = {**good, "span_id": "not-hex"}
    with pytest.raises(InvalidSpanError, match="span_id"):
        await store.add_spans([good, bad])  # type: ignore[list-item]
    assert (await store.query_spans(rollout_id=c.rollout.rollout_id)).items == []


async def test_span_end_before_start_rejected(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    bad = {
        **_span(c.rollout.rollout_id, c.attempt.attempt_id).model_dump(),
        "start_time_ns": 10,
        "end_time_ns": 5,
    }
    with pytest.raises(InvalidSpanError, match="end_time_ns"):
        await store.add_spans([bad])  # type: ignore[list-item]


async def test_span_for_unknown_attempt_rejects_batch(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    with pytest.raises(NotFoundError):
        await store.add_spans(
            [_span(c.rollout.rollout_id, c.attempt.attempt_id), _span(c.rollout.rollout_id, "at-x")]
        )
    assert (await store.query_spans(rollout_id=c.rollout.rollout_id)).items == []


async def test_span_round_trips_every_field(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    span = Span.model_validate(
        {
            **_span(
                c.rollout.rollout_id, c.attempt.attempt_id, "full", nested={"a": [1, 2, {"b": None}]}
            ).model_dump(),
            "parent_id": "a" * 16,
            "kind": "client",
            "events": [{"name": "e", "time_ns": 5, "attributes": {"x": 1}}],
            "links": [{"trace_id": "b" * 32, "span_id": "c" * 16}],
            "status": {"code": "error", "description": "bad"},
            "resource": {"service.name": "agent"},
        }
    )
    stored = await store.add_span(span)
    (read,) = (await store.query_spans(rollout_id=c.rollout.rollout_id)).items
    assert read == stored and read.attributes["nested"] == {"a": [1, 2, {"b": None}]}


async def test_nul_in_a_reply_is_stored_and_read_back(store: StoreWithReadModel) -> None:
    """A tiny model may emit NUL; PostgreSQL text cannot hold it, and the span must not be lost for it."""
    c = await _claim(store)
    reply = {"role": "assistant", "content": "ok\x00then"}
    attrs = {sc.LLM_API: "chat.completions", sc.LLM_SOURCE: "gateway", sc.LLM_RESPONSE_MESSAGE: reply}
    stored = await store.add_span(_span(c.rollout.rollout_id, c.attempt.attempt_id, "call", **attrs))
    (read,) = (await store.query_spans(rollout_id=c.rollout.rollout_id)).items
    assert read == stored
    assert read.attributes[sc.LLM_RESPONSE_MESSAGE]["content"] == "ok\x00then"
    (digest,) = (await store.query_digests(rollout_ids=[c.rollout.rollout_id])).items
    assert digest.reply in ("ok\x00then", "ok\ufffdthen")  # PostgreSQL's digest column holds U+FFFD


async def test_query_spans_by_name_and_attempt(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    rid, aid = c.rollout.rollout_id, c.attempt.attempt_id
    await store.add_spans([_span(rid, aid, "llm"), _span(rid, aid, "tool"), _span(rid, aid, "llm")])
    assert len((await store.query_spans(rollout_id=rid, name="llm")).items) == 2
    assert len((await store.query_spans(rollout_id=rid, attempt_id=aid)).items) == 3
    assert (await store.query_spans(rollout_id=rid, attempt_id="at-other")).items == []


async def test_query_spans_pagination_is_complete_and_ordered(store: StoreWithReadModel) -> None:
    rollouts = [await _claim(store) for _ in range(3)]
    for c in rollouts:
        await store.add_spans([_span(c.rollout.rollout_id, c.attempt.attempt_id) for _ in range(7)])
    spans = await _all(store.query_spans, limit=4)
    assert len(spans) == 21 and len({s.span_id for s in spans}) == 21
    for c in rollouts:
        seqs = [s.sequence_id for s in spans if s.rollout_id == c.rollout.rollout_id]
        assert seqs == list(range(1, 8))


async def test_query_spans_unknown_rollout(store: StoreWithReadModel) -> None:
    with pytest.raises(NotFoundError):
        await store.query_spans(rollout_id="ro-missing")


async def test_concurrent_span_writers_lose_nothing(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    rid, aid = c.rollout.rollout_id, c.attempt.attempt_id

    async def writer() -> None:
        for _ in range(10):
            await store.add_spans([_span(rid, aid), _span(rid, aid)])

    await asyncio.gather(*(writer() for _ in range(10)))
    spans = await _all(store.query_spans, rollout_id=rid)
    assert len(spans) == 200
    assert sorted(s.sequence_id for s in spans) == list(range(1, 201))


async def test_span_statistics(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    await store.add_spans(
        [_span(c.rollout.rollout_id, c.attempt.attempt_id, blob="x" * 1000) for _ in range(4)]
    )
    stats = await store.statistics()
    assert stats.spans == 4 and stats.span_bytes > 4000


# ----- resources ---------------------------------------------------------------------------


async def test_add_and_get_resources(store: StoreWithReadModel) -> None:
    llm = LLM(endpoint="http://127.0.0.1:1/v1", model="m", sampling_parameters={"temperature": 0.7})
    version = await store.add_resources({"llm": llm, "prompt": PromptTemplate(template="Hi {name}")})
    got = await store.get_resources(version.resources_id)
    assert got == version and got.resources["llm"] == llm
    assert (await store.get_latest_resources()) == version


async def test_resources_versions_increase_and_latest_moves(store: StoreWithReadModel) -> None:
    assert await store.get_latest_resources() is None
    v1 = await store.add_resources({"p": PromptTemplate(template="a")})
    v2 = await store.add_resources({"p": PromptTemplate(template="b")})
    assert v2.version == v1.version + 1
    latest = await store.get_latest_resources()
    assert latest is not None and latest.resources_id == v2.resources_id


async def test_update_resources_derives_a_new_version(store: StoreWithReadModel) -> None:
    base = await store.add_resources({"p": PromptTemplate(template="a"), "j": JsonResource(value=1)})
    derived = await store.update_resources(base.resources_id, {"p": PromptTemplate(template="b")})
    assert derived.parent_id == base.resources_id and derived.resources_id != base.resources_id
    assert derived.resources["j"] == JsonResource(value=1)
    assert (await store.get_resources(base.resources_id)).resources["p"] == PromptTemplate(template="a")


async def test_resources_with_same_id_are_immutable(store: StoreWithReadModel) -> None:
    first = await store.add_resources({"p": PromptTemplate(template="a")}, resources_id="rs-fixed")
    again = await store.add_resources({"p": PromptTemplate(template="a")}, resources_id="rs-fixed")
    assert again == first
    with pytest.raises(ConflictError, match="immutable"):
        await store.add_resources({"p": PromptTemplate(template="b")}, resources_id="rs-fixed")


async def test_resources_from_plain_dicts_and_bad_type(store: StoreWithReadModel) -> None:
    version = await store.add_resources({"p": {"resource_type": "prompt_template", "template": "x"}})  # type: ignore[dict-item]
    assert isinstance(version.resources["p"], PromptTemplate)
    with pytest.raises(StoreError, match="resource_type|p"):
        await store.add_resources({"p": {"resource_type": "nonsense"}})  # type: ignore[dict-item]


async def test_unknown_resources_not_found(store: StoreWithReadModel) -> None:
    with pytest.raises(NotFoundError):
        await store.get_resources("rs-nope")
    with pytest.raises(NotFoundError):
        await store.update_resources("rs-nope", {})


async def test_query_resources_pages_in_version_order(store: StoreWithReadModel) -> None:
    for i in range(5):
        await store.add_resources({"p": PromptTemplate(template=str(i))})
    versions = await _all(store.query_resources, limit=2)
    assert [v.version for v in versions] == sorted(v.version for v in versions) and len(versions) == 5


async def test_rollout_records_resources_it_runs_with(store: StoreWithReadModel) -> None:
    v1 = await store.add_resources({"p": PromptTemplate(template="a")})
    await store.add_resources({"p": PromptTemplate(template="b")})
    rollout = await store.enqueue_rollout(1, resources_id=v1.resources_id)
    claimed = await store.dequeue("w")
    assert claimed is not None and claimed.rollout.resources_id == v1.resources_id == rollout.resources_id


# ----- queries and pagination --------------------------------------------------------------


async def test_query_rollouts_filters(store: StoreWithReadModel) -> None:
    await store.enqueue_rollouts(
        [RolloutCreate(input=i, mode="train" if i % 2 else "val", group_id=f"g{i % 3}") for i in range(12)]
    )
    c = await store.dequeue("w")
    assert c is not None
    assert len((await store.query_rollouts(mode="val")).items) == 6
    assert len((await store.query_rollouts(group_id="g0")).items) == 4
    assert len((await store.query_rollouts(status=[R.PREPARING])).items) == 1
    assert len((await store.query_rollouts(status=[R.QUEUING, R.PREPARING])).items) == 12
    assert (await store.query_rollouts(status=[])).items == []
    ids = [c.rollout.rollout_id, "ro-missing"]
    assert [r.rollout_id for r in (await store.query_rollouts(rollout_ids=ids)).items] == [
        c.rollout.rollout_id
    ]


async def test_query_rollouts_pagination_has_no_gaps_or_repeats(store: StoreWithReadModel) -> None:
    created = await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(23)])
    got = await _all(store.query_rollouts, limit=5)
    assert [r.rollout_id for r in got] == [r.rollout_id for r in created]


async def test_query_rollouts_descending(store: StoreWithReadModel) -> None:
    created = await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(7)])
    got = await _all(store.query_rollouts, limit=3, descending=True)
    assert [r.rollout_id for r in got] == [r.rollout_id for r in reversed(created)]


async def test_query_rollouts_by_updated_at(store: StoreWithReadModel, clock: FakeClock) -> None:
    created = await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(3)])
    clock.advance(1)
    await store.update_rollout(created[0].rollout_id, metadata={"touched": True})
    got = (await store.query_rollouts(order_by="updated_at")).items
    assert got[-1].rollout_id == created[0].rollout_id


async def test_bad_cursor_and_limit_are_rejected(store: StoreWithReadModel) -> None:
    with pytest.raises(StoreError, match="cursor"):
        await store.query_rollouts(cursor="garbage!")
    with pytest.raises(StoreError, match="limit"):
        await store.query_rollouts(limit=0)


async def test_query_attempts_filters(store: StoreWithReadModel) -> None:
    a = await _claim(store, "w1")
    b = await _claim(store, "w2")
    await store.update_attempt(a.rollout.rollout_id, a.attempt.attempt_id, status=A.SUCCEEDED)
    assert [x.attempt_id for x in (await store.query_attempts(worker_id="w2")).items] == [
        b.attempt.attempt_id
    ]
    assert [x.attempt_id for x in (await store.query_attempts(status=[A.SUCCEEDED])).items] == [
        a.attempt.attempt_id
    ]
    assert len(await _all(store.query_attempts, limit=1)) == 2
    with pytest.raises(NotFoundError):
        await store.query_attempts(rollout_id="ro-none")


# ----- waiting -----------------------------------------------------------------------------


def _waiting(store: StoreWithReadModel) -> bool:
    """Whether a ``wait_for_rollouts`` is registered where completions are announced (the server's own
    store, behind an HTTP client): from then on a completion must wake it."""
    return bool(getattr(store, "inner_store", store)._waiters._waiters)


async def test_wait_wakes_on_completion(store: StoreWithReadModel) -> None:
    c = await _claim(store)
    rid = c.rollout.rollout_id
    started = time.monotonic()
    waiter = asyncio.create_task(store.wait_for_rollouts([rid], timeout_s=20))
    await until(lambda: _waiting(store), "wait_for_rollouts to be waiting")
    await store.update_attempt(rid, c.attempt.attempt_id, status=A.SUCCEEDED)
    done = await waiter
    assert [r.status for r in done] == [R.SUCCEEDED]
    assert time.monotonic() - started < 5


async def test_wait_returns_finished_subset_on_timeout(store: StoreWithReadModel) -> None:
    a = await _claim(store)
    b = await _claim(store)
    await store.update_attempt(a.rollout.rollout_id, a.attempt.attempt_id, status=A.SUCCEEDED)
    done = await store.wait_for_rollouts([a.rollout.rollout_id, b.rollout.rollout_id], timeout_s=0.2)
    assert [r.rollout_id for r in done] == [a.rollout.rollout_id]


async def test_wait_many_concurrent_completions(store: StoreWithReadModel) -> None:
    claims = [await _claim(store) for _ in range(20)]

    async def finish(c) -> None:  # type: ignore[no-untyped-def]
        await store.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status=A.SUCCEEDED)

    waiter = asyncio.create_task(
        store.wait_for_rollouts([c.rollout.rollout_id for c in claims], timeout_s=20)
    )
    await until(lambda: _waiting(store), "wait_for_rollouts to be waiting")
    await asyncio.gather(*(finish(c) for c in claims))
    assert len(await waiter) == 20


async def test_wait_unknown_rollout(store: StoreWithReadModel) -> None:
    with pytest.raises(NotFoundError):
        await store.wait_for_rollouts(["ro-missing"], timeout_s=0.1)


# ----- workers and statistics --------------------------------------------------------------


async def test_workers_update_get_query(store: StoreWithReadModel) -> None:
    await store.update_worker("w1", host={"hostname": "a"})
    await store.update_worker("w2", status=WorkerStatus.OFFLINE)
    w1 = await store.get_worker("w1")
    assert w1.host == {"hostname": "a"} and w1.last_heartbeat_at is not None
    offline = (await store.query_workers(status=[WorkerStatus.OFFLINE])).items
    assert [w.worker_id for w in offline] == ["w2"]
    assert [w.worker_id for w in await _all(store.query_workers, limit=1)] == ["w1", "w2"]
    with pytest.raises(NotFoundError):
        await store.get_worker("w-none")


async def test_statistics_counts_by_status(store: StoreWithReadModel) -> None:
    await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(3)])
    c = await store.dequeue("w")
    assert c is not None
    await store.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status=A.SUCCEEDED)
    await store.add_resources({"p": PromptTemplate(template="x")})
    stats = await store.statistics()
    assert stats.rollouts_by_status == {"queuing": 2, "succeeded": 1}
    assert stats.attempts_by_status == {"succeeded": 1}
    assert stats.resources == 1 and stats.workers == 1


async def test_full_lifecycle_under_load(store: StoreWithReadModel) -> None:
    """Many workers run many rollouts with spans and retries; every rollout ends, no span is lost."""
    n = 40
    created = await store.enqueue_rollouts(
        [RolloutCreate(input=i, retry=RetryConfig(max_attempts=2, retry_on=["failed"])) for i in range(n)]
    )
    spans_written = 0

    async def worker(name: str) -> None:
        nonlocal spans_written
        while (c := await store.dequeue(name)) is not None:
            rid, aid = c.rollout.rollout_id, c.attempt.attempt_id
            await store.add_spans([_span(rid, aid, payload="p" * 200) for _ in range(3)])
            spans_written += 3
            fail_first = c.rollout.input % 4 == 0 and c.attempt.attempt_number == 1
            await store.update_attempt(rid, aid, status=A.FAILED if fail_first else A.SUCCEEDED)

    await asyncio.gather(*(worker(f"w{i}") for i in range(8)))
    done = await store.wait_for_rollouts([r.rollout_id for r in created], timeout_s=10)
    assert len(done) == n and all(r.status == R.SUCCEEDED for r in done)
    assert (await store.statistics()).spans == spans_written == 3 * (n + n // 4)
