"""The OpenAI Responses API (``POST /v1/responses``) over the chat path, with exact token ids.

A request's ``instructions`` and ``input`` items (messages, ``function_call``, ``function_call_output``)
become chat messages rendered by the model's chat template; flat function tools become chat tools. The
response carries ``message`` and ``function_call`` output items plus ``prompt_token_ids``, ``token_ids``
and ``logprobs`` at the top level, which the gateway records. A thinking model's ``<think>`` block comes
back as a ``reasoning`` item (``reasoning_text`` content) before the message, and a ``reasoning`` input
item is handed back to the template as the next assistant turn's ``reasoning_content``;
``chat_template_kwargs`` (e.g. ``enable_thinking``) reach the template as on chat requests. Stateless:
``previous_response_id`` is refused (send the whole history as ``input``, as the OpenAI Agents SDK does by
default).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from agl.engines.builtin.engine import Choice, Engine, Generation, StreamDelta
from agl.engines.builtin.protocol import chat_logprobs
from agl.engines.builtin.reasoning import reasoning_token_count, split_reply
from agl.engines.builtin.sampling import MAX_TOP_LOGPROBS, SamplingParams
from agl.errors import InvalidRequestError

_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_ROLES = frozenset({"system", "developer", "user", "assistant"})


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``; fields the engine has no use for (``store``, ``metadata``, ...) are ignored."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: Any = None  # checked in to_chat, so a wrong shape gets an error naming ``input`` itself
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    seed: int | None = None
    stream: bool = False
    previous_response_id: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension, as on chat requests

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_tokens=self.max_output_tokens,
            seed=self.seed,
            top_logprobs=self.top_logprobs or 0,
        )


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"{where} must be a string or a list of text parts", param=where.split(".content")[0]
        )
    parts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in _TEXT_PARTS
            or not isinstance(part.get("text"), str)
        ):
            raise InvalidRequestError(
                f"{where}[{j}] must be a text part {{'type': 'input_text', 'text': ...}}; "
                "this engine serves text-only models",
                param=f"{where}[{j}]",
            )
        parts.append(part["text"])
    return "".join(parts)


def _field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"{where}.{key} must be a string, got {value!r:.80}", param=f"{where}.{key}"
        )
    return value


def to_chat(req: ResponsesRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Chat ``messages`` and ``tools`` equivalent to a Responses request; bad items raise naming them."""
    if req.previous_response_id is not None:
        raise InvalidRequestError(
            "previous_response_id is not supported: this engine stores no responses; send the whole "
            "conversation as input",
            param="previous_response_id",
        )
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    if not isinstance(items, list) or not items:
        raise InvalidRequestError(
            f"input must be a string or a non-empty list of items, got {req.input!r:.80}", param="input"
        )
    thinking: str | None = None  # a reasoning item's text, for the assistant turn that follows it
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object, got {item!r:.80}", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise InvalidRequestError(
                    f"{where}.role must be one of {sorted(_ROLES)}, got {role!r:.40}", param=f"{where}.role"
                )
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
            if role == "assistant" and thinking:
                messages[-1]["reasoning_content"] = thinking
            thinking = None  # thinking belongs to the assistant turn right after it, or to none
        elif kind == "function_call":
            call = {
                "id": _field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _field(item, "name", where),
                    "arguments": _field(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one turn's text and calls: one message
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if thinking:
                messages[-1].setdefault("reasoning_content", thinking)
                thinking = None
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where), "content": text})
            thinking = None
        elif kind == "reasoning":
            # the model's own earlier thinking: a template that keeps it (Qwen3, after the last user
            # turn) renders it with the assistant turn that follows; a summary alone is not prompt text
            thinking = _reasoning_text(item, where) or None
        else:
            raise InvalidRequestError(
                f"{where}.type {kind!r:.40} is not supported; use message, function_call or "
                "function_call_output",
                param=f"{where}.type",
            )
    return messages, None if req.tool_choice == "none" else _chat_tools(req.tools)


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """The text of a ``reasoning`` input item's ``reasoning_text`` content parts."""
    parts = item.get("content") or []
    if not isinstance(parts, list):
        raise InvalidRequestError(f"{where}.content must be a list of reasoning_text parts", param=where)
    return "".join(
        str(p.get("text") or "") for p in parts if isinstance(p, dict) and p.get("type") == "reasoning_text"
    )


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise InvalidRequestError(
                f"tools[{i}] must be a function tool {{'type': 'function', 'name': ..., 'parameters': ...}}; "
                f"hosted tools ({tool.get('type')!r:.40}) are not available on this engine",
                param=f"tools[{i}]",
            )
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out or None


def _output(choice: Choice, reasoning: str | None, content: str | None) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reasoning is not None:  # vLLM's shape: the thinking as reasoning_text content, no summary
        items.append(
            {
                "type": "reasoning",
                "id": f"rs_{uuid.uuid4().hex}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reasoning}],
                "status": "completed",
            }
        )
    if content:
        part = {"type": "output_text", "text": content, "annotations": [], "logprobs": []}
        items.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for call in choice.tool_calls or []:
        items.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    return items


def response_body(
    engine: Engine, req: ResponsesRequest, gen: Generation, response_id: str | None = None
) -> dict[str, Any]:
    """The Responses API ``response`` object of a finished generation, with the token-fidelity fields."""
    choice = gen.choices[0]
    prompt, completion = len(gen.prompt_token_ids), len(choice.token_ids)
    incomplete = choice.finish_reason == "length"
    reasoning, content = split_reply(engine.reasoning_tags, gen.prompt_token_ids, choice.content)
    return {
        "id": response_id or f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": gen.created,
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": req.model or engine.model_name,
        "instructions": req.instructions,
        "output": _output(choice, reasoning, content),
        "parallel_tool_calls": True,
        "tool_choice": req.tool_choice or "auto",
        "tools": req.tools or [],
        "temperature": req.temperature,
        "top_p": req.top_p,
        "max_output_tokens": req.max_output_tokens,
        "usage": {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {
                "reasoning_tokens": reasoning_token_count(engine.reasoning_tags, choice.token_ids, reasoning)
            },
            "total_tokens": prompt + completion,
        },
        "prompt_token_ids": gen.prompt_token_ids,
        "token_ids": choice.token_ids,
        "logprobs": chat_logprobs(engine.tokenizer, choice),
        "model_version": gen.model_version,
    }


class _Events:
    """Numbered ``event:``/``data:`` SSE frames, as the Responses API streams them."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        self.n += 1
        data = orjson.dumps({"type": kind, "sequence_number": self.n - 1, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


async def stream_events(
    engine: Engine, req: ResponsesRequest, stream: AsyncIterator[StreamDelta | Generation]
) -> AsyncIterator[bytes]:
    """The Responses event stream: text deltas as they decode; with tools, or from a thinking model, the
    output is sent when it ends (a tool call, or where the thinking ends, is known only then).
    ``response.completed`` carries the full response with token ids."""
    rid = f"resp_{uuid.uuid4().hex}"
    event = _Events()
    shell = {"id": rid, "object": "response", "created_at": int(time.time()), "status": "in_progress"}
    shell.update(model=req.model or engine.model_name, output=[], tools=req.tools or [])
    shell.update(parallel_tool_calls=True, tool_choice=req.tool_choice or "auto")
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    msg_id, streamed = f"msg_{uuid.uuid4().hex}", False
    async for item in stream:
        if isinstance(item, StreamDelta):
            if req.tools or engine.reasoning_tags is not None or not item.text:
                continue
            if not streamed:
                streamed = True
                for frame in _open_message(event, msg_id, 0):
                    yield frame
            ids = {"item_id": msg_id, "output_index": 0, "content_index": 0}
            yield event("response.output_text.delta", **ids, delta=item.text, logprobs=[])
            continue
        body = response_body(engine, req, item, rid)
        for index, out in enumerate(body["output"]):
            if out["type"] == "message":
                if streamed:
                    out["id"] = msg_id  # the message keeps the id its deltas named
                else:
                    for frame in _open_message(event, out["id"], index):
                        yield frame
                    ids = {"item_id": out["id"], "output_index": index, "content_index": 0}
                    yield event(
                        "response.output_text.delta", **ids, delta=out["content"][0]["text"], logprobs=[]
                    )
                ids = {"item_id": out["id"], "output_index": index, "content_index": 0}
                yield event("response.output_text.done", **ids, text=out["content"][0]["text"], logprobs=[])
                yield event("response.content_part.done", **ids, part=out["content"][0])
            elif out["type"] == "reasoning":
                yield event("response.output_item.added", output_index=index, item={**out, "content": []})
                ids = {"item_id": out["id"], "output_index": index, "content_index": 0}
                text = out["content"][0]["text"]
                yield event("response.reasoning_text.delta", **ids, delta=text)
                yield event("response.reasoning_text.done", **ids, text=text)
            else:
                yield event("response.output_item.added", output_index=index, item={**out, "arguments": ""})
                ids = {"item_id": out["id"], "output_index": index}
                yield event("response.function_call_arguments.delta", **ids, delta=out["arguments"])
                yield event("response.function_call_arguments.done", **ids, arguments=out["arguments"])
            yield event("response.output_item.done", output_index=index, item=out)
        yield event("response.completed", response=body)
        return


def _open_message(event: _Events, item_id: str, index: int) -> list[bytes]:
    item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        event("response.output_item.added", output_index=index, item=item),
        event("response.content_part.added", item_id=item_id, output_index=index, content_index=0, part=part),
    ]
