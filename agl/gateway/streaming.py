"""Reassemble a streamed (SSE) chat or text completion into the response body a non-streamed call returns.

The gateway passes chunks to the agent untouched and keeps the raw bytes; this runs later, in the
recorder, so parsing never sits on the request path. Token ids and logprobs are concatenated from the
chunks (vLLM sends ``prompt_token_ids`` on the first chunk and ``token_ids`` per chunk).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import orjson


def iter_sse_data(raw: Iterable[bytes]) -> Iterable[dict[str, Any]]:
    """The JSON payloads of the ``data:`` lines of an SSE byte stream, chunk boundaries anywhere."""
    buffer = b"".join(raw)
    for line in buffer.splitlines():
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if not payload or payload == b"[DONE]":
            continue
        try:
            value = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue  # a broken chunk is the upstream's problem; record what parses
        if isinstance(value, dict):
            yield value


class _Choice:
    def __init__(self) -> None:
        self.role = "assistant"
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.token_ids: list[int] | None = None
        self.prompt_token_ids: list[int] | None = None
        self.logprobs: list[dict[str, Any]] | None = None
        self.token_logprobs: list[float] | None = None

    def add(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if isinstance(delta, dict):
            self.role = delta.get("role") or self.role
            if delta.get("content"):
                self.text.append(str(delta["content"]))
            for key in ("reasoning_content", "reasoning"):  # agl's engine and vLLM; newer vLLM: reasoning
                if isinstance(delta.get(key), str):
                    self.reasoning.append(delta[key])
            for call in delta.get("tool_calls") or []:
                self._add_tool_call(call)
        elif choice.get("text"):
            self.text.append(str(choice["text"]))
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        if isinstance(choice.get("token_ids"), list):
            self.token_ids = (self.token_ids or []) + choice["token_ids"]
        if isinstance(choice.get("prompt_token_ids"), list):
            self.prompt_token_ids = choice["prompt_token_ids"]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            if isinstance(logprobs.get("content"), list):
                self.logprobs = (self.logprobs or []) + logprobs["content"]
            if isinstance(logprobs.get("token_logprobs"), list):
                self.token_logprobs = (self.token_logprobs or []) + logprobs["token_logprobs"]

    def _add_tool_call(self, call: dict[str, Any]) -> None:
        index = int(call.get("index", len(self.tool_calls)))
        slot = self.tool_calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        slot["id"] = call.get("id") or slot["id"]
        fn = call.get("function") or {}
        if fn.get("name"):
            slot["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            slot["function"]["arguments"] += fn["arguments"]


def assemble(raw: Iterable[bytes], api: str) -> dict[str, Any]:
    """The non-streamed response body equivalent to a stream's chunks (first choice index wins per index)."""
    top: dict[str, Any] = {}
    choices: dict[int, _Choice] = {}
    for event in iter_sse_data(raw):
        if event.get("type") == "response.completed" and isinstance(event.get("response"), dict):
            return dict(event["response"])  # the Responses API sends the whole response at the end
        for key in ("id", "model", "created", "model_version", "system_fingerprint"):
            if event.get(key) is not None:
                top[key] = event[key]
        if isinstance(event.get("prompt_token_ids"), list):
            top["prompt_token_ids"] = event["prompt_token_ids"]
        if isinstance(event.get("usage"), dict):
            top["usage"] = event["usage"]
        if isinstance(event.get("error"), dict):
            top["error"] = event["error"]
        for choice in event.get("choices") or []:
            if isinstance(choice, dict):
                choices.setdefault(int(choice.get("index", 0)), _Choice()).add(choice)
    out_choices = []
    for index in sorted(choices):
        c = choices[index]
        item: dict[str, Any] = {"index": index, "finish_reason": c.finish_reason}
        if api == "completions":
            item["text"] = "".join(c.text)
            if c.token_logprobs is not None:
                item["logprobs"] = {"token_logprobs": c.token_logprobs}
        else:
            calls = [c.tool_calls[i] for i in sorted(c.tool_calls)]
            item["message"] = {
                "role": c.role,
                "content": "".join(c.text) or None,
                "tool_calls": calls or None,
            }
            if c.reasoning:
                item["message"]["reasoning_content"] = "".join(c.reasoning)
            if c.logprobs is not None:
                item["logprobs"] = {"content": c.logprobs}
        if c.token_ids is not None:
            item["token_ids"] = c.token_ids
        if c.prompt_token_ids is not None:
            item["prompt_token_ids"] = c.prompt_token_ids
        out_choices.append(item)
    top["object"] = "text_completion" if api == "completions" else "chat.completion"
    top["choices"] = out_choices
    return top
