"""Span building (secrets scrubbed, failed calls recorded) and the gateway's use of the span writer (never blocks, counts drops)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence

import orjson

from agl import semconv as sc
from agl.gateway.recording import CallRecord, build_span
from agl.schemas import LLMCall
from agl.schemas.rollout import RolloutCreate
from agl.schemas.span import Span, StatusCode
from agl.store import InMemoryLightningStore
from agl.tracer.writer import SpanWriter


def record(rid: str, aid: str, **fields: object) -> CallRecord:
    base: dict[str, object] = dict(
        rollout_id=rid, attempt_id=aid, resources_id=None, api="chat.completions",
        request={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, start_ns=1_000_000, end_ns=3_500_000,
        status_code=200, backend="http://b/v1",
    )  # fmt: skip
    base.update(fields)
    return CallRecord(**base)  # type: ignore[arg-type]


def test_failed_call_span_and_traceparent() -> None:
    span = build_span(
        record(
            "r",
            "a",
            status_code=502,
            error="upstream failed after 3 attempts",
            trace_id="ab" * 16,
            parent_id="cd" * 8,
        )
    )
    call = LLMCall.from_span(span)
    assert call is not None and call.error == "upstream failed after 3 attempts" and not call.has_token_ids
    assert span.status.code == StatusCode.ERROR and span.attributes[sc.LLM_LATENCY_MS] == 2.5
    assert (span.trace_id, span.parent_id) == ("ab" * 16, "cd" * 8)


def test_request_secret_keys_and_values_are_scrubbed() -> None:
    secret = "sk-live-very-secret"
    req = {"model": "m", "api_key": secret, "messages": [{"role": "user", "content": f"key={secret}"}],
           "metadata": {"Authorization": "Bearer zzz"}}  # fmt: skip
    body = {
        "id": "x",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": f"got {secret}"}}],
    }
    span = build_span(record("r", "a", request=req, response=orjson.dumps(body), secrets=(secret,)))
    text = span.model_dump_json()
    assert secret not in text and "zzz" not in text
    assert span.attributes[sc.LLM_REQUEST]["api_key"] == "[redacted]"
    assert span.attributes[sc.LLM_RESPONSE_MESSAGE]["content"] == "got [redacted]"


class GatedStore(InMemoryLightningStore):
    """A real store whose writes wait until the test opens the gate (a slow backend)."""

    def __init__(self) -> None:
        super().__init__(watchdog_interval_s=0)
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        self.entered.set()
        await self.gate.wait()
        return await super().add_spans(spans)


async def test_writer_drops_call_records_when_full_and_flushes_the_rest() -> None:
    store = GatedStore()
    started = await store.start_rollout(RolloutCreate())
    rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
    writer = SpanWriter(store, queue_size=2, batch_size=10)
    assert writer.submit(functools.partial(build_span, record(rid, aid)))
    await asyncio.wait_for(
        store.entered.wait(), 10
    )  # the first is taken by the writer, now waiting on the gate
    for _ in range(5):
        writer.submit(functools.partial(build_span, record(rid, aid)))  # returns at once: the store is stuck
    assert writer.stats.dropped == 3
    store.gate.set()
    await writer.flush()
    assert writer.stats.written == 3 and len((await store.query_spans(rollout_id=rid)).items) == 3
    writer.submit(
        functools.partial(build_span, record("unknown-rollout", "a"))
    )  # rejected: counted, not fatal
    writer.submit(functools.partial(build_span, record(rid, aid)))
    await writer.aclose()
    assert writer.stats.failed == 1 and writer.stats.written == 4
