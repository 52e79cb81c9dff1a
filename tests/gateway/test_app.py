"""The gateway end to end: real openai SDK clients -> Gateway (uvicorn thread) -> OpenAIUpstream, spans in a store."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from agl import semconv as sc
from agl.gateway import Gateway, GatewayConfig, UpstreamConfig
from agl.schemas import LLMCall
from agl.store import InMemoryLightningStore
from tests.support.openai_upstream import OpenAIUpstream, logprob_of, prompt_text, token_ids_of

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "what is two plus two"}]
TOOLS: list[ChatCompletionFunctionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]


async def calls(gw: Gateway, store: InMemoryLightningStore, rollout_id: str) -> list[LLMCall]:
    await gw.flush()
    spans = (await store.query_spans(rollout_id=rollout_id)).items
    assert all(s.name == sc.SPAN_LLM_CALL for s in spans)
    return [c for c in (LLMCall.from_span(s) for s in spans) if c is not None]


def test_sync_sdk_by_url_records_exact_token_ids(
    gateway: Gateway, store: InMemoryLightningStore, upstream: OpenAIUpstream, rollout: tuple[str, str]
) -> None:
    rid, aid = rollout
    client = openai.OpenAI(base_url=gateway.rollout_base_url(rid, aid), api_key="sk-agent", max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=USER, temperature=0.5)
    assert reply.choices[0].message.content == "echo: what is two plus two"
    forwarded = upstream.requests[-1].body
    assert (
        forwarded["return_token_ids"] is True
        and forwarded["logprobs"] is True
        and forwarded["temperature"] == 0.5
    )

    (call,) = asyncio.run(calls(gateway, store, rid))
    assert (call.rollout_id, call.attempt_id, call.api, call.source) == (
        rid,
        aid,
        "chat.completions",
        "gateway",
    )
    assert call.prompt_token_ids == token_ids_of(prompt_text(USER))
    assert call.completion_token_ids == token_ids_of("echo: what is two plus two")
    assert call.logprobs == [logprob_of(i) for i in range(6)]
    assert call.has_token_ids and call.attributes[sc.LLM_HAS_TOKEN_IDS] is True
    assert call.model == "policy" and call.model_version == "weights-v3"
    assert call.request_messages == USER
    assert call.response_message == {
        "role": "assistant",
        "content": "echo: what is two plus two",
        "tool_calls": [],
    }
    assert call.finish_reason == "stop" and call.response_id == reply.id
    assert call.usage["completion_tokens"] == 6
    a = call.attributes
    assert (
        a[sc.LLM_STATUS_CODE] == 200 and a[sc.LLM_BACKEND] == upstream.base_url and a[sc.LLM_STREAM] is False
    )
    assert a[sc.LLM_LATENCY_MS] > 0 and a[sc.LLM_REQUEST]["temperature"] == 0.5
    assert a[sc.RESOURCES_ID] == asyncio.run(store.get_rollout(rid)).resources_id is not None


async def test_async_sdk_by_headers_and_latest_attempt(
    gateway: Gateway, store: InMemoryLightningStore, rollout: tuple[str, str]
) -> None:
    rid, aid = rollout
    by_header = openai.AsyncOpenAI(
        base_url=gateway.base_url,
        api_key="x",
        default_headers={"x-agl-rollout-id": rid, "x-agl-attempt-id": aid},
    )
    latest = openai.AsyncOpenAI(base_url=gateway.rollout_base_url(rid), api_key="x")
    await asyncio.gather(
        by_header.chat.completions.create(model="m", messages=USER),
        latest.chat.completions.create(model="m", messages=USER),
        openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x").chat.completions.create(
            model="m", messages=USER
        ),
    )
    recorded = await calls(gateway, store, rid)
    assert [c.attempt_id for c in recorded] == [aid, aid]  # the unattributed call is not recorded
    assert gateway.stats()["recorded_spans"] == 2


async def test_streaming_passes_chunks_through_and_records_the_whole_call(
    store: InMemoryLightningStore, rollout: tuple[str, str]
) -> None:
    rid, _ = rollout
    with OpenAIUpstream(token_ids=True, chunk_delay_s=0.15) as up, Gateway(store, [up.base_url]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid), api_key="x")
        started = time.monotonic()
        stream = await client.chat.completions.create(model="m", messages=USER, stream=True)
        arrivals, text = [], []
        async for chunk in stream:
            arrivals.append(time.monotonic() - started)
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
        assert "".join(text) == "echo: what is two plus two"
        assert arrivals[1] < arrivals[-1] - 0.5  # chunks arrive while the upstream is still generating
        assert up.requests[-1].body["stream_options"] == {"include_usage": True}
        (call,) = await calls(gw, store, rid)
    assert call.attributes[sc.LLM_STREAM] is True
    assert call.response_message == {
        "role": "assistant",
        "content": "echo: what is two plus two",
        "tool_calls": [],
    }
    assert call.completion_token_ids == token_ids_of("echo: what is two plus two")
    assert call.prompt_token_ids == token_ids_of(prompt_text(USER))
    assert call.logprobs == [logprob_of(i) for i in range(6)]
    assert call.usage["total_tokens"] > 0 and call.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_round_trip(
    gateway: Gateway, store: InMemoryLightningStore, rollout: tuple[str, str], stream: bool
) -> None:
    rid, _ = rollout
    client = openai.AsyncOpenAI(base_url=gateway.rollout_base_url(rid), api_key="x")
    ask: list[ChatCompletionMessageParam] = [{"role": "user", "content": "use the calculator for 2+2"}]
    if stream:
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="m", messages=ask, tools=TOOLS, stream=True
            )
        ]
        deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert deltas[0].function is not None and deltas[0].function.name == "calculator"
        call_id = deltas[0].id
        assert call_id is not None
    else:
        first = await client.chat.completions.create(model="m", messages=ask, tools=TOOLS)
        tool_calls = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and tool_calls
        call_id = tool_calls[0].id
    follow: list[ChatCompletionMessageParam] = [*ask, {"role": "assistant", "tool_calls": [{"id": call_id, "type": "function",
              "function": {"name": "calculator", "arguments": "{}"}}]}, {"role": "tool", "tool_call_id": call_id, "content": "4"}]  # fmt: skip
    second = await client.chat.completions.create(model="m", messages=follow, tools=TOOLS)
    assert second.choices[0].message.content == "tool result: 4"
    first_call, second_call = await calls(gateway, store, rid)
    assert first_call.tool_calls == [{"id": call_id, "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression":"use the calculator for 2+2"}'}}]  # fmt: skip
    assert (
        first_call.finish_reason == "tool_calls"
        and first_call.response_message is not None
        and first_call.response_message["tool_calls"] == first_call.tool_calls
    )
    assert second_call.request_messages == follow and second_call.tool_calls == []


async def test_fails_closed_without_token_ids(
    store: InMemoryLightningStore, rollout: tuple[str, str]
) -> None:
    rid, _ = rollout
    with OpenAIUpstream(token_ids=False) as plain, OpenAIUpstream(token_ids=True) as openai_kind:
        upstreams = [UpstreamConfig(url=plain.base_url, models=["plain"]),
                     UpstreamConfig(url=openai_kind.base_url, kind="openai", models=["hosted"])]  # fmt: skip
        with Gateway(store, upstreams) as gw:
            client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid), api_key="x")
            for model in ("plain", "hosted"):
                for stream in (False, True):
                    r = await client.chat.completions.create(model=model, messages=USER, stream=stream)
                    if stream:
                        _ = [c async for c in r]  # type: ignore[union-attr]
            assert "return_token_ids" not in openai_kind.requests[-1].body  # kind openai asks for nothing
            recorded = await calls(gw, store, rid)
    assert len(recorded) == 4
    for call in recorded:
        assert not call.has_token_ids and call.attributes[sc.LLM_HAS_TOKEN_IDS] is False
        assert call.prompt_token_ids is None and call.completion_token_ids is None and call.logprobs is None
        assert (
            call.response_message is not None
            and call.response_message["content"] == "echo: what is two plus two"
        )


async def test_completions_and_responses(
    gateway: Gateway, store: InMemoryLightningStore, rollout: tuple[str, str]
) -> None:
    rid, _ = rollout
    client = openai.AsyncOpenAI(base_url=gateway.rollout_base_url(rid), api_key="x")
    text = await client.completions.create(model="m", prompt="one two")
    assert text.choices[0].text == "echo: one two"
    resp = await client.responses.create(model="m", input="hello", instructions="be brief")
    assert resp.output_text == "echo: hello"
    completion, response = await calls(gateway, store, rid)
    assert completion.api == "completions" and completion.prompt == "one two"
    assert completion.prompt_token_ids == token_ids_of("one two")
    assert completion.completion_token_ids == token_ids_of("echo: one two")
    assert completion.logprobs == [logprob_of(i) for i in range(3)]
    assert response.api == "responses" and response.response_message is not None
    assert response.response_message["content"] == "echo: hello"
    assert response.request_messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    assert not response.has_token_ids


async def test_unattributed_calls_recorded_when_configured(
    store: InMemoryLightningStore, upstream: OpenAIUpstream
) -> None:
    with Gateway(store, [upstream.base_url], GatewayConfig(record_unattributed=True)) as gw:
        client = openai.AsyncOpenAI(base_url=gw.base_url, api_key="x")
        for _ in range(2):  # one conversation (its OpenAI user), two calls
            await client.chat.completions.create(model="m", messages=USER, user="user-1")
        await gw.flush()
    (rollout,) = (await store.query_rollouts(mode="online")).items
    spans = (await store.query_spans(rollout_id=rollout.rollout_id)).items
    assert len(spans) == 2 and [s.sequence_id for s in spans] == sorted(s.sequence_id or 0 for s in spans)


async def test_models_and_health(gateway: Gateway) -> None:
    models = await openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x").models.list()
    assert [m.id for m in models.data] == ["test-model"]
    async with httpx.AsyncClient() as http:
        health = await http.get(f"{gateway.url}/health")
    assert health.json() == {"status": "ok", "paused": False}


async def test_in_process_asgi_app(
    store: InMemoryLightningStore, upstream: OpenAIUpstream, rollout: tuple[str, str]
) -> None:
    rid, aid = rollout
    gw = Gateway(store, [upstream.base_url])
    transport = httpx.ASGITransport(app=gw.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        r = await http.post(
            f"/rollout/{rid}/attempt/{aid}/v1/chat/completions", json={"model": "m", "messages": USER}
        )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("echo:")
    (call,) = await calls(gw, store, rid)
    assert call.has_token_ids
    await gw.aclose()


async def test_records_into_a_sqlite_store(tmp_path: Path, upstream: OpenAIUpstream) -> None:
    from agl.schemas.rollout import RolloutCreate
    from agl.store import open_store

    store = open_store(f"sqlite:///{tmp_path}/gw.db")
    try:
        started = await store.start_rollout(RolloutCreate(input="q"))
        rid, aid = started.rollout.rollout_id, started.attempt.attempt_id
        with Gateway(store, [upstream.base_url]) as gw:
            client = openai.AsyncOpenAI(base_url=gw.rollout_base_url(rid, aid), api_key="x")
            await asyncio.gather(
                *(client.chat.completions.create(model="m", messages=USER) for _ in range(5))
            )
        spans = (await store.query_spans(rollout_id=rid)).items  # stop() flushed the recorder
        seqs = sorted(s.sequence_id or 0 for s in spans)
        assert seqs == list(range(seqs[0], seqs[0] + 5))  # all five stored and numbered
        recorded = [LLMCall.from_span(s) for s in spans]
        assert all(
            c is not None and c.completion_token_ids == token_ids_of("echo: what is two plus two")
            for c in recorded
        )
    finally:
        await store.aclose()


async def test_an_agents_calls_to_the_policy_go_to_its_own_model(
    store: InMemoryLightningStore, upstream: OpenAIUpstream, rollout: tuple[str, str]
) -> None:
    """``agent_models``: an agent endpoint (or ``x-agl-agent``) sends the policy's calls to the agent's
    adapter; other agents, and calls naming another model, go where they say."""
    with Gateway(store, [upstream.base_url], agent_models={"solver": "solver-lora"}) as gw:
        base = gw.rollout_base_url(rollout[0])
        sent = [
            (f"{base.removesuffix('/v1')}/agent/solver/v1", "policy", {}),
            (f"{base.removesuffix('/v1')}/agent/solver/v1", "teacher", {}),
            (f"{base.removesuffix('/v1')}/agent/checker/v1", "policy", {}),
            (base, "policy", {"x-agl-agent": "solver"}),
            (base, "policy", {}),
        ]
        for url, model, headers in sent:
            client = openai.AsyncOpenAI(base_url=url, api_key="k", max_retries=0, default_headers=headers)
            await client.chat.completions.create(model=model, messages=USER)
            await client.close()
        recorded = await calls(gw, store, rollout[0])
    assert [r.body["model"] for r in upstream.requests] == [
        "solver-lora",
        "teacher",
        "policy",
        "solver-lora",
        "policy",
    ]
    in_order = sorted((c.sequence_id, c.agent_name) for c in recorded)
    assert [name for _, name in in_order] == ["solver", "solver", "checker", "solver", None]
