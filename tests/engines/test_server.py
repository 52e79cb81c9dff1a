"""The engine over HTTP with real clients: the openai SDK (sync, async, streaming, tools) and httpx."""

from __future__ import annotations

import gc
import json
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from agl.engines.builtin.server import EngineServer

from .conftest import TOOL_MESSAGES, TOOLS

HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
# the conftest chat dicts as the openai SDK types them
SDK_TOOL_MESSAGES = cast("list[ChatCompletionMessageParam]", TOOL_MESSAGES)
SDK_TOOLS = cast("list[ChatCompletionToolParam]", TOOLS)


@pytest.fixture(scope="module")
def server(tiny_path: Path) -> Iterator[EngineServer]:
    with EngineServer(tiny_path, max_batch_size=8) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_health_and_models(server: EngineServer) -> None:
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    models = openai.OpenAI(base_url=server.base_url, api_key="x").models.list()
    assert [m.id for m in models.data] == [server.engine.model_name]


def test_sync_chat_carries_token_fidelity_fields(client: openai.OpenAI, server: EngineServer) -> None:
    resp = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=6, temperature=0.7, seed=3, n=2
    )
    raw = resp.model_dump()
    assert raw["prompt_token_ids"] == server.engine.encode_chat(cast("list[dict[str, Any]]", HELLO))
    assert raw["model_version"] == server.engine.model_version
    assert len(resp.choices) == 2 and resp.usage is not None
    for choice in raw["choices"]:
        entries = choice["logprobs"]["content"]
        assert len(entries) == len(choice["token_ids"]) == 6 and choice["finish_reason"] == "length"
        assert all(e["bytes"] is None and e["top_logprobs"] == [] and e["logprob"] <= 0 for e in entries)
    assert resp.usage.completion_tokens == 12
    again = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=6, temperature=0.7, seed=3, n=2
    )
    assert [c.model_dump()["token_ids"] for c in again.choices] == [c["token_ids"] for c in raw["choices"]]


async def test_async_client_and_top_logprobs(server: EngineServer) -> None:
    aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    resp = await aclient.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=4, logprobs=True, top_logprobs=3, temperature=0
    )
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob for e in content)
    await aclient.close()


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": "tiny",
        "messages": HELLO,
        "max_tokens": 10,
        "temperature": 1.0,
        "seed": 9,
    }
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [t for c in chunks if c.choices for t in c.model_dump()["choices"][0]["token_ids"]]
    assert text == full.choices[0].message.content
    assert ids == full.model_dump()["choices"][0]["token_ids"]
    assert chunks[0].model_dump()["prompt_token_ids"] == full.model_dump()["prompt_token_ids"]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)


def test_completions_endpoint(client: openai.OpenAI, server: EngineServer) -> None:
    resp = client.completions.create(model="tiny", prompt="12 + 7 =", max_tokens=5, temperature=0, logprobs=2)
    raw = resp.model_dump()
    choice = raw["choices"][0]
    assert raw["prompt_token_ids"] == server.engine.encode_prompt("12 + 7 =")
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 5
    assert len(choice["logprobs"]["top_logprobs"][0]) == 2
    by_ids = httpx.post(
        f"{server.base_url}/completions",
        json={"prompt": raw["prompt_token_ids"], "max_tokens": 5, "temperature": 0},
    ).json()
    assert by_ids["choices"][0]["token_ids"] == choice["token_ids"]


def test_prompt_logprobs_score_every_prompt_token_as_vllm_does(server: EngineServer, tiny_path: Path) -> None:
    """vLLM's ``prompt_logprobs=k``: None for the first token, then each token's own log-prob and rank with
    its position's k likeliest, the numbers the model's forward pass gives."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = server.engine.encode_prompt("12 + 7 = 19, and 3 + 4 = 7")
    body = {"prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2}
    scored = httpx.post(f"{server.base_url}/completions", json=body, timeout=60).json()["choices"][0]
    entries = scored["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(ids)
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    for j in range(1, len(ids)):
        own = entries[j][str(ids[j])]
        assert own["logprob"] == pytest.approx(float(want[j - 1, ids[j]]), abs=1e-4)
        assert own["rank"] == int((want[j - 1] > want[j - 1, ids[j]]).sum()) + 1
        assert own["decoded_token"] == server.engine.tokenizer.decode([ids[j]])
        best = sorted(((e["rank"], int(t)) for t, e in entries[j].items() if e["rank"] <= 2))
        assert [t for _, t in best] == want[j - 1].topk(2).indices.tolist()
    without = httpx.post(f"{server.base_url}/completions", json={**body, "prompt_logprobs": None}).json()
    assert "prompt_logprobs" not in without["choices"][0]
    bad = httpx.post(f"{server.base_url}/completions", json={**body, "prompt_logprobs": -1})
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text


def test_tool_calls_through_sdk_after_weights_endpoint(tiny_path: Path, tool_model_path: Path) -> None:
    with EngineServer(tiny_path) as srv:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        before = client.chat.completions.create(
            model="m", messages=SDK_TOOL_MESSAGES, tools=SDK_TOOLS, max_tokens=30, temperature=0
        )
        assert before.model_dump()["model_version"] == "v0"
        resp = httpx.post(f"{srv.base_url}/weights", json={"path": str(tool_model_path), "version": "step-1"})
        assert resp.status_code == 200 and resp.json() == {"model_version": "step-1"}
        after = client.chat.completions.create(
            model="m", messages=SDK_TOOL_MESSAGES, tools=SDK_TOOLS, max_tokens=60, temperature=0
        )
        assert after.model_dump()["model_version"] == "step-1"
        choice = after.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        call = choice.message.tool_calls[0]
        assert call.type == "function"
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {
            "city": "Paris"
        }
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=SDK_TOOL_MESSAGES,
                tools=SDK_TOOLS,
                max_tokens=60,
                temperature=0,
                stream=True,
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert any(d.tool_calls for d in deltas) and not any(d.content for d in deltas)
        assert deltas[-1].tool_calls[0].function.name == "get_weather"  # type: ignore[index, union-attr]
        follow = TOOL_MESSAGES + [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ]
        sdk_follow = cast("list[ChatCompletionMessageParam]", follow)
        reply = client.chat.completions.create(model="m", messages=sdk_follow, tools=SDK_TOOLS, max_tokens=3)
        assert reply.model_dump()["prompt_token_ids"][-3:] == srv.engine.encode_chat(follow, TOOLS)[-3:]


def test_in_process_update_from_another_thread(tiny_path: Path, tool_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tool_model_path).state_dict()
    with EngineServer(tiny_path) as srv:
        assert srv.update_weights(state, "trained") == "trained"
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        resp = client.chat.completions.create(
            model="m", messages=SDK_TOOL_MESSAGES, tools=SDK_TOOLS, max_tokens=60, temperature=0
        )
        assert (
            resp.choices[0].finish_reason == "tool_calls" and resp.model_dump()["model_version"] == "trained"
        )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": HELLO, "temperature": -1}, "temperature"),
        ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
        ({"messages": HELLO, "n": 0}, "n"),
        ({"messages": HELLO, "top_p": 0}, "top_p"),
        ({"messages": HELLO, "top_logprobs": 99}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": HELLO, "stop": [""]}, "stop"),
        ({"messages": [{"role": "user", "content": "word " * 3000}]}, "messages"),
    ],
)
def test_bad_chat_requests_get_400_naming_the_field(server: EngineServer, body: dict, param: str) -> None:
    resp = httpx.post(f"{server.base_url}/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


@pytest.mark.parametrize(
    "body",
    [
        [1, 2],
        {"messages": "hi"},
        {"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]},
        {"messages": [{"role": "assistant", "tool_calls": [7]}]},
        {
            "messages": [
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}
            ]
        },
        {"messages": [{"role": "user"}], "tools": [3]},
        {"messages": HELLO, "stop": 5},
        {"messages": HELLO, "seed": "abc"},
        {"messages": HELLO, "stream": "maybe"},
        {"messages": [{"role": "user", "content": 5}]},
    ],
)
def test_odd_bodies_never_500(server: EngineServer, body: object) -> None:
    resp = httpx.post(f"{server.base_url}/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"]


def test_other_bad_requests(server: EngineServer, tmp_path: Path) -> None:
    base = server.base_url
    resp = httpx.post(
        f"{base}/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 400 and "error" in resp.json()
    resp = httpx.post(f"{base}/completions", json={"prompt": [10**9], "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    resp = httpx.post(f"{base}/completions", json={"prompt": [5] * 5000})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    resp = httpx.post(f"{base}/weights", json={"path": str(tmp_path / "nope")})
    assert resp.status_code == 400 and "not a folder" in resp.json()["error"]["message"]
    resp = httpx.post(f"{base}/weights", json={"path": str(tmp_path), "lora": True})
    assert resp.status_code == 400 and "adapter_config.json" in resp.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=base, api_key="x", max_retries=0).chat.completions.create(
            model="tiny", messages=HELLO, temperature=-2
        )
    assert httpx.get(f"{server.url}/health").json()["model_version"] == "v0"


def test_a_stopped_server_lets_its_engine_and_weights_go(tiny_path: Path) -> None:
    """Nothing outside the server keeps its engine alive (FastAPI caches route functions process-wide),
    so stopping a teacher's or an evaluated model's engine frees its weights."""
    with EngineServer(tiny_path, max_batch_size=2) as srv:
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(f"{srv.base_url}/chat/completions", json=chat, timeout=60).status_code == 200
        assert httpx.get(f"{srv.url}/health", timeout=10).status_code == 200
        engine = weakref.ref(srv.engine)
    del srv
    gc.collect()
    assert engine() is None
