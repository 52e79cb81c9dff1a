"""The hot routes answer exactly as the FastAPI routes they stand in for: same statuses, same errors."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from agl.schemas import Attempt, AttemptedRollout, Rollout, RolloutCreate, Span
from agl.store import InMemoryLightningStore
from agl.store._wire import StoredSpan
from agl.store.server import create_app

Case = Callable[[str], tuple[str, str, bytes]]  # attempt id -> (method, path, body)
ATTEMPT = "/rollouts/ro-1/attempts/{}"


def spans_body(attempt_id: str, **change: Any) -> bytes:
    span = Span.new("ro-1", attempt_id, "step", {"x": [1, {"y": "z"}]}).model_dump(mode="json")
    return json.dumps({"spans": [{**span, **change}]}).encode()


CASES: dict[str, Case] = {
    "dequeue": lambda a: ("POST", "/rollouts/dequeue", b'{"worker_id": "w2"}'),
    "dequeue bad json": lambda a: ("POST", "/rollouts/dequeue", b"{nope"),
    "dequeue no body": lambda a: ("POST", "/rollouts/dequeue", b""),
    "dequeue wrong type": lambda a: ("POST", "/rollouts/dequeue", b'{"worker_id": 5}'),
    "dequeue unknown field": lambda a: ("POST", "/rollouts/dequeue", b'{"worker_id": "w", "x": 1}'),
    "dequeue not an object": lambda a: ("POST", "/rollouts/dequeue", b"[]"),
    "spans": lambda a: ("POST", "/spans", spans_body(a)),
    "spans bad span id": lambda a: ("POST", "/spans", spans_body(a, span_id="XYZ")),
    "spans unknown attempt": lambda a: ("POST", "/spans", spans_body("at-missing")),
    "spans end before start": lambda a: ("POST", "/spans", spans_body(a, start_time_ns=10, end_time_ns=5)),
    "update attempt": lambda a: ("PATCH", ATTEMPT.format(a), b'{"status": "succeeded"}'),
    "update attempt bad status": lambda a: ("PATCH", ATTEMPT.format(a), b'{"status": "done"}'),
    "update attempt unknown": lambda a: ("PATCH", ATTEMPT.format("at-missing"), b'{"status": "failed"}'),
    "update attempt unknown rollout": lambda a: ("PATCH", "/rollouts/ro-9/attempts/at-9", b"{}"),
    "update attempt backwards": lambda a: ("PATCH", ATTEMPT.format(a), b'{"status": "preparing"}'),
    "heartbeat": lambda a: ("POST", ATTEMPT.format(a) + "/heartbeat", b""),
    "heartbeat unknown": lambda a: ("POST", ATTEMPT.format("at-missing") + "/heartbeat", b""),
}
ANSWERS: dict[str, type[BaseModel]] = {
    "/rollouts/dequeue": AttemptedRollout,
    "/spans": StoredSpan,
    "/heartbeat": Rollout,
    "/attempts/": Attempt,
}


async def answer(case: Case, hot: bool) -> tuple[str, int, Any]:
    store = InMemoryLightningStore()
    await store.enqueue_rollouts([RolloutCreate(input=1, rollout_id="ro-1"), RolloutCreate(input=2)])
    claim = await store.dequeue("w1")
    assert claim is not None
    guard = create_app(store)
    method, path, body = case(claim.attempt.attempt_id)
    app = guard if hot else guard.app  # the guard answers hot routes itself; .app is FastAPI alone
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://store/v1/agl") as client:
        response = await client.request(
            method, path, content=body, headers={"Content-Type": "application/json"}
        )
    return path, response.status_code, response.json()


@pytest.mark.parametrize("name", list(CASES))
async def test_hot_route_answers_as_fastapi_does(name: str) -> None:
    path, hot_status, hot_body = await answer(CASES[name], hot=True)
    _, status, body = await answer(CASES[name], hot=False)
    assert hot_status == status, (hot_body, body)
    if status >= 400:
        hot_error, error = hot_body["error"], body["error"]
        assert hot_error.keys() == error.keys() and hot_error["type"] == error["type"]
        # pydantic words a few messages its own way when it parses the JSON itself ("an object"), and
        # the JSON parsers word their errors differently; type, field and ids must match exactly
        assert {**hot_error, "message": ""} == {**error, "message": ""}
        assert hot_error["message"].split(":")[0] == error["message"].split(":")[0]
        return
    model = next(m for suffix, m in ANSWERS.items() if suffix in path)
    items = hot_body if isinstance(hot_body, list) else [hot_body]
    assert items and all(model.model_validate(item) for item in items)
    assert type(hot_body) is type(body) and len(items) == (len(body) if isinstance(body, list) else 1)
