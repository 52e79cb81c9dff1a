"""Auto-instrumentation with the real openai SDK and LangChain against a real local OpenAI-compatible server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, cast

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

import agl
from agl import semconv as sc
from agl.schemas import LLM, LLMCall, RolloutCreate
from agl.store import InMemoryLightningStore
from agl.tracer.normalize import normalize_openinference
from examples.apo.simulated_lm import LOOKUP_TOOL, SimulatedLMServer

SYSTEM = "Use the lookup tool when a price is not given. End with ANSWER: <number>."
QUESTION = "What do 3 units of item-5 cost, in catalog units?"
GIVEN = "One item-1 costs 4 dollars. What do 2 of them cost?"


@pytest.fixture(scope="module")
def server() -> Any:
    agl.instrument("openai", "langchain", required=True)
    with SimulatedLMServer() as s:
        yield s


@pytest.fixture
async def store(server: SimulatedLMServer) -> AsyncIterator[InMemoryLightningStore]:
    s = InMemoryLightningStore()
    await s.add_resources({"llm": LLM(endpoint=server.base_url, model="task")})
    yield s


async def _calls(store: InMemoryLightningStore, agent: Any) -> list[LLMCall]:
    (rollout,) = await store.enqueue_rollouts([RolloutCreate(input=None)])
    (outcome,) = await agl.Runner(agent, store).run(max_rollouts=1)
    assert outcome.status.value == "succeeded", outcome.error
    spans = (await store.query_spans(rollout_id=rollout.rollout_id)).items
    return [c for c in (LLMCall.from_span(s) for s in spans) if c is not None]


def _messages(question: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def test_openai_sync_call_with_tool_calls(store: InMemoryLightningStore) -> None:
    @agl.rollout
    def agent(llm: LLM) -> None:
        client = openai.OpenAI(base_url=llm.endpoint, api_key="k")
        client.chat.completions.create(
            model=llm.model,
            messages=_messages(QUESTION),
            tools=[cast("ChatCompletionToolParam", LOOKUP_TOOL)],
        )

    (call,) = await _calls(store, agent)
    assert call.source == "openinference" and call.model == "task"
    assert call.request_messages == _messages(QUESTION)
    assert call.tool_calls[0]["function"]["name"] == "lookup"
    assert json.loads(call.tool_calls[0]["function"]["arguments"]) == {"item": "item-5"}
    assert call.usage["total_tokens"] > 0 and call.response_id
    assert not call.has_token_ids  # this server returns none, and nothing is guessed


async def test_openai_async_and_streaming(store: InMemoryLightningStore) -> None:
    @agl.rollout
    async def agent(llm: LLM) -> None:
        client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k")
        await client.chat.completions.create(model=llm.model, messages=_messages(GIVEN))
        stream = await client.chat.completions.create(model=llm.model, messages=_messages(GIVEN), stream=True)
        async for _ in stream:
            pass

    plain, streamed = await _calls(store, agent)
    assert plain.response_message == {"role": "assistant", "content": "ANSWER: 8"}
    assert streamed.response_message is not None and streamed.response_message["content"] == "ANSWER: 8"


async def test_langchain_chat_openai(store: InMemoryLightningStore) -> None:
    from langchain_openai import ChatOpenAI

    @agl.rollout
    async def agent(llm: LLM) -> None:
        model = ChatOpenAI(base_url=llm.endpoint, api_key="k", model=llm.model)  # type: ignore[arg-type]
        await model.ainvoke([("system", SYSTEM), ("user", GIVEN)])

    calls = await _calls(store, agent)
    langchain = [c for c in calls if "langchain" in str(c.attributes.get("metadata"))]
    assert calls and all(c.request_messages and c.request_messages[-1]["content"] == GIVEN for c in calls)
    assert any(c.response_message and c.response_message.get("content") == "ANSWER: 8" for c in calls)
    assert (
        len(langchain) == 1 and len(calls) == 2
    )  # the LangChain span itself, beside the openai one it wraps
    # its LLMResult names the response: the two records are one call
    assert {c.response_id for c in calls} == {langchain[0].response_id} != {None}


def test_normalize_keeps_engine_token_ids() -> None:
    response = {
        "id": "chatcmpl-1",
        "prompt_token_ids": [1, 2, 3],
        "model_version": 4,
        "choices": [
            {
                "message": {"role": "assistant", "content": "hi"},
                "finish_reason": "stop",
                "token_ids": [7, 8],
                "logprobs": {"content": [{"token": "h", "logprob": -0.5}, {"token": "i", "logprob": -0.25}]},
            }
        ],
    }
    out = normalize_openinference(
        {"openinference.span.kind": "LLM", "output.value": json.dumps(response), "input.value": "{}"}
    )
    assert out[sc.LLM_PROMPT_TOKEN_IDS] == [1, 2, 3] and out[sc.LLM_COMPLETION_TOKEN_IDS] == [7, 8]
    assert out[sc.LLM_LOGPROBS] == [-0.5, -0.25] and out[sc.LLM_HAS_TOKEN_IDS] is True
    assert out[sc.LLM_MODEL_VERSION] == "4" and out[sc.LLM_FINISH_REASON] == "stop"
    assert normalize_openinference({"openinference.span.kind": "CHAIN"}) == {}


def test_normalize_finds_the_response_id_in_a_langchain_result() -> None:
    def result(llm_output: dict[str, Any] | None, metadata: dict[str, Any]) -> dict[str, Any]:
        message = {"lc": 1, "type": "constructor", "kwargs": {"content": "hi", "response_metadata": metadata}}
        return {
            "generations": [[{"text": "hi", "message": message}]],
            "llm_output": llm_output,
            "type": "LLMResult",
        }

    def response_id(value: dict[str, Any]) -> Any:
        attrs = {"openinference.span.kind": "LLM", "output.value": json.dumps(value)}
        return normalize_openinference(attrs).get(sc.LLM_RESPONSE_ID)

    assert response_id(result({"id": "chatcmpl-1"}, {"id": "chatcmpl-1"})) == "chatcmpl-1"
    assert response_id(result(None, {"id": "chatcmpl-2"})) == "chatcmpl-2"
    assert response_id(result({}, {"finish_reason": "stop"})) is None  # streamed: LangChain keeps no id


async def test_calls_outside_a_rollout_are_not_recorded(server: SimulatedLMServer) -> None:
    from agl.tracer import span_processor

    before = span_processor().converted
    openai.OpenAI(base_url=server.base_url, api_key="k").chat.completions.create(
        model="task",
        messages=_messages(GIVEN),
    )
    assert span_processor().converted == before


def _word_ids(text: str) -> list[int]:
    return [len(word) for word in text.split()]


async def _vllm_chat(request: Any) -> Any:
    """vLLM-style chat completion: the engine's token ids ride along in the body."""
    from starlette.responses import JSONResponse

    body = await request.json()
    prompt = " ".join(str(m["content"]) for m in body["messages"])
    reply = f"echo {prompt}"
    return JSONResponse(
        {
            "id": f"chatcmpl-{len(prompt)}",
            "object": "chat.completion",
            "created": 1,
            "model": body["model"],
            "prompt_token_ids": _word_ids(prompt),
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "stop",
                    "message": {"role": "assistant", "content": reply},
                    "token_ids": _word_ids(reply),
                }
            ],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
        }
    )


async def _completions(request: Any) -> Any:
    from starlette.responses import JSONResponse

    body = await request.json()
    return JSONResponse(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 1,
            "model": body["model"],
            "choices": [
                {"index": 0, "finish_reason": "length", "text": body["prompt"][::-1], "logprobs": None}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


async def _responses(request: Any) -> Any:
    from starlette.responses import JSONResponse

    body = await request.json()
    return JSONResponse(
        {
            "id": "resp_1",
            "object": "response",
            "created_at": 1,
            "model": body["model"],
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": str(body["input"]).upper(), "annotations": []}
                    ],
                }
            ],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "tools": [],
            "usage": {
                "input_tokens": 2,
                "output_tokens": 1,
                "total_tokens": 3,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            },
        }
    )


@pytest.fixture(scope="module")
def engine_like() -> Any:
    """A real HTTP server answering like a vLLM engine (token ids) and the completions/responses APIs."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    from agl.asgi_server import BackgroundServer

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", _vllm_chat, methods=["POST"]),
            Route("/v1/completions", _completions, methods=["POST"]),
            Route("/v1/responses", _responses, methods=["POST"]),
        ]
    )
    agl.instrument("openai", required=True)
    with BackgroundServer(app) as s:
        yield s.url + "/v1"


async def test_token_ids_completions_and_responses_apis(engine_like: str) -> None:
    store = InMemoryLightningStore()
    await store.add_resources({"llm": LLM(endpoint=engine_like, model="m")})

    @agl.rollout
    def agent(llm: LLM) -> None:
        client = openai.OpenAI(base_url=llm.endpoint, api_key="k")
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a bb ccc"}])
        client.completions.create(model="m", prompt="hello")
        client.responses.create(model="m", input="hey")

    chat, completion, response = await _calls(store, agent)
    assert chat.prompt_token_ids == [1, 2, 3] and chat.completion_token_ids == [4, 1, 2, 3]
    assert chat.has_token_ids and chat.response_message == {"role": "assistant", "content": "echo a bb ccc"}
    assert completion.api == "completions" and completion.prompt == "hello"
    assert completion.response_message == {"role": "assistant", "content": "olleh"}
    assert not completion.has_token_ids and completion.prompt_token_ids is None
    assert response.api == "responses" and response.response_id == "resp_1"
    assert response.request_messages == [{"role": "user", "content": "hey"}]
    assert response.response_message is not None and response.response_message["content"] == "HEY"
