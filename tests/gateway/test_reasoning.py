"""Reasoning models through the gateway: ``chat_template_kwargs`` reach a vLLM upstream unchanged, and a
reply's thinking (vLLM's ``reasoning_content`` or ``reasoning``, streamed or not) is recorded."""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from agl import semconv as sc
from agl.gateway import Gateway
from agl.gateway.recording import CallRecord, build_span
from agl.schemas import LLMCall
from tests.support.openai_upstream import OpenAIUpstream

OFF = {"enable_thinking": False}


async def test_chat_template_kwargs_are_forwarded_to_a_vllm_upstream(
    gateway: Gateway, upstream: OpenAIUpstream, rollout: tuple[str, str]
) -> None:
    url = gateway.rollout_base_url(*rollout)
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template_kwargs": OFF,
    }
    async with httpx.AsyncClient(timeout=30) as client:
        plain = await client.post(f"{url}/chat/completions", json=body)
        streamed = await client.post(f"{url}/chat/completions", json={**body, "stream": True})
    assert plain.status_code == 200 and streamed.status_code == 200
    sent = [r.body for r in upstream.requests if r.path.endswith("/chat/completions")]
    assert [b["chat_template_kwargs"] for b in sent] == [OFF, OFF]
    assert all(b.get("return_token_ids") is True for b in sent)  # the vLLM kind's own fields still added


async def test_a_non_object_chat_template_kwargs_is_refused_naming_it(
    gateway: Gateway, upstream: OpenAIUpstream, rollout: tuple[str, str]
) -> None:
    url = gateway.rollout_base_url(*rollout)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": "off"}
    async with httpx.AsyncClient(timeout=30) as client:
        reply = await client.post(f"{url}/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "chat_template_kwargs"
    assert not [r for r in upstream.requests if r.path.endswith("/chat/completions")]


def _record(**fields: Any) -> CallRecord:
    request = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return CallRecord("r", "a", None, "chat.completions", request, 1, 2, 200, "http://b/v1", **fields)


def _chunk(delta: dict[str, Any], ids: list[int], **top: Any) -> bytes:
    choice = {
        "index": 0,
        "delta": delta,
        "token_ids": ids,
        "logprobs": {"content": [{"logprob": -0.1}] * len(ids)},
    }
    return b"data: " + orjson.dumps({"id": "c1", "choices": [choice], **top}) + b"\n\n"


def test_vllm_reasoning_fields_are_recorded_streamed_or_not() -> None:
    for key in ("reasoning_content", "reasoning"):  # vLLM before and after it renamed the field
        message = {"role": "assistant", "content": "5", key: "2 + 3 = 5"}
        choice = {"index": 0, "message": message, "finish_reason": "stop", "token_ids": [7, 8, 9]}
        body = {"id": "c1", "choices": [choice], "prompt_token_ids": [1, 2]}
        plain = LLMCall.from_span(build_span(_record(response=orjson.dumps(body))))
        chunks = [
            _chunk({"role": "assistant", key: "2 + 3"}, [7], prompt_token_ids=[1, 2]),
            _chunk({key: " = 5"}, [8]),
            _chunk({"content": "5"}, [9]),
            b"data: [DONE]\n\n",
        ]
        streamed = LLMCall.from_span(build_span(_record(chunks=chunks)))
        for call in (plain, streamed):
            assert call is not None and call.reasoning == "2 + 3 = 5"
            assert call.attributes[sc.LLM_REASONING] == "2 + 3 = 5"
            assert call.response_message is not None and call.response_message["content"] == "5"
            assert call.completion_token_ids == [7, 8, 9]


def test_a_reply_without_thinking_records_no_reasoning() -> None:
    choice = {"index": 0, "message": {"role": "assistant", "content": "hi"}, "token_ids": [7]}
    call = LLMCall.from_span(build_span(_record(response=orjson.dumps({"id": "c1", "choices": [choice]}))))
    assert call is not None and call.reasoning is None and sc.LLM_REASONING not in call.attributes
    assert call.response_message is not None and "reasoning_content" not in call.response_message
