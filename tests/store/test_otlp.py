"""OTLP/HTTP ingest with the real OpenTelemetry SDK exporter (protobuf) and OTLP JSON."""

from __future__ import annotations

import json

import httpx
import pytest

from agl import semconv as sc
from agl.store import InMemoryLightningStore
from tests.store.remote_backends import serve


async def test_sdk_exporter_protobuf_into_the_store() -> None:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    async with serve(InMemoryLightningStore()) as client:
        claimed = await _claimed(client)
        rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
        provider = TracerProvider(
            resource=Resource.create({sc.ROLLOUT_ID: rid, "service.name": "otel-agent"})
        )
        provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{client.url}/v1/traces")))
        tracer = provider.get_tracer("test")
        import asyncio

        def emit() -> None:
            with (
                tracer.start_as_current_span(
                    "plan", attributes={sc.ATTEMPT_ID: aid, "step": 1, "tags": ["a", "b"]}
                ),
                tracer.start_as_current_span("act", attributes={sc.ATTEMPT_ID: aid, "ok": True}) as act,
            ):
                act.add_event("tool", {"name": "calc"})
            provider.shutdown()

        await asyncio.to_thread(emit)  # the exporter blocks; the server runs on its own thread
        spans = (await client.query_spans(rollout_id=rid)).items
        by_name = {s.name: s for s in spans}
        assert set(by_name) == {"plan", "act"}
        assert by_name["act"].parent_id == by_name["plan"].span_id
        assert by_name["plan"].attributes["step"] == 1 and by_name["plan"].attributes["tags"] == ["a", "b"]
        assert by_name["act"].events[0].attributes == {"name": "calc"}
        assert by_name["plan"].resource["service.name"] == "otel-agent"
        assert [s.sequence_id for s in sorted(spans, key=lambda s: s.sequence_id or 0)] == [1, 2]


async def test_json_encoding_and_missing_ids() -> None:
    async with serve(InMemoryLightningStore()) as client:
        claimed = await _claimed(client)
        rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
        span = {
            "traceId": "0af7651916cd43dd8448eb211c80319c",
            "spanId": "b7ad6b7169203331",
            "name": "json-span",
            "kind": 3,
            "startTimeUnixNano": "1700000000000000000",
            "endTimeUnixNano": "1700000000500000000",
            "attributes": [
                {"key": sc.ATTEMPT_ID, "value": {"stringValue": aid}},
                {"key": "n", "value": {"intValue": "7"}},
                {
                    "key": "nested",
                    "value": {"kvlistValue": {"values": [{"key": "x", "value": {"doubleValue": 0.5}}]}},
                },
            ],
            "status": {"code": 2, "message": "boom"},
        }
        body = {
            "resourceSpans": [
                {
                    "resource": {"attributes": [{"key": sc.ROLLOUT_ID, "value": {"stringValue": rid}}]},
                    "scopeSpans": [{"spans": [span]}],
                }
            ]
        }
        async with httpx.AsyncClient() as http:
            ok = await http.post(f"{client.url}/v1/traces", json=body)
            assert ok.status_code == 200, ok.text
            (stored,) = (await client.query_spans(rollout_id=rid)).items
            assert stored.kind.value == "client" and stored.attributes["n"] == 7
            assert stored.attributes["nested"] == {"x": 0.5} and stored.status.code.value == "error"
            no_ids = json.loads(json.dumps(body))
            no_ids["resourceSpans"][0]["resource"]["attributes"] = []
            bad = await http.post(f"{client.url}/v1/traces", json=no_ids)
            assert bad.status_code == 400 and sc.ROLLOUT_ID in bad.json()["error"]["message"]
            garbage = await http.post(
                f"{client.url}/v1/traces",
                content=b"\x00\xffnot protobuf",
                headers={"Content-Type": "application/x-protobuf"},
            )
            assert garbage.status_code == 400


async def _claimed(client):  # type: ignore[no-untyped-def]
    await client.enqueue_rollout("otlp")
    claimed = await client.dequeue("w")
    assert claimed is not None
    return claimed


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
