"""Anthropic Messages through the gateway: the translation alone, then the real ``anthropic`` SDK through the
real gateway to the built-in engine, where a Messages agent must leave the same training samples as a chat one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import anthropic
import openai
import orjson
import pytest
from anthropic.types import ImageBlockParam, MessageParam, ToolParam
from openai.types.chat import ChatCompletionMessageParam

from agl import semconv as sc
from agl.adapter import llm_calls, to_samples
from agl.engines.builtin.server import EngineServer
from agl.gateway import Gateway, UpstreamConfig
from agl.gateway.anthropic import StreamTranslator, from_chat, message_events, to_chat
from agl.gateway.validation import HTTPError
from agl.schemas import LLMCall
from agl.schemas.rollout import RolloutCreate
from agl.store import open_store
from agl.store.base import LightningStore

from ..engines.conftest import TOOL_MESSAGES, TOOLS, tiny_path, tool_model_path  # noqa: F401 (fixtures)

WEATHER = TOOLS[0]["function"]
ANTHROPIC_TOOLS: list[ToolParam] = [
    {"name": WEATHER["name"], "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
]
QUESTION = TOOL_MESSAGES[0]["content"]
GREEDY = {
    "temperature": 0
}  # the anthropic SDK 2.x has no temperature argument; the Messages API still takes it


# ----- the translation alone -----------------------------------------------------------------------
def test_to_chat_maps_system_tools_tool_turns_and_sampling() -> None:
    body = {
        "model": "m",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "x"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "18 C"}],
                    },
                    {"type": "text", "text": "And Rome?"},
                ],
            },
        ],
        "stop_sequences": ["END"],
        "temperature": 0.5,
        "top_k": 5,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        "stream": True,
    }
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And Rome?"},
    ]
    assert chat["tools"] == TOOLS  # the same chat tools, key order included (templates render them as JSON)
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert (chat["max_tokens"], chat["stop"], chat["temperature"], chat["top_k"]) == (64, ["END"], 0.5, 5)
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}
    assert to_chat({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                    "tool_choice": {"type": "any"}})["tool_choice"] == "required"  # fmt: skip


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"max_tokens": None}, "max_tokens: field required"),
        ({"max_tokens": 0}, "max_tokens: must be an integer >= 1"),
        ({"model": ""}, "model:"),
        ({"messages": []}, "messages: must be a non-empty list"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "video"}]}]}, "messages.0.content.0.type"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            "messages.0.content.0.tool_use_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": [{"type": "tool_use", "id": "t", "name": "f", "input": 1}],
                    }
                ]
            },
            "messages.0.content.0.input",
        ),
        ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"temperature": 3}, "temperature"),
        ({"system": [{"type": "image"}]}, "system.0"),
    ],
)
def test_to_chat_names_the_bad_field(change: dict[str, Any], field: str) -> None:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body.update(change)
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(HTTPError) as info:
        to_chat(body)
    assert info.value.status == 400 and info.value.message.startswith(field), info.value.message


def test_from_chat_maps_content_tool_calls_stop_reasons_and_usage() -> None:
    chat = {
        "id": "chatcmpl-1",
        "choices": [
            {
                "message": {
                    "content": "Let me look.",
                    "tool_calls": [
                        {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
    }
    message = from_chat(chat, {"model": "claude-x"})
    assert message["id"] == "chatcmpl-1" and message["model"] == "claude-x"
    assert message["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert (message["stop_reason"], message["usage"]["input_tokens"], message["usage"]["output_tokens"]) == (
        "tool_use",
        7,
        3,
    )
    length = {"choices": [{"message": {"content": "x"}, "finish_reason": "length"}]}
    assert from_chat(length, {})["stop_reason"] == "max_tokens"
    vllm_stop = {"choices": [{"message": {"content": "x"}, "finish_reason": "stop", "stop_reason": "END"}]}
    assert (from_chat(vllm_stop, {"stop_sequences": ["END"]})["stop_reason"], "END") == (
        "stop_sequence",
        "END",
    )
    broken = {
        "choices": [
            {"message": {"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}}
        ]
    }
    assert from_chat(broken, {})["content"][0]["input"] == {"_raw_arguments": "{oops"}  # kept, not dropped


def _events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for frame in raw.split(b"\n\n"):
        lines = frame.split(b"\n")
        if len(lines) == 2 and lines[0].startswith(b"event: "):
            data = orjson.loads(lines[1][len(b"data: ") :])
            assert data["type"] == lines[0][len(b"event: ") :].decode()
            out.append(data)
    return out


def _chunks() -> bytes:
    frames = [
        {"id": "c1", "prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": " there"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "k", "function": {"name": "f", "arguments": '{"a"'}}]}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}, "finish_reason": "tool_calls"}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4}},
    ]  # fmt: skip
    return b"".join(b"data: " + orjson.dumps(f) + b"\n\n" for f in frames) + b"data: [DONE]\n\n"


def test_stream_translator_emits_anthropic_events_whatever_the_chunk_boundaries() -> None:
    raw = _chunks()
    whole = StreamTranslator({"model": "m"})
    expected = whole.feed(raw) + whole.close()
    for size in (1, 7, 64):
        t = StreamTranslator({"model": "m"})
        got = b"".join(t.feed(raw[i : i + size]) for i in range(0, len(raw), size)) + t.close()
        assert got == expected
    events = _events(expected)
    assert [e["type"] for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["id"] == "c1" and events[0]["message"]["usage"]["input_tokens"] == 3
    assert [e["delta"]["text"] for e in events[2:4]] == ["Hi", " there"]
    assert events[5]["content_block"] == {"type": "tool_use", "id": "k", "name": "f", "input": {}}
    assert "".join(e["delta"]["partial_json"] for e in events[6:8]) == '{"a": 1}'
    assert events[9]["delta"]["stop_reason"] == "tool_use" and events[9]["usage"]["output_tokens"] == 4
    broken = StreamTranslator({"model": "m"})
    out = broken.feed(raw[:200]) + broken.close("the stream from up broke")
    assert _events(out)[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "the stream from up broke"},
    }


def test_message_events_replay_a_whole_message() -> None:
    message = from_chat(
        {"id": "c", "choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}], "usage": {}}, {}
    )
    kinds = [e["type"] for e in _events(message_events(message))]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert "content_block_delta" in kinds


@pytest.mark.parametrize(
    "chat",
    [
        {},
        {"choices": "x", "usage": {"prompt_tokens": "many"}},
        {"choices": [{"message": {"tool_calls": ["x", {"function": "f"}, {"id": 1}]}, "finish_reason": 7}]},
        {"choices": [{"delta": {"tool_calls": [{"index": "a"}, 3]}}], "error": None},
    ],
)
def test_malformed_upstream_answers_translate_without_crashing(chat: dict[str, Any]) -> None:
    message = from_chat(chat, {"model": "m"})
    assert message["type"] == "message" and isinstance(message["usage"]["input_tokens"], int)
    t = StreamTranslator({"model": "m"})
    raw = b"data: " + orjson.dumps(chat) + b"\n\ndata: {broken\n\ndata: [1]\n\n"
    kinds = [e["type"] for e in _events(t.feed(raw) + t.close())]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


# ----- through the real gateway to the built-in engine -----------------------------------------------
@pytest.fixture(scope="module")
def engine(tool_model_path: Path) -> Iterator[EngineServer]:  # noqa: F811
    # the tests compare a Messages call with a chat call of the same prompt token for token and logprob for
    # logprob: without the prefix cache the second is computed as the first, not from its keys and values
    with EngineServer(tool_model_path, max_batch_size=4, prefix_cache_share=0) as srv:
        yield srv


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[LightningStore]:
    s = open_store(f"sqlite:///{tmp_path}/gw.db")
    yield s
    await s.aclose()


@pytest.fixture
def gateway(store: LightningStore, engine: EngineServer) -> Iterator[Gateway]:
    with Gateway(
        store, [UpstreamConfig(url=engine.base_url, kind="agl")], client_token="agent-key-0123456789"
    ) as gw:
        yield gw


async def _rollout(gw: Gateway, store: LightningStore) -> tuple[str, str]:
    """A rollout and its endpoint, as an agent gets it (``llm.endpoint``, ending in /v1)."""
    started = await store.start_rollout(RolloutCreate(input="task"))
    rid = started.rollout.rollout_id
    return rid, gw.rollout_base_url(rid, started.attempt.attempt_id)


def _claude(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="agent-key-0123456789", max_retries=0)


def _gpt(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url, api_key="agent-key-0123456789", max_retries=0)


async def _calls(gw: Gateway, store: LightningStore, rid: str) -> list[LLMCall]:
    await gw.flush()
    return llm_calls((await store.query_spans(rollout_id=rid)).items)


async def test_text_reply_is_recorded_with_the_token_ids_of_the_chat_call(
    gateway: Gateway, store: LightningStore
) -> None:
    rid, url = await _rollout(gateway, store)
    message = await _claude(url).messages.create(
        model="policy",
        max_tokens=12,
        system="Answer briefly.",
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "hello"}],
    )
    chat_rid, chat_url = await _rollout(gateway, store)
    reply = await _gpt(chat_url).chat.completions.create(
        model="policy",
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hello"}],
    )
    assert message.type == "message" and message.role == "assistant" and message.model == "policy"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == reply.choices[0].message.content  # type: ignore[union-attr]
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[reply.choices[0].finish_reason]
    assert reply.usage is not None and message.usage.output_tokens == reply.usage.completion_tokens > 0
    assert message.usage.input_tokens == reply.usage.prompt_tokens

    (call,) = await _calls(gateway, store, rid)
    (chat_call,) = await _calls(gateway, store, chat_rid)
    assert call.api == "anthropic.messages" and call.response_id == message.id
    assert call.has_token_ids and call.prompt_token_ids == chat_call.prompt_token_ids
    assert call.completion_token_ids == chat_call.completion_token_ids and call.logprobs == chat_call.logprobs
    assert call.request_messages == [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "hello"},
    ]
    assert call.attributes[sc.LLM_REQUEST]["max_tokens"] == 12  # the agent's own request is kept too


async def test_tool_use_round_trip_gives_the_samples_of_the_chat_conversation(
    gateway: Gateway, store: LightningStore
) -> None:
    rid, url = await _rollout(gateway, store)
    claude = _claude(url)
    first = await claude.messages.create(
        model="policy", max_tokens=48, extra_body=GREEDY, tools=ANTHROPIC_TOOLS,
        messages=[{"role": "user", "content": QUESTION}],
    )  # fmt: skip
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    history: list[MessageParam] = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}],
        },
    ]
    second = await claude.messages.create(
        model="policy",
        max_tokens=8,
        extra_body=GREEDY,
        tools=ANTHROPIC_TOOLS,
        messages=history,
    )

    chat_rid, chat_url = await _rollout(gateway, store)
    gpt = _gpt(chat_url)
    kwargs: dict[str, Any] = {"model": "policy", "temperature": 0, "tools": TOOLS}
    chat_messages = cast("list[ChatCompletionMessageParam]", TOOL_MESSAGES)
    asked = await gpt.chat.completions.create(max_tokens=48, messages=chat_messages, **kwargs)
    (tool_call,) = asked.choices[0].message.tool_calls or []
    messages: list[ChatCompletionMessageParam] = [
        *chat_messages,
        asked.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": "18 C and sunny"},
    ]
    answered = await gpt.chat.completions.create(max_tokens=8, messages=messages, **kwargs)
    assert [b.text for b in second.content if b.type == "text"] == [answered.choices[0].message.content or ""]

    calls, chat_calls = await _calls(gateway, store, rid), await _calls(gateway, store, chat_rid)
    assert [c.api for c in calls] == ["anthropic.messages"] * 2 and all(c.has_token_ids for c in calls)
    assert calls[0].tool_calls[0]["function"]["name"] == "get_weather"
    assert calls[1].request_messages is not None and calls[1].request_messages[-1]["role"] == "tool"
    samples, report = to_samples(calls, 1.0)
    chat_samples, _ = to_samples(chat_calls, 1.0)
    assert report.skipped_no_token_ids == 0 and len(samples) == len(chat_samples) >= 1
    for got, want in zip(samples, chat_samples, strict=True):
        assert (got.input_ids, got.loss_mask, got.old_logprobs) == (
            want.input_ids,
            want.loss_mask,
            want.old_logprobs,
        )
    assert sum(s.num_model_tokens for s in samples) == sum(len(c.completion_token_ids or []) for c in calls)


async def test_streams_text_and_tool_use_with_anthropic_events(
    gateway: Gateway, store: LightningStore
) -> None:
    rid, url = await _rollout(gateway, store)
    claude = _claude(url)
    request: dict[str, Any] = {"model": "policy", "max_tokens": 12, "extra_body": GREEDY}
    request["messages"] = [{"role": "user", "content": "hello"}]
    plain = await claude.messages.create(**request)
    kinds: list[str] = []
    async with claude.messages.stream(**request) as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == plain.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == plain.stop_reason and final.usage.output_tokens == plain.usage.output_tokens
    assert final.usage.input_tokens == plain.usage.input_tokens > 0

    async with claude.messages.stream(
        model="policy", max_tokens=48, extra_body=GREEDY, tools=ANTHROPIC_TOOLS,
        messages=[{"role": "user", "content": QUESTION}],
    ) as stream:  # fmt: skip
        called = await stream.get_final_message()
    (use,) = called.content
    assert use.type == "tool_use" and use.input == {"city": "Paris"} and called.stop_reason == "tool_use"

    plain_call, streamed, tool_call = await _calls(gateway, store, rid)
    assert streamed.attributes[sc.LLM_STREAM] is True and streamed.has_token_ids
    assert streamed.response_id == final.id
    assert (streamed.prompt_token_ids, streamed.completion_token_ids) == (
        plain_call.prompt_token_ids,
        plain_call.completion_token_ids,
    )
    assert tool_call.has_token_ids and tool_call.tool_calls[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
            "messages.0.content.0.type",
        ),
    ],
)
async def test_bad_requests_get_anthropic_400s_naming_the_field(
    gateway: Gateway, store: LightningStore, change: dict[str, Any], named: str
) -> None:
    _, url = await _rollout(gateway, store)
    body: dict[str, Any] = {
        "model": "policy",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body = {k: v for k, v in {**body, **change}.items() if v is not None}
    with pytest.raises(anthropic.BadRequestError) as info:
        await _claude(url).post("/v1/messages", body=body, cast_to=anthropic.types.Message)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "error"  # type: ignore[index]
    error = info.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error" and error["message"].startswith(named)


async def test_upstream_and_gateway_errors_keep_the_anthropic_shape(
    gateway: Gateway, store: LightningStore
) -> None:
    _, url = await _rollout(gateway, store)
    image: ImageBlockParam = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="},
    }
    with pytest.raises(anthropic.BadRequestError) as info:  # translated fine; the text-only engine refuses it
        await _claude(url).messages.create(
            model="policy", max_tokens=8, messages=[{"role": "user", "content": [image]}]
        )
    assert "text-only" in info.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as auth:
        await anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await _claude(url).messages.count_tokens(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert "POST /v1/messages" in missing.value.body["error"]["message"]  # type: ignore[index]
