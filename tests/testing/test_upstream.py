"""``agl.testing.InMemoryUpstream`` as the gateway's transport: the real gateway and openai SDK, no model server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from agl import semconv as sc
from agl.gateway import Gateway, GatewayConfig
from agl.schemas import LLMCall
from agl.schemas.rollout import RolloutCreate
from agl.store import InMemoryLightningStore
from agl.testing import InMemoryUpstream, token_ids

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "what is two plus two"}]
PROMPT = "<user> what is two plus two"


@pytest.fixture
async def store() -> AsyncIterator[InMemoryLightningStore]:
    s = InMemoryLightningStore(watchdog_interval_s=0)
    yield s
    await s.aclose()


async def _rollout(store: InMemoryLightningStore) -> tuple[str, str]:
    started = await store.start_rollout(RolloutCreate(input="task"))
    return started.rollout.rollout_id, started.attempt.attempt_id


async def _calls(gw: Gateway, store: InMemoryLightningStore, rollout_id: str) -> list[LLMCall]:
    await gw.flush()
    spans = (await store.query_spans(rollout_id=rollout_id)).items
    return [c for c in (LLMCall.from_span(s) for s in spans) if c is not None]


async def test_chat_calls_are_answered_and_recorded_with_token_ids(store: InMemoryLightningStore) -> None:
    up = InMemoryUpstream(model="policy")
    rid, aid = await _rollout(store)
    with Gateway(store, ["http://model.invalid/v1"], transport=up.transport) as gw:
        client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid, aid), api_key="sk", max_retries=0)
        reply = await client.chat.completions.create(model="policy", messages=USER)
        assert reply.choices[0].message.content == "echo: what is two plus two"
        assert up.requests[-1]["return_token_ids"] is True  # the gateway asked for what training reads
        up.script("the answer is 4")
        stream = await client.chat.completions.create(model="policy", messages=USER, stream=True)
        assert (
            "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            == "the answer is 4"
        )
        assert [m.id async for m in client.models.list()] == ["policy"]
        plain, streamed = await _calls(gw, store, rid)
        await client.close()
    assert plain.prompt_token_ids == streamed.prompt_token_ids == token_ids(PROMPT)
    assert plain.completion_token_ids == token_ids("echo: what is two plus two")
    assert streamed.completion_token_ids == token_ids("the answer is 4")
    assert plain.logprobs == [-0.1] * 6 and streamed.attributes[sc.LLM_STREAM] is True
    assert streamed.usage == {"prompt_tokens": 6, "completion_tokens": 4, "total_tokens": 10}


async def test_unserved_apis_fail_and_a_broken_transport_fails_over(store: InMemoryLightningStore) -> None:
    up = InMemoryUpstream()

    def route(request: httpx.Request) -> httpx.Response:
        if request.url.host == "down.invalid":
            raise httpx.ConnectError("no route to the model", request=request)
        return up.transport.handle_request(request)

    upstreams = ["http://down.invalid/v1", "http://up.invalid/v1"]
    config = GatewayConfig(backoff_s=0.01, health_interval_s=60)
    with Gateway(store, upstreams, config, transport=httpx.MockTransport(route)) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="sk", max_retries=0)
        for _ in range(2):  # whichever replica a call tries first, it is answered
            reply = await client.chat.completions.create(model="m", messages=USER)
            assert reply.choices[0].message.content == "echo: what is two plus two"
        with pytest.raises(openai.NotFoundError):
            await client.embeddings.create(model="m", input="x")
        await client.close()
        down, alive = gw.stats()["upstreams"]
    assert (down["healthy"], down["failures"], alive["healthy"]) == (False, 1, True)
    assert len(up.requests) == 2


def test_scripted_replies_come_in_order_then_echo_for_a_plain_client() -> None:
    up = InMemoryUpstream()
    up.script("first", "second")
    with httpx.Client(transport=up.transport) as http:
        # the SDK takes an httpx client at run time; its annotation names only its own httpx2 fork
        client = openai.OpenAI(base_url="http://model.invalid/v1", api_key="sk", http_client=http)  # type: ignore[arg-type]
        replies = [client.chat.completions.create(model="m", messages=USER) for _ in range(3)]
    assert [r.choices[0].message.content for r in replies] == [
        "first",
        "second",
        "echo: what is two plus two",
    ]
    assert [r.usage.completion_tokens if r.usage else None for r in replies] == [1, 1, 6]
    assert "return_token_ids" not in replies[0].model_dump() and len(up.requests) == 3
