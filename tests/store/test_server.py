"""The store server's edges: auth on every route, bad input always 4xx, body limits, idempotent retries, long-polling."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from agl.asgi_server import BackgroundServer
from agl.errors import NotFoundError, UnauthorizedError
from agl.schemas import AttemptStatus, RolloutCreate
from agl.store import InMemoryLightningStore, open_store
from agl.store.client import LightningStoreClient
from agl.store.server import create_app
from tests.store.remote_backends import serve
from tests.support.waiting import until

TOKEN = "s3cret-token"


@pytest.fixture
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(create_app(InMemoryLightningStore(), token=TOKEN, max_body_bytes=200_000)) as s:
        yield s


def test_every_route_needs_the_token(server: BackgroundServer) -> None:
    spec = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert len(spec["paths"]) >= 20
    checked = 0
    with httpx.Client(base_url=server.url) as client:
        for path, methods in spec["paths"].items():
            concrete = path.replace("{rollout_id}", "ro-x").replace("{attempt_id}", "at-x")
            concrete = concrete.replace("{resources_id}", "rs-x").replace("{worker_id}", "w-x")
            for method in methods:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                    response = client.request(method.upper(), concrete, headers=headers, json={})
                    expected = 200 if path == "/health" else 401
                    assert response.status_code == expected, (method, path, headers, response.text)
                    if expected == 401:
                        assert response.json()["error"]["type"] == "UnauthorizedError"
                    checked += 1
    assert checked >= 60
    assert httpx.get(f"{server.url}/openapi.json").status_code == 401


def test_bad_input_gets_4xx_naming_the_field(server: BackgroundServer) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url + "/v1/agl", headers=auth) as c:
        cases = [
            ("POST", "/rollouts", b"{not json", 400, None),
            ("POST", "/rollouts", json.dumps({"rollouts": "x"}).encode(), 422, "rollouts"),
            (
                "POST",
                "/rollouts",
                json.dumps({"rollouts": [{"retry": {"max_attempts": -1}}]}).encode(),
                422,
                "max_attempts",
            ),
            ("POST", "/rollouts/dequeue", json.dumps({}).encode(), 422, "worker_id"),
            ("POST", "/spans", json.dumps({"spans": [{"rollout_id": 1}]}).encode(), 422, "spans"),
            ("POST", "/rollouts/query", json.dumps({"limit": 0}).encode(), 422, "limit"),
            ("POST", "/rollouts/query", json.dumps({"cursor": "garbage"}).encode(), 400, None),
            ("POST", "/rollouts/query", json.dumps({"unknown": 1}).encode(), 422, "unknown"),
            ("GET", "/rollouts/ro-missing", b"", 404, None),
            ("PATCH", "/rollouts/ro-missing", json.dumps({"status": "cancelled"}).encode(), 404, None),
            ("PATCH", "/rollouts/ro-missing", json.dumps({"status": "exploded"}).encode(), 422, "status"),
            ("POST", "/rollouts/ro-missing/attempts/at-x/heartbeat", b"", 404, None),
            ("GET", "/resources/rs-missing", b"", 404, None),
            (
                "POST",
                "/resources",
                json.dumps({"resources": {"p": {"resource_type": "?"}}}).encode(),
                422,
                "resources",
            ),
            (
                "POST",
                "/rollouts/wait",
                json.dumps({"rollout_ids": ["ro-none"], "timeout_s": 0}).encode(),
                404,
                None,
            ),
        ]
        for method, path, body, status, field in cases:
            response = c.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert response.status_code == status, (method, path, body, response.text)
            error = response.json()["error"]
            assert error["message"]
            if field is not None:
                assert field in json.dumps(error), (path, error)


def test_body_size_limit_is_413(server: BackgroundServer) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    big = json.dumps({"rollouts": [{"input": "x" * 300_000}]})
    response = httpx.post(f"{server.url}/v1/agl/rollouts", content=big, headers=auth)
    assert response.status_code == 413 and "exceeds" in response.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit still holds while streaming
        for _ in range(30):
            yield b" " * 10_000

    response = httpx.post(f"{server.url}/v1/agl/rollouts", content=chunks(), headers=auth)
    assert response.status_code == 413


async def test_client_raises_what_a_local_store_raises(server: BackgroundServer) -> None:
    client = LightningStoreClient(server.url, token=TOKEN)
    with pytest.raises(NotFoundError, match="ro-missing"):
        await client.get_rollout("ro-missing")
    await client.aclose()
    anonymous = LightningStoreClient(server.url, token="wrong", retries=0)
    with pytest.raises(UnauthorizedError):
        await anonymous.statistics()
    await anonymous.aclose()


async def test_retried_dequeue_with_the_same_key_returns_the_same_claim() -> None:
    async with serve(InMemoryLightningStore()) as client:
        await client.enqueue_rollouts([RolloutCreate(input=i) for i in range(2)])
        raw = httpx.AsyncClient(base_url=client.url + "/v1/agl")
        first = await raw.post(
            "/rollouts/dequeue", json={"worker_id": "w"}, headers={"Idempotency-Key": "k1"}
        )
        again = await raw.post(
            "/rollouts/dequeue", json={"worker_id": "w"}, headers={"Idempotency-Key": "k1"}
        )
        other = await raw.post(
            "/rollouts/dequeue", json={"worker_id": "w"}, headers={"Idempotency-Key": "k2"}
        )
        await raw.aclose()
        assert first.json() == again.json()
        assert other.json()["rollout"]["rollout_id"] != first.json()["rollout"]["rollout_id"]


async def test_enqueue_retries_never_duplicate() -> None:
    async with serve(InMemoryLightningStore()) as client:
        request = RolloutCreate(input=1, rollout_id="ro-once")
        await client.enqueue_rollouts([request])
        await client.enqueue_rollouts([request])  # what a retry after a lost response sends
        assert len((await client.query_rollouts()).items) == 1


async def test_waiting_long_polls_instead_of_polling() -> None:
    inner = InMemoryLightningStore()
    requests: list[str] = []
    async with serve(inner) as client:
        original = client._request

        async def counting(method: str, path: str, *args: object, **kwargs: object) -> object:
            requests.append(path)
            return await original(method, path, *args, **kwargs)  # type: ignore[arg-type]

        client._request = counting  # type: ignore[method-assign]
        rollouts = await inner.enqueue_rollouts([RolloutCreate(input=i) for i in range(200)])
        waiter = asyncio.create_task(client.wait_for_rollouts([r.rollout_id for r in rollouts], timeout_s=30))
        # the long poll has reached the store: every completion below happens while it waits
        await until(lambda: bool(inner._waiters._waiters), "the long poll to reach the store")
        while (claimed := await inner.dequeue("w")) is not None:
            await inner.update_attempt(
                claimed.rollout.rollout_id, claimed.attempt.attempt_id, status=AttemptStatus.SUCCEEDED
            )
        done = await waiter
    assert len(done) == 200
    assert requests.count("/rollouts/wait") <= 5


async def test_open_store_http_url() -> None:
    async with serve(InMemoryLightningStore()) as client:
        remote = open_store(client.url)
        assert isinstance(remote, LightningStoreClient)
        await remote.enqueue_rollout("via-url")
        assert (await client.statistics()).rollouts_by_status == {"queuing": 1}
        await remote.aclose()


async def test_idempotency_cache_keeps_only_what_replays_an_answer_and_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agl.store import server as server_module

    now = [1000.0]
    monkeypatch.setattr("agl.store.server.time.monotonic", lambda: now[0])
    cache = server_module._IdempotencyCache(ttl_s=60, max_entries=100)
    calls = 0

    async def call() -> dict[str, object]:
        nonlocal calls
        calls += 1
        return {"id": calls, "payload": "x" * 10_000}

    async def replay(kept: int) -> dict[str, object]:
        return {"id": kept, "replayed": True}

    def keep(answer: dict[str, object]) -> object:
        return answer["id"]

    for i in range(250):
        assert (await cache.run(f"k{i}", call, keep, replay))["id"] == i + 1
    assert len(cache) == 100  # the oldest keys went first
    assert await cache.run("k249", call, keep, replay) == {"id": 250, "replayed": True}
    assert calls == 250
    assert (await cache.run("k0", call, keep, replay))["id"] == 251  # evicted: runs again
    now[0] += 61
    assert (await cache.run("k249", call, keep, replay))["id"] == 252  # expired: runs again
    assert len(cache) == 1
