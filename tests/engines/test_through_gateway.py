"""The built-in engine behind the real gateway, recording into a SQLite store, driven by the openai SDK.

Every model call an agent makes this way (chat, streamed chat with tools, Responses with and without
streaming) must leave a span with the engine's exact token ids, so the adapter can train on it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from openai.types.responses import FunctionToolParam, ResponseInputParam

from agl import semconv as sc
from agl.adapter import llm_calls, to_samples
from agl.engines.builtin.server import EngineServer
from agl.gateway import Gateway, UpstreamConfig
from agl.schemas import LLMCall
from agl.schemas.rollout import RolloutCreate
from agl.store import open_store
from agl.store.base import LightningStore

from .conftest import TOOL_MESSAGES, TOOLS

# the conftest tool in the Responses shape (no "strict": the engine does not need it)
RESPONSES_TOOLS = cast("list[FunctionToolParam]", [{"type": "function", **TOOLS[0]["function"]}])
SDK_TOOL_MESSAGES = cast("list[ChatCompletionMessageParam]", TOOL_MESSAGES)


ENGINE_TOKEN = "engine-token-0123456789"
AUTH = {"authorization": f"Bearer {ENGINE_TOKEN}"}


@pytest.fixture(scope="module")
def engine(tool_model_path: Path) -> Iterator[EngineServer]:
    """The engine behind a bearer token: the gateway reaches it with the token as its upstream key."""
    with EngineServer(tool_model_path, max_batch_size=4, token=ENGINE_TOKEN) as srv:
        yield srv


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[LightningStore]:
    s = open_store(f"sqlite:///{tmp_path}/gw.db")
    yield s
    await s.aclose()


@pytest.fixture
def gateway(store: LightningStore, engine: EngineServer) -> Iterator[Gateway]:
    with Gateway(store, [UpstreamConfig(url=engine.base_url, kind="agl", api_key=engine.token)]) as gw:
        yield gw


async def rollout_client(gw: Gateway, store: LightningStore) -> tuple[str, openai.AsyncOpenAI]:
    started = await store.start_rollout(RolloutCreate(input="task"))
    rid = started.rollout.rollout_id
    url = gw.rollout_base_url(rid, started.attempt.attempt_id)
    return rid, openai.AsyncOpenAI(base_url=url, api_key="sk-agent", max_retries=0)


async def recorded(gw: Gateway, store: LightningStore, rid: str) -> list[LLMCall]:
    await gw.flush()
    return llm_calls((await store.query_spans(rollout_id=rid)).items)


async def test_streamed_tool_call_records_the_same_ids_as_non_streamed(
    gateway: Gateway, store: LightningStore
) -> None:
    rid, client = await rollout_client(gateway, store)
    kwargs: dict[str, Any] = {
        "model": "policy",
        "messages": TOOL_MESSAGES,
        "tools": TOOLS,
        "seed": 7,
        "temperature": 0.8,
    }
    plain = await client.chat.completions.create(**kwargs)
    stream = await client.chat.completions.create(**kwargs, stream=True)
    deltas = [choice.delta async for chunk in stream for choice in chunk.choices]
    names = [call.function.name for d in deltas for call in d.tool_calls or [] if call.function]
    assert names == ["get_weather"] and plain.choices[0].message.tool_calls is not None

    first, second = await recorded(gateway, store, rid)
    assert first.attributes[sc.LLM_STREAM] is False and second.attributes[sc.LLM_STREAM] is True
    assert second.has_token_ids and second.attributes[sc.LLM_HAS_TOKEN_IDS] is True
    assert second.prompt_token_ids == first.prompt_token_ids
    assert second.completion_token_ids == first.completion_token_ids
    assert second.logprobs == pytest.approx(first.logprobs)
    assert second.tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(second.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert second.finish_reason == "tool_calls"

    samples, report = to_samples([second], reward=1.0, level="transition")
    assert report.skipped_no_token_ids == 0 and len(samples) == 1
    expected = [*first.prompt_token_ids, *first.completion_token_ids]  # type: ignore[misc]
    assert list(samples[0].input_ids) == expected
    assert sum(samples[0].loss_mask) == len(first.completion_token_ids or [])


async def test_responses_tool_call_and_follow_up_are_trainable(
    gateway: Gateway, store: LightningStore
) -> None:
    rid, client = await rollout_client(gateway, store)
    first = await client.responses.create(
        model="policy",
        input=TOOL_MESSAGES[0]["content"],
        tools=RESPONSES_TOOLS,
        temperature=0.0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert first.usage is not None and first.usage.output_tokens > 0

    # the OpenAI Agents SDK's next turn: the whole history, the call, and the tool's output
    history: ResponseInputParam = [
        {"role": "user", "content": TOOL_MESSAGES[0]["content"]},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"},
    ]
    second = await client.responses.create(
        model="policy",
        input=history,
        tools=RESPONSES_TOOLS,
        max_output_tokens=5,
        temperature=0.0,
    )
    assert second.status in ("completed", "incomplete") and second.output

    with pytest.raises(
        openai.BadRequestError
    ) as bad:  # the engine's 400 reaches the agent through the gateway
        await client.responses.create(
            model="policy",
            input=[{"type": "computer_call_output", "call_id": "c"}],  # type: ignore[list-item]  # deliberately bad
        )
    assert bad.value.body["param"] == "input[0].type"  # type: ignore[index]

    a, b, failed = await recorded(gateway, store, rid)
    assert failed.error is not None and not failed.has_token_ids
    assert (a.api, b.api) == ("responses", "responses")
    assert a.has_token_ids and b.has_token_ids and a.response_id == first.id
    assert a.tool_calls[0]["function"]["name"] == "get_weather"
    assert len(a.logprobs or []) == len(a.completion_token_ids or []) > 0
    # the second prompt starts with the first prompt and the model's own reply: one trajectory sample
    samples, report = to_samples([a, b], reward=0.5)
    assert report.skipped_no_token_ids == 0 and report.samples == 1
    assert list(samples[0].input_ids[: len(a.prompt_token_ids or [])]) == a.prompt_token_ids


async def test_responses_stream_records_ids_equal_to_non_streamed(
    gateway: Gateway, store: LightningStore, engine: EngineServer
) -> None:
    rid, client = await rollout_client(gateway, store)
    kwargs: dict[str, Any] = {
        "model": "policy",
        "input": "Hello there",
        "max_output_tokens": 6,
        "temperature": 0.9,
    }
    kwargs["extra_body"] = {"seed": 3}
    plain = await client.responses.create(**kwargs)
    deltas, completed = [], None
    async for event in await client.responses.create(**kwargs, stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type == "response.completed":
            completed = event.response
    assert completed is not None and "".join(deltas) == completed.output_text == plain.output_text

    async with client.responses.stream(  # greedy: a sampled reply is not always the tool call
        model="policy", input=TOOL_MESSAGES[0]["content"], tools=RESPONSES_TOOLS, temperature=0.0
    ) as s:
        final = await s.get_final_response()
    assert [item.type for item in final.output] == ["function_call"]

    a, b, c = await recorded(gateway, store, rid)
    assert b.attributes[sc.LLM_STREAM] is True and b.has_token_ids
    assert (b.prompt_token_ids, b.completion_token_ids) == (a.prompt_token_ids, a.completion_token_ids)
    assert c.has_token_ids and c.tool_calls[0]["function"]["name"] == "get_weather"
    assert a.prompt_token_ids == engine.engine.encode_chat([{"role": "user", "content": "Hello there"}])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": 5}, "input"),
    ],
)
def test_bad_responses_input_gets_400_naming_the_field(engine: EngineServer, body: dict, param: str) -> None:
    r = httpx.post(f"{engine.base_url}/responses", json={"model": "m", **body}, headers=AUTH)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_responses_through_the_sdk_directly(engine: EngineServer) -> None:
    client = openai.OpenAI(base_url=engine.base_url, api_key=ENGINE_TOKEN, max_retries=0)
    reply = client.responses.create(
        model="m", instructions="Be brief.", input=[{"role": "user", "content": "Hi"}], max_output_tokens=4
    )
    assert reply.status == "incomplete" and reply.incomplete_details is not None
    assert reply.usage is not None and reply.usage.output_tokens == 4
    raw = httpx.post(
        f"{engine.base_url}/responses",
        json={"model": "m", "input": "Hi", "max_output_tokens": 3},
        headers=AUTH,
    ).json()
    assert len(raw["token_ids"]) == 3 == len(raw["logprobs"]["content"]) and raw["prompt_token_ids"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input=[])


def test_engine_token_guards_every_route_but_health(engine: EngineServer, tmp_path: Path) -> None:
    assert httpx.get(f"{engine.url}/health").status_code == 200
    for headers in ({}, {"authorization": "Bearer wrong"}):
        for method, path, body in [
            ("POST", "/v1/weights", {"path": str(tmp_path)}),
            ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("POST", "/v1/responses", {"input": "hi"}),
            ("GET", "/v1/models", None),
        ]:
            r = httpx.request(method, engine.url + path, json=body, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
    assert engine.engine.model_version == "v0"  # the refused weight load changed nothing
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=engine.base_url, api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=engine.base_url, api_key=ENGINE_TOKEN, max_retries=0).models.list()
    assert [m.id for m in models.data] == [engine.engine.model_name]


async def test_trainer_engines_hand_their_token_to_the_gateway(
    tiny_path: Path, tmp_path: Path, store: LightningStore
) -> None:
    from agl.engines.launch import BuiltinEngine, start_engines

    engines = await start_engines(BuiltinEngine({"token": ENGINE_TOKEN}), str(tiny_path), work_dir=tmp_path)
    try:
        (upstream,) = engines.upstreams
        assert upstream.api_key == ENGINE_TOKEN
        assert httpx.get(f"{upstream.url}/models").status_code == 401
        with Gateway(store, engines.upstreams) as gw:
            rid, client = await rollout_client(gw, store)
            reply = await client.chat.completions.create(
                model="policy", messages=SDK_TOOL_MESSAGES, max_tokens=3
            )
            assert reply.usage is not None and reply.usage.completion_tokens == 3
            (call,) = await recorded(gw, store, rid)
            assert call.has_token_ids and ENGINE_TOKEN not in str(call.attributes)
    finally:
        engines.stop()
