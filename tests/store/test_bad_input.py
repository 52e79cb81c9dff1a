"""Bad input over real HTTP gets a 4xx naming the problem and leaves what is stored intact, on every backend.

Covers what outside checks found answered 5xx or stored silently: forged page cursors, an
Idempotency-Key reused for another request, rollouts too deep to read back, sequence ids near 2**63,
NaN/Infinity, and FastAPI's own body errors. Each case runs against a real server (uvicorn in a
thread) in front of the memory, SQLite and PostgreSQL stores.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from agl.emit import emit_reward
from agl.errors import AgentError, InvalidSpanError, StoreError
from agl.schemas import AttemptedRollout, RolloutCreate, Span
from agl.schemas._base import MAX_JSON_DEPTH
from agl.schemas.span import MAX_SEQUENCE_ID
from agl.store import InMemoryLightningStore, SqliteLightningStore, StoreWithReadModel
from tests.store.remote_backends import postgres_store, serve

JSON = {"Content-Type": "application/json"}


@contextlib.asynccontextmanager
async def _inner(kind: str, tmp_path: Path) -> AsyncIterator[StoreWithReadModel]:
    if kind == "postgres":
        async with postgres_store() as store:
            yield store
        return
    store = InMemoryLightningStore() if kind == "memory" else SqliteLightningStore(tmp_path / "s.db")
    try:
        yield store
    finally:
        await store.aclose()


class Stack:
    """A backend behind a real server: ``inner`` to inspect, ``http`` (raw httpx) to send bad input."""

    def __init__(self, inner: StoreWithReadModel, http: httpx.AsyncClient, claim: AttemptedRollout) -> None:
        self.inner, self.http, self.claim = inner, http, claim
        self.rollout_id, self.attempt_id = claim.rollout.rollout_id, claim.attempt.attempt_id

    def span(self, **change: Any) -> dict[str, Any]:
        span = Span.new(self.rollout_id, self.attempt_id, "step", {"k": "v"}).model_dump(mode="json")
        span.pop("sequence_id")
        return {**span, **change}

    async def snapshot(self) -> list[Any]:
        """Everything the store holds, as JSON: compared before and after each bad request."""
        rollouts = (await self.inner.query_rollouts(limit=1000)).items
        attempts = (await self.inner.query_attempts(limit=1000)).items
        spans = (await self.inner.query_spans(limit=1000)).items
        stats = await self.inner.statistics()
        return [[m.model_dump(mode="json") for m in group] for group in (rollouts, attempts, spans)] + [
            stats.model_dump(mode="json")
        ]


@pytest.fixture(params=["memory", "sqlite", "postgres"])
async def stack(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Stack]:
    async with _inner(request.param, tmp_path) as inner, serve(inner, close_inner=False) as client:
        await inner.enqueue_rollouts(
            [RolloutCreate(input={"q": 1}, rollout_id="ro-a"), RolloutCreate(input=2)]
        )
        claim = await inner.dequeue("w1")
        assert claim is not None
        await inner.add_spans([Span.new(claim.rollout.rollout_id, claim.attempt.attempt_id, "first")])
        await inner.update_worker("w1", host={"gpu": "h200"})
        async with httpx.AsyncClient(base_url=client.url + "/v1/agl", timeout=30) as http:
            yield Stack(inner, http, claim)


def assert_error(response: httpx.Response, status: int | tuple[int, ...], *named: str) -> dict[str, Any]:
    """A JSON ``{"error": {...}}`` body with the wanted status, naming each of ``named``."""
    statuses = status if isinstance(status, tuple) else (status,)
    assert response.status_code in statuses, response.text
    error = response.json()["error"]
    assert error["type"] and error["message"], error
    for name in named:
        assert name in json.dumps(error), (name, error)
    return error  # type: ignore[no-any-return]


def b64(value: Any) -> str:
    return base64.urlsafe_b64encode(json.dumps(value).encode()).decode()


async def test_forged_cursors_are_400_naming_cursor(stack: Stack) -> None:
    before = await stack.snapshot()
    forged = [
        "garbage",
        "",
        b64([1, 2]),
        b64([[1, {}], 2]),
        b64([["ro", "x"], "s"]),
        b64({"a": 1}),
        b64([None]),
    ]
    forged += [b64([[True, 1], "s"]), b64([[["deep"]], 1]), "%%%", b64([1e308, []])]
    routes = ["/spans/query", "/rollouts/query", "/attempts/query", "/workers/query", "/resources/query"]
    for route in routes:
        for cursor in forged:
            response = await stack.http.post(route, json={"cursor": cursor})
            error = assert_error(response, 400, "cursor")
            assert error["field"] == "cursor", (route, cursor, error)
    for order in ("created_at", "updated_at", "rollout_id"):  # a cursor of another ordering
        response = await stack.http.post(
            "/rollouts/query", json={"cursor": b64([[1], "x"]), "order_by": order}
        )
        assert_error(response, 400, "cursor")
    assert await stack.snapshot() == before
    # a real cursor still pages
    page = (await stack.http.post("/rollouts/query", json={"limit": 1})).json()
    rest = (await stack.http.post("/rollouts/query", json={"limit": 1, "cursor": page["next_cursor"]})).json()
    assert len(page["items"]) == len(rest["items"]) == 1
    assert page["items"][0]["rollout_id"] != rest["items"][0]["rollout_id"]


async def test_idempotency_key_reused_for_another_request_is_409(stack: Stack) -> None:
    first = await stack.http.post(
        f"/rollouts/{stack.rollout_id}/sequence_id", headers={"Idempotency-Key": "k1"}
    )
    assert first.status_code == 200
    before = await stack.snapshot()
    reuses = [
        ("/rollouts/dequeue", {"worker_id": "w2"}),
        ("/rollouts/start", {"rollout": {"input": 1}}),
        ("/resources", {"resources": {}}),
    ]
    for path, body in reuses:
        response = await stack.http.post(path, json=body, headers={"Idempotency-Key": "k1"})
        error = assert_error(response, 409, "Idempotency-Key", "another request")
        assert error["field"] == "Idempotency-Key"
    other_rollout = await stack.http.post("/rollouts/ro-other/sequence_id", headers={"Idempotency-Key": "k1"})
    assert_error(other_rollout, 409, "Idempotency-Key")
    assert await stack.snapshot() == before  # nothing was claimed, started or added
    # the same request with the same key is still answered from the cache, not run again
    again = await stack.http.post(
        f"/rollouts/{stack.rollout_id}/sequence_id", headers={"Idempotency-Key": "k1"}
    )
    assert again.json() == first.json()
    claim = await stack.http.post(
        "/rollouts/dequeue", json={"worker_id": "w2"}, headers={"Idempotency-Key": "k2"}
    )
    changed_body = await stack.http.post(
        "/rollouts/dequeue", json={"worker_id": "w3"}, headers={"Idempotency-Key": "k2"}
    )
    assert_error(changed_body, 409, "Idempotency-Key")
    replay = await stack.http.post(
        "/rollouts/dequeue", json={"worker_id": "w2"}, headers={"Idempotency-Key": "k2"}
    )
    assert replay.json()["attempt"]["attempt_id"] == claim.json()["attempt"]["attempt_id"]


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"n": value}
    return value


EDGE_VALUES: list[Any] = [
    nested(MAX_JSON_DEPTH),
    {"ints": [2**64 - 1, -(2**63), 0], "floats": [1e308, -1e-308, -0.0, 0.5]},
    {"text": ["", "nul\u0000byte", "émoji 🎲", "\u2028", 'a\\b"c'], "": "empty key", "é": None},
    [True, False, None, [], {}],
    "just a string",
]


async def test_too_deep_or_unstorable_rollouts_are_rejected_at_the_door(stack: Stack) -> None:
    before = await stack.snapshot()
    bad: list[tuple[str, dict[str, Any], str]] = [
        ("too deep input", {"input": nested(MAX_JSON_DEPTH + 1)}, "rollouts.0.input"),
        ("250 levels", {"input": nested(250)}, "rollouts.0.input"),
        ("too deep metadata", {"metadata": {"m": nested(MAX_JSON_DEPTH)}}, "rollouts.0.metadata"),
        ("int beyond 64 bits", {"input": {"seed": 2**64}}, "rollouts.0.input"),
        ("negative int beyond 64 bits", {"input": [-(2**63) - 1]}, "rollouts.0.input"),
    ]
    for name, rollout, field in bad:
        response = await stack.http.post(
            "/rollouts", content=json.dumps({"rollouts": [rollout]}), headers=JSON
        )
        error = assert_error(response, 422, field)
        assert error["field"] == field, (name, error)
    start = await stack.http.post(
        "/rollouts/start", content=json.dumps({"rollout": {"input": nested(300)}}), headers=JSON
    )
    assert_error(start, 422, "rollout.input", "deeper than 64")
    assert await stack.snapshot() == before
    # the Python API refuses the same input with an exception naming it
    with pytest.raises(ValidationError, match="nests deeper than 64"):
        RolloutCreate(input=nested(MAX_JSON_DEPTH + 1))
    with pytest.raises(StoreError, match="rollout 0 of the batch is malformed.*input"):
        await stack.inner.enqueue_rollouts([{"input": nested(100)}])  # type: ignore[list-item]
    with pytest.raises(StoreError, match="metadata.*deeper"):
        await stack.inner.update_rollout(stack.rollout_id, metadata={"x": nested(MAX_JSON_DEPTH)})
    with pytest.raises(ValidationError, match="not a JSON value"):
        RolloutCreate(input={"when": object()})
    assert await stack.snapshot() == before


async def test_everything_the_door_accepts_reads_back_and_dequeues(stack: Stack) -> None:
    """The limits leave no gap: each backend stores and returns the edge values the door lets in."""
    while await stack.inner.dequeue("drain") is not None:
        pass
    metadata = [{"edge": nested(MAX_JSON_DEPTH - 1)}] + [{"edge": value} for value in EDGE_VALUES[1:]]
    bodies = [
        {"input": value, "metadata": meta, "rollout_id": f"ro-edge-{n}"}
        for n, (value, meta) in enumerate(zip(EDGE_VALUES, metadata, strict=True))
    ]
    response = await stack.http.post("/rollouts", content=json.dumps({"rollouts": bodies}), headers=JSON)
    assert response.status_code == 200, response.text
    for n, value in enumerate(EDGE_VALUES):
        got = await stack.http.get(f"/rollouts/ro-edge-{n}")
        assert got.status_code == 200, got.text
        assert got.json()["input"] == value and got.json()["metadata"] == metadata[n]
    claimed = []
    while (claim := await stack.http.post("/rollouts/dequeue", json={"worker_id": "w"})).json() is not None:
        claimed.append(claim.json()["rollout"]["input"])
    assert claimed == EDGE_VALUES
    spans = [stack.span(attributes=meta) for meta in metadata]
    assert (
        await stack.http.post("/spans", content=json.dumps({"spans": spans}), headers=JSON)
    ).status_code == 200
    stored = (
        await stack.http.post("/spans/query", json={"rollout_id": stack.rollout_id, "name": "step"})
    ).json()
    assert [s["attributes"] for s in stored["items"]] == metadata


async def test_sequence_ids_that_would_overflow_are_rejected_and_the_rollout_keeps_working(
    stack: Stack,
) -> None:
    before = await stack.snapshot()
    for bad in (2**63 - 1, 2**63, 2**64, MAX_SEQUENCE_ID + 1, -1):
        response = await stack.http.post(
            "/spans", content=json.dumps({"spans": [stack.span(sequence_id=bad)]}), headers=JSON
        )
        assert_error(response, 422, "spans.0.sequence_id")
    with pytest.raises(InvalidSpanError, match="sequence_id .* is above"):
        await stack.inner.add_spans([Span.new(stack.rollout_id, stack.attempt_id, "s", sequence_id=2**63)])
    assert await stack.snapshot() == before
    at_limit = await stack.http.post("/spans", json={"spans": [stack.span(sequence_id=MAX_SEQUENCE_ID)]})
    assert at_limit.status_code == 200, at_limit.text
    later = await stack.http.post("/spans", json={"spans": [stack.span(), stack.span()]})
    assert later.status_code == 200, later.text
    assert [s["sequence_id"] for s in later.json()] == [MAX_SEQUENCE_ID + 1, MAX_SEQUENCE_ID + 2]
    next_id = await stack.http.post(f"/rollouts/{stack.rollout_id}/sequence_id")
    assert next_id.json() == MAX_SEQUENCE_ID + 3
    spans = (await stack.http.post("/spans/query", json={"rollout_id": stack.rollout_id})).json()["items"]
    assert [s["sequence_id"] for s in spans][-3:] == [
        MAX_SEQUENCE_ID,
        MAX_SEQUENCE_ID + 1,
        MAX_SEQUENCE_ID + 2,
    ]


async def test_nan_and_infinity_are_4xx_naming_the_field(stack: Stack) -> None:
    rid, aid = stack.rollout_id, stack.attempt_id
    span = json.dumps(stack.span())

    def spans(old: str, new: str) -> str:
        assert old in span
        return '{"spans": [' + span.replace(old, new) + "]}"

    cases: list[
        tuple[str, str, str, str]
    ] = [  # method, path, raw JSON body (Python writes NaN literals), field
        ("POST", "/spans", spans('"k": "v"', '"k": NaN'), "attributes.k"),
        (
            "POST",
            "/spans",
            spans('"resource": {}', '"resource": {"r": [Infinity]}'),
            "resource.r[0]",
        ),
        (
            "POST",
            "/spans",
            spans('"events": []', '"events": [{"name": "e", "time_ns": 1, "attributes": {"x": -Infinity}}]'),
            "attributes.x",
        ),
        ("POST", "/rollouts", '{"rollouts": [{"input": {"a": [1, NaN]}}]}', "input.a[1]"),
        ("POST", "/rollouts", '{"rollouts": [{"metadata": {"score": Infinity}}]}', "metadata.score"),
        ("POST", "/rollouts/start", '{"rollout": {"input": NaN}}', "input"),
        ("PATCH", f"/rollouts/{rid}", '{"metadata": {"reward": NaN}}', "metadata.reward"),
        (
            "PATCH",
            f"/rollouts/{rid}/attempts/{aid}",
            '{"metadata": {"reward": -Infinity}}',
            "metadata.reward",
        ),
        ("PUT", "/workers/w1", '{"host": {"load": NaN}}', "host.load"),
        ("POST", "/resources", '{"resources": {}, "metadata": {"lr": Infinity}}', "metadata.lr"),
    ]
    before = await stack.snapshot()
    for method, path, body, field in cases:
        response = await stack.http.request(method, path, content=body, headers=JSON)
        assert_error(response, 422, field, "NaN or Infinity")
    assert await stack.snapshot() == before
    # the Python API: a clear exception, nothing stored
    with pytest.raises(ValidationError, match="attributes.reward is nan"):
        Span.new(rid, aid, "r", {"reward": math.nan})
    for call in (
        stack.inner.update_rollout(rid, metadata={"x": math.inf}),
        stack.inner.update_attempt(rid, aid, metadata={"x": {"y": [math.nan]}}),
        stack.inner.update_worker("w1", host={"x": -math.inf}),
        stack.inner.add_resources({}, metadata={"x": math.nan}),
    ):
        with pytest.raises(StoreError, match="NaN or Infinity"):
            await call
    assert await stack.snapshot() == before


async def test_nul_in_ids_and_names_is_422_on_every_backend(stack: Stack) -> None:
    """PostgreSQL's text columns refuse NUL, so every backend refuses it at the door alike."""
    before = await stack.snapshot()
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/rollouts", {"rollouts": [{"rollout_id": "ro-\u0000"}]}, "rollouts.0.rollout_id"),
        ("/rollouts", {"rollouts": [{"mode": "tr\u0000ain"}]}, "rollouts.0.mode"),
        ("/rollouts", {"rollouts": [{"group_id": "\u0000"}]}, "rollouts.0.group_id"),
        ("/rollouts/start", {"rollout": {}, "worker_id": "w\u0000"}, "worker_id"),
        ("/rollouts/dequeue", {"worker_id": "w\u0000"}, "worker_id"),
        ("/resources", {"resources": {}, "resources_id": "rs-\u0000"}, "resources_id"),
        ("/spans", {"spans": [stack.span(name="a\u0000b")]}, "spans.0.name"),
    ]
    for path, body, field in cases:
        assert_error(await stack.http.post(path, json=body), 422, field, "NUL")
    assert await stack.snapshot() == before
    ok = await stack.http.post("/rollouts", json={"rollouts": [{"input": "text with \u0000 is fine"}]})
    assert ok.status_code == 200 and ok.json()[0]["input"] == "text with \u0000 is fine"


def test_emit_reward_refuses_nan_at_the_agent() -> None:
    for value in (math.nan, math.inf, {"a": 1.0, "b": -math.inf}):
        with pytest.raises(AgentError, match="finite"):
            emit_reward(value, local=True)
    assert emit_reward(0.5, local=True).attributes["agl.reward.value"] == 0.5


async def test_fastapi_body_errors_use_the_error_shape(stack: Stack) -> None:
    cases: list[tuple[str, str, bytes, int, str | None]] = [
        ("POST", "/rollouts", b"{not json", 400, None),
        ("POST", "/rollouts/query", b"[", 400, None),
        ("POST", "/spans/query", b'{"limit": "many"}', 422, "limit"),
        ("POST", "/rollouts", b"[]", 422, None),
        ("PUT", "/workers/w9", b'{"status": 7}', 422, "status"),
        ("POST", "/rollouts/wait", b'{"rollout_ids": []}', 422, "rollout_ids"),
    ]
    for method, path, body, status, field in cases:
        response = await stack.http.request(method, path, content=body, headers=JSON)
        error = assert_error(response, status)
        assert error["type"] == "ValidationError"
        assert error.get("field") == field, (path, error)
        if status == 400:
            assert "not valid JSON" in error["message"]
    unknown = await stack.http.get("/no/such/route")
    assert assert_error(unknown, 404, "/no/such/route")["type"] == "NotFoundError"
    wrong_method = await stack.http.delete("/rollouts/query")
    assert assert_error(wrong_method, 405)["type"] == "MethodNotAllowed"
