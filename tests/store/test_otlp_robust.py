"""OTLP ingest under bad and compressed input: wrong shapes are 400 naming the place, gzip is accepted.

A real server (uvicorn in a thread), the real OpenTelemetry SDK exporter with gzip and deflate, and
raw httpx requests. Every rejected request must leave the store exactly as it was.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import gzip
import json
import random
import zlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from agl import semconv as sc
from agl.asgi_server import BackgroundServer
from agl.schemas import RolloutCreate
from agl.store import InMemoryLightningStore, SqliteLightningStore
from agl.store.server import create_app

LIMIT = 300_000
TRACE, SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"


class Served:
    def __init__(self, store: Any, url: str, rollout_id: str, attempt_id: str) -> None:
        self.store, self.url, self.rollout_id, self.attempt_id = store, url, rollout_id, attempt_id

    def request(self, spans: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A valid OTLP JSON export of ``spans`` (one span by default) for the claimed attempt."""
        ids = [
            {"key": sc.ROLLOUT_ID, "value": {"stringValue": self.rollout_id}},
            {"key": sc.ATTEMPT_ID, "value": {"stringValue": self.attempt_id}},
        ]
        if spans is None:
            spans = [
                {
                    "traceId": TRACE,
                    "spanId": SPAN,
                    "name": "json-span",
                    "kind": 3,
                    "startTimeUnixNano": "1700000000000000000",
                    "endTimeUnixNano": "1700000000500000000",
                    "attributes": [
                        {"key": "n", "value": {"intValue": "-7"}},
                        {"key": "x", "value": {"doubleValue": 0.5}},
                        {"key": "l", "value": {"arrayValue": {"values": [{"stringValue": "a"}]}}},
                        {
                            "key": "m",
                            "value": {
                                "kvlistValue": {"values": [{"key": "k", "value": {"boolValue": True}}]}
                            },
                        },
                    ],
                    "events": [{"name": "e", "timeUnixNano": "1700000000100000000", "attributes": []}],
                    "status": {"code": 1},
                }
            ]
        return {"resourceSpans": [{"resource": {"attributes": ids}, "scopeSpans": [{"spans": spans}]}]}

    async def stored(self) -> list[dict[str, Any]]:
        return [
            s.model_dump(mode="json")
            for s in (await self.store.query_spans(rollout_id=self.rollout_id)).items
        ]


@pytest.fixture(params=["memory", "sqlite"])
async def served(request: pytest.FixtureRequest, tmp_path: Any) -> AsyncIterator[Served]:
    store = InMemoryLightningStore() if request.param == "memory" else SqliteLightningStore(tmp_path / "o.db")
    await store.enqueue_rollouts([RolloutCreate(input=1)])
    claim = await store.dequeue("w")
    assert claim is not None
    with BackgroundServer(create_app(store, max_body_bytes=LIMIT)) as server:
        yield Served(store, server.url, claim.rollout.rollout_id, claim.attempt.attempt_id)
    await store.aclose()


def post(served: Served, body: bytes, **headers: str) -> httpx.Response:
    headers.setdefault("Content-Type", "application/json")
    return httpx.post(f"{served.url}/v1/traces", content=body, headers=headers, timeout=30)


def assert_400(response: httpx.Response, *named: str) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] and error["message"]
    for name in named:
        assert name in json.dumps(error), (name, error)
    return error  # type: ignore[no-any-return]


WRONG_SHAPES: list[tuple[str, Any, str]] = [  # name, body (None: replace by the test), what the error names
    ("array body", [], "<body>"),
    ("string body", "x", "<body>"),
    ("resourceSpans a string", {"resourceSpans": "x"}, "resourceSpans"),
    ("resourceSpans of numbers", {"resourceSpans": [1]}, "resourceSpans[0]"),
    ("scopeSpans an object", {"resourceSpans": [{"scopeSpans": {}}]}, "resourceSpans[0].scopeSpans"),
    ("span a string", {"resourceSpans": [{"scopeSpans": [{"spans": ["x"]}]}]}, "spans[0]"),
    (
        "resource attributes a string",
        {"resourceSpans": [{"resource": {"attributes": "x"}}]},
        "resource.attributes",
    ),
    ("resource a list", {"resourceSpans": [{"resource": []}]}, "resourceSpans[0].resource"),
]
SPAN_CHANGES: list[tuple[str, dict[str, Any], str]] = [
    ("start time not a number", {"startTimeUnixNano": "abc"}, "startTimeUnixNano"),
    ("start time an object", {"startTimeUnixNano": {}}, "startTimeUnixNano"),
    ("start time negative", {"startTimeUnixNano": "-5"}, "startTimeUnixNano"),
    ("end time beyond 64 bits", {"endTimeUnixNano": str(2**64)}, "endTimeUnixNano"),
    ("start time a float", {"startTimeUnixNano": 1.5}, "startTimeUnixNano"),
    ("kind a list", {"kind": [3]}, "kind"),
    ("name a number", {"name": 5}, "name"),
    ("trace id a number", {"traceId": 5}, "traceId"),
    ("trace id not hex", {"traceId": "zz" * 16}, "trace_id"),
    ("attributes an object", {"attributes": {"a": 1}}, "attributes"),
    (
        "attribute key a number",
        {"attributes": [{"key": 1, "value": {"stringValue": "v"}}]},
        "attributes[0].key",
    ),
    ("attribute value a list", {"attributes": [{"key": "k", "value": []}]}, "attributes[0].value"),
    ("intValue not a number", {"attributes": [{"key": "k", "value": {"intValue": "x"}}]}, "intValue"),
    ("doubleValue NaN", {"attributes": [{"key": "k", "value": {"doubleValue": "NaN"}}]}, "doubleValue"),
    (
        "doubleValue Infinity",
        {"attributes": [{"key": "k", "value": {"doubleValue": "-Infinity"}}]},
        "doubleValue",
    ),
    ("arrayValue a string", {"attributes": [{"key": "k", "value": {"arrayValue": "x"}}]}, "arrayValue"),
    ("events an object", {"events": {}}, "events"),
    ("event time a word", {"events": [{"name": "e", "timeUnixNano": "soon"}]}, "events[0].timeUnixNano"),
    ("links of strings", {"links": ["l"]}, "links[0]"),
    ("status a string", {"status": "ok"}, "status"),
    ("status code a dict", {"status": {"code": {}}}, "status.code"),
]


async def test_wrong_shapes_are_400_naming_the_place(served: Served) -> None:
    assert post(served, json.dumps(served.request()).encode()).status_code == 200
    before = await served.stored()
    cases = [(name, json.dumps(body).encode(), named) for name, body, named in WRONG_SHAPES]
    for name, change, named in SPAN_CHANGES:
        request = served.request()
        request["resourceSpans"][0]["scopeSpans"][0]["spans"][0].update(change, spanId="c" * 16)
        cases.append((name, json.dumps(request).encode(), named))
    cases += [("not json", b"{", "not JSON"), ("bad protobuf", b"\xff\x00garbage", "protobuf")]
    for name, body, named in cases:
        content_type = "application/x-protobuf" if name == "bad protobuf" else "application/json"
        error = assert_400(post(served, body, **{"Content-Type": content_type}), named)
        assert "Internal" not in error["message"], name
    assert await served.stored() == before


def mutations(document: Any, rng: random.Random, count: int) -> Iterator[Any]:
    """Copies of ``document`` with one node swapped for a random JSON value of the wrong kind."""
    junk: list[Any] = [None, "x", "", -1, 2**70, 1.5, True, [], {}, [1, "a"], {"k": []}, "NaN", "-9"]
    paths: list[list[Any]] = []

    def walk(node: Any, path: list[Any]) -> None:
        paths.append(path)
        children = (
            node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
        )
        for key, child in children:
            walk(child, [*path, key])

    walk(document, [])
    for _ in range(count):
        mutated = copy.deepcopy(document)
        path = rng.choice(paths[1:])
        parent = mutated
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = rng.choice(junk)
        yield mutated


async def test_fuzzed_documents_never_get_a_5xx(served: Served) -> None:
    """200 single-node mutations of a valid export: each answer is 200 or a 4xx with an error body."""
    rng = random.Random(12)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=served.url, timeout=30) as client:
        for n in range(200):
            valid = served.request()
            valid["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["spanId"] = f"{n + 1:016x}"  # each one new
            document = next(mutations(valid, rng, 1))
            response = client.post("/v1/traces", json=document)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (document, response.text)
            if response.status_code != 200:
                assert response.json()["error"]["message"], response.text
    assert statuses.get(200) and statuses.get(400), statuses  # the fuzz reached both outcomes
    for span in await served.stored():  # whatever got in reads back as a valid span
        assert span["rollout_id"] == served.rollout_id


def protobuf_request(served: Served) -> bytes:
    from google.protobuf.json_format import ParseDict
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    document = served.request()
    span = document["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    span["traceId"] = base64.b64encode(bytes.fromhex(TRACE)).decode()  # protobuf JSON writes bytes as base64
    span["spanId"] = base64.b64encode(bytes.fromhex("d" * 16)).decode()
    return ParseDict(document, ExportTraceServiceRequest()).SerializeToString()  # type: ignore[no-any-return]


async def test_gzip_and_deflate_bodies_are_accepted(served: Served) -> None:
    body = json.dumps(served.request()).encode()
    ok = post(served, gzip.compress(body), **{"Content-Encoding": "gzip"})
    assert ok.status_code == 200 and ok.json()["accepted"] == 1, ok.text
    proto = protobuf_request(served)
    ok = post(
        served, gzip.compress(proto), **{"Content-Encoding": "gzip", "Content-Type": "application/x-protobuf"}
    )
    assert ok.status_code == 200 and ok.json()["accepted"] == 1, ok.text
    other = json.loads(body.replace(SPAN.encode(), b"e" * 16))
    ok = post(served, zlib.compress(json.dumps(other).encode()), **{"Content-Encoding": "deflate"})
    assert ok.status_code == 200, ok.text
    stored = {s["span_id"]: s for s in await served.stored()}
    assert set(stored) == {SPAN, "d" * 16, "e" * 16}
    assert stored[SPAN]["attributes"] == {"n": -7, "x": 0.5, "l": ["a"], "m": {"k": True}}
    assert stored["d" * 16]["attributes"] == stored[SPAN]["attributes"]


async def test_bad_compression_is_400_and_a_zip_bomb_stops_at_the_limit(served: Served) -> None:
    body = json.dumps(served.request()).encode()
    assert_400(post(served, b"not gzip at all", **{"Content-Encoding": "gzip"}), "gzip")
    assert_400(post(served, gzip.compress(body)[:-12], **{"Content-Encoding": "gzip"}), "truncated")
    assert_400(post(served, gzip.compress(body) + b"junk", **{"Content-Encoding": "gzip"}), "gzip")
    assert_400(post(served, body, **{"Content-Encoding": "br"}), "br", "not supported")
    bomb = gzip.compress(b" " * (50 * LIMIT))  # ~15 KB on the wire, 15 MB inflated
    assert len(bomb) < LIMIT
    response = post(served, bomb, **{"Content-Encoding": "gzip"})
    assert response.status_code == 413 and "decompressed" in response.json()["error"]["message"]
    just_under = gzip.compress(body + b" " * (LIMIT - len(body)))
    assert post(served, just_under, **{"Content-Encoding": "gzip"}).status_code == 200
    assert len(await served.stored()) == 1


@pytest.mark.parametrize("compression", ["Gzip", "Deflate"])
async def test_the_sdk_exporter_with_compression(compression: str, tmp_path: Any) -> None:
    from opentelemetry.exporter.otlp.proto.http import Compression
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    store = InMemoryLightningStore()
    await store.enqueue_rollouts([RolloutCreate(input=1)])
    claim = await store.dequeue("w")
    assert claim is not None
    rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
    with BackgroundServer(create_app(store)) as server:
        exporter = OTLPSpanExporter(endpoint=f"{server.url}/v1/traces", compression=Compression[compression])
        provider = TracerProvider(resource=Resource.create({sc.ROLLOUT_ID: rid, sc.ATTEMPT_ID: aid}))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        tracer = provider.get_tracer("gzip-test")

        def emit() -> None:
            with (
                tracer.start_as_current_span("outer", attributes={"big": "x" * 20_000}),
                tracer.start_as_current_span("inner", attributes={"step": 2}),
            ):
                pass
            provider.shutdown()

        await asyncio.to_thread(emit)
        spans = {s.name: s for s in (await store.query_spans(rollout_id=rid)).items}
    assert set(spans) == {"outer", "inner"}
    assert spans["outer"].attributes["big"] == "x" * 20_000 and spans["inner"].attributes["step"] == 2
    assert spans["inner"].parent_id == spans["outer"].span_id
    await store.aclose()
