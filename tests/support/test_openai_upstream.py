"""The scripted upstream itself: echo and tool rules, vLLM-style token fields on request, scripts and failures."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionFunctionToolParam, ChatCompletionMessageParam

from tests.support.openai_upstream import OpenAIUpstream, ScriptedReply, prompt_text, token_ids_of

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi there"}]


@pytest.fixture
def up() -> Iterator[OpenAIUpstream]:
    with OpenAIUpstream(token_ids=True, model_version="v2") as server:
        yield server


def test_echo_token_ids_only_when_asked(up: OpenAIUpstream) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key="x")
    plain = client.chat.completions.create(model="m", messages=USER).model_dump()
    assert plain["choices"][0]["message"]["content"] == "echo: hi there"
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    asked = client.chat.completions.create(
        model="m", messages=USER, extra_body={"return_token_ids": True}, logprobs=True
    ).model_dump()
    assert asked["prompt_token_ids"] == token_ids_of(prompt_text(USER))
    assert asked["choices"][0]["token_ids"] == token_ids_of("echo: hi there")
    assert len(asked["choices"][0]["logprobs"]["content"]) == 3 and asked["model_version"] == "v2"
    assert [r.path for r in up.requests] == ["/v1/chat/completions"] * 2
    assert up.requests[1].body["return_token_ids"] is True


def test_streaming_tool_calls_and_scripts(up: OpenAIUpstream) -> None:
    client = openai.OpenAI(base_url=up.base_url, api_key="x")
    tools: list[ChatCompletionFunctionToolParam] = [
        {"type": "function", "function": {"name": "search", "parameters": {"properties": {"q": {}}}}}
    ]
    reply = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "search cats"}], tools=tools
    )
    (call,) = reply.choices[0].message.tool_calls or []
    assert call.type == "function"
    assert call.function.name == "search" and call.function.arguments == '{"q":"search cats"}'
    no_tool = client.chat.completions.create(model="m", messages=USER, tools=tools)
    assert no_tool.choices[0].message.tool_calls is None  # the message names no tool
    up.script("first scripted", ScriptedReply(content="second", finish_reason="length"))
    chunks = list(client.chat.completions.create(model="m", messages=USER, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "first scripted"
    second = client.chat.completions.create(model="m", messages=USER)
    assert second.choices[0].message.content == "second" and second.choices[0].finish_reason == "length"
    assert client.completions.create(model="m", prompt="p q").choices[0].text == "echo: p q"
    assert client.responses.create(model="m", input="r").output_text == "echo: r"
    assert [m.id for m in client.models.list()] == ["test-model"]


def test_failures_auth_and_health() -> None:
    with OpenAIUpstream(api_key="secret-key") as up:
        with httpx.Client(base_url=up.base_url) as http:
            body = {"model": "m", "messages": USER}
            assert http.post("/chat/completions", json=body).status_code == 401
            auth = {"authorization": "Bearer secret-key"}
            up.fail("503", times=1)
            assert http.post("/chat/completions", json=body, headers=auth).status_code == 503
            assert http.post("/chat/completions", json=body, headers=auth).status_code == 200
            up.fail("close")
            with pytest.raises(httpx.RemoteProtocolError):
                http.post("/chat/completions", json=body, headers=auth)
            bad = http.post("/chat/completions", json={"model": "m", "messages": []}, headers=auth)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
            up.fail("500", times=None)
            assert httpx.get(f"{up.url}/health").status_code == 503
            up.recover()
            assert httpx.get(f"{up.url}/health").json() == {"status": "ok"}
            up.fail("hang")
            result: list[BaseException] = []

            def hang() -> None:
                try:
                    httpx.post(f"{up.base_url}/chat/completions", json=body, headers=auth, timeout=0.3)
                except httpx.ReadTimeout as exc:
                    result.append(exc)

            t = threading.Thread(target=hang)
            t.start()
            t.join(5)
            assert len(result) == 1
        started = time.monotonic()
    assert time.monotonic() - started < 3  # stop does not wait on the hanging request
