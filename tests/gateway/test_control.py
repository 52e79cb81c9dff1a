"""Gateway errors, pause/resume, retries, failover, sticky routing, health and secret handling."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from agl import semconv as sc
from agl.gateway import Gateway, GatewayConfig, UpstreamConfig
from agl.schemas import LLMCall
from agl.schemas.rollout import RolloutCreate
from agl.store import InMemoryLightningStore
from tests.support.openai_upstream import OpenAIUpstream

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
FAST = GatewayConfig(backoff_s=0.01, health_interval_s=0.1, read_timeout_s=1.0)


async def spans_of(gw: Gateway, store: InMemoryLightningStore, rid: str) -> list[LLMCall]:
    await gw.flush()
    return [c for c in (LLMCall.from_span(s) for s in (await store.query_spans(rollout_id=rid)).items) if c]


@pytest.fixture
def replicas() -> Iterator[list[OpenAIUpstream]]:
    ups = [OpenAIUpstream(token_ids=True).start() for _ in range(3)]
    yield ups
    for up in ups:
        up.stop()


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (orjson.dumps({"messages": USER}), 400, "model"),
        (orjson.dumps({"model": "m", "messages": "hi"}), 400, "messages"),
        (orjson.dumps({"model": "m", "messages": [{"content": "x"}]}), 400, "messages[0].role"),
        (orjson.dumps({"model": "m", "messages": USER, "stream": "yes"}), 400, "stream"),
        (orjson.dumps({"model": "m", "messages": USER, "n": 0}), 400, "n"),
    ],
)
async def test_bad_requests_get_openai_error_bodies_and_are_recorded(
    gateway: Gateway, store: InMemoryLightningStore, upstream: OpenAIUpstream, rollout: tuple[str, str],
    body: bytes, status: int, param: str | None,
) -> None:  # fmt: skip
    rid, aid = rollout
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{gateway.rollout_base_url(rid, aid)}/chat/completions", content=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]
    assert upstream.requests == []  # never forwarded
    (call,) = await spans_of(gateway, store, rid)
    assert call.attributes[sc.LLM_STATUS_CODE] == status and call.error == error["message"]


async def test_routing_errors(gateway: Gateway, rollout: tuple[str, str]) -> None:
    rid, _ = rollout
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        unknown = await http.post(
            "/rollout/nope/attempt/latest/v1/chat/completions", json={"model": "m", "messages": USER}
        )
        wrong_attempt = await http.post(
            f"/rollout/{rid}/attempt/nope/v1/chat/completions", json={"model": "m", "messages": USER}
        )
        bad_header = await http.post("/v1/chat/completions", json={"model": "m", "messages": USER},
                                     headers={"x-agl-rollout-id": "missing"})  # fmt: skip
        method = await http.get("/v1/chat/completions")
        path = await http.post("/v1/audio/speech", json={})
        malformed = await http.post("/rollout/x/v1/chat/completions", json={})
    assert (unknown.status_code, unknown.json()["error"]["code"]) == (404, "rollout_not_found")
    assert (wrong_attempt.status_code, wrong_attempt.json()["error"]["param"]) == (404, "attempt_id")
    assert bad_header.status_code == 404 and "missing" in bad_header.json()["error"]["message"]
    assert method.status_code == 405 and path.status_code == 404 and malformed.status_code == 404
    for r in (unknown, wrong_attempt, method, path, malformed):
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


async def test_pause_drains_in_flight_calls_and_refuses_new_ones(
    store: InMemoryLightningStore, rollout: tuple[str, str]
) -> None:
    rid, _ = rollout
    with (
        OpenAIUpstream(delay_s=0.5) as up,
        Gateway(store, [up.base_url], GatewayConfig(retry_after_s=2)) as gw,
    ):
        client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid), api_key="x", max_retries=0)
        in_flight = asyncio.create_task(client.chat.completions.create(model="m", messages=USER))
        while gw.inflight == 0:
            await asyncio.sleep(0.01)
        started = time.monotonic()
        drained = await gw.pause()
        assert time.monotonic() - started > 0.3 and gw.inflight == 0  # pause returned only after the drain
        assert drained["inflight_at_pause"] == 1.0
        reply = await asyncio.wait_for(in_flight, 1.0)  # its response was already sent
        assert reply.choices[0].message.content == "echo: hello"
        with pytest.raises(openai.RateLimitError) as refused:
            await client.chat.completions.create(model="m", messages=USER)
        assert refused.value.response.headers["retry-after"] == "2"
        assert refused.value.body["code"] == "gateway_paused"  # type: ignore[index]
        async with httpx.AsyncClient(base_url=gw.url) as http:
            assert (await http.get("/health")).json()["paused"] is True
            assert (await http.post("/admin/resume")).json() == {"paused": False}
            ok = await client.chat.completions.create(model="m", messages=USER)
            assert ok.choices[0].message.content == "echo: hello"
            assert (await http.post("/admin/pause")).json()["paused"] is True
            assert (
                await http.post("/v1/chat/completions", json={"model": "m", "messages": USER})
            ).status_code == 429
            await gw.resume()
        assert len(up.requests) == 2  # refused calls never reached the upstream


@pytest.mark.parametrize("mode", ["500", "close", "hang"])
async def test_failover_to_another_replica(
    store: InMemoryLightningStore, rollout: tuple[str, str], replicas: list[OpenAIUpstream], mode: str
) -> None:
    rid, _ = rollout
    with Gateway(store, [u.base_url for u in replicas], FAST) as gw:
        client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid), api_key="x", max_retries=0)
        await client.chat.completions.create(model="m", messages=USER)
        (sticky,) = [u for u in replicas if u.requests]
        sticky.fail(mode, times=None)  # type: ignore[arg-type]
        reply = await client.chat.completions.create(model="m", messages=USER)
        assert reply.choices[0].message.content == "echo: hello"
        served = [u for u in replicas if u is not sticky and u.requests]
        assert len(served) == 1 and len(sticky.requests) == 2
        healthy = {u["backend"]: u["healthy"] for u in gw.stats()["upstreams"]}
        assert healthy[sticky.base_url] is False
        sticky.recover()
        for _ in range(100):  # the health loop brings it back; the rollout returns to its replica
            if all(u["healthy"] for u in gw.stats()["upstreams"]):
                break
            await asyncio.sleep(0.05)
        await client.chat.completions.create(model="m", messages=USER)
        assert len(sticky.requests) == 3
        first, second, third = await spans_of(gw, store, rid)
    assert first.attributes[sc.LLM_BACKEND] == third.attributes[sc.LLM_BACKEND] == sticky.base_url
    assert second.attributes[sc.LLM_BACKEND] == served[0].base_url and second.error is None


async def test_retries_same_replica_then_502(store: InMemoryLightningStore, rollout: tuple[str, str]) -> None:
    rid, _ = rollout
    with OpenAIUpstream() as up, Gateway(store, [up.base_url], FAST) as gw:
        client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid), api_key="x", max_retries=0)
        up.fail("503", times=2)
        assert (await client.chat.completions.create(model="m", messages=USER)).choices[0].message.content
        assert len(up.requests) == 3
        up.fail("500", times=None)
        with pytest.raises(openai.APIStatusError) as failed:
            await client.chat.completions.create(model="m", messages=USER)
        assert failed.value.status_code == 502 and "after 3 attempts" in failed.value.message
        up.recover()
        up.fail("429")  # client-side statuses pass through, unretried
        with pytest.raises(openai.RateLimitError):
            await client.chat.completions.create(model="m", messages=USER)
        ok, bad, limited = await spans_of(gw, store, rid)
    assert ok.error is None and ok.attributes[sc.LLM_STATUS_CODE] == 200
    assert bad.attributes[sc.LLM_STATUS_CODE] == 502 and "500" in (bad.error or "")
    assert limited.attributes[sc.LLM_STATUS_CODE] == 429 and limited.error == "scripted failure 429"


async def test_sticky_routing_per_rollout(
    store: InMemoryLightningStore, replicas: list[OpenAIUpstream]
) -> None:
    with Gateway(store, [u.base_url for u in replicas]) as gw:
        rollouts = [(await store.start_rollout(RolloutCreate(input=i))).rollout.rollout_id for i in range(12)]
        for _ in range(3):
            await asyncio.gather(*(
                openai.AsyncOpenAI(base_url=gw.rollout_base_url(r), api_key="x").chat.completions.create(model="m", messages=USER)
                for r in rollouts
            ))  # fmt: skip
        used = set()
        for rid in rollouts:
            backends = {c.attributes[sc.LLM_BACKEND] for c in await spans_of(gw, store, rid)}
            assert len(backends) == 1, backends
            used |= backends
    assert len(used) > 1  # rollouts spread over replicas


async def test_secrets_are_injected_upstream_and_never_recorded(
    store: InMemoryLightningStore, rollout: tuple[str, str]
) -> None:
    rid, _ = rollout
    secret, agent_key = "sk-upstream-0123456789", "sk-agent-abcdefghij"
    with OpenAIUpstream(api_key=secret) as up:
        with Gateway(store, [UpstreamConfig(url=up.base_url, api_key=secret)]) as gw:
            client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid), api_key=agent_key)
            await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": f"my key is {agent_key}"}],
                extra_body={"api_key": agent_key},
            )
            assert repr(gw.upstreams[0]).count(secret) == 0
            await gw.flush()
            (span,) = (await store.query_spans(rollout_id=rid)).items
        assert up.requests[0].headers["authorization"] == f"Bearer {secret}"
    dumped = span.model_dump_json()
    assert secret not in dumped and agent_key not in dumped and "[redacted]" in dumped


async def test_upstream_key_failure_is_reported_without_the_key(
    store: InMemoryLightningStore, rollout: tuple[str, str]
) -> None:
    rid, _ = rollout
    with OpenAIUpstream(api_key="the-right-key-123") as up, Gateway(store, [up.base_url]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid), api_key="wrong-key-456789")
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="m", messages=USER)
        (call,) = await spans_of(gw, store, rid)
    assert call.attributes[sc.LLM_STATUS_CODE] == 401 and "wrong-key-456789" not in str(call.attributes)
