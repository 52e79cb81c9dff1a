"""Map what auto-instrumentation records (OpenInference attributes) onto agl's canonical LLM call keys.

Adapters read one view (``agl.schemas.LLMCall``); this is the one place that knows the foreign
attribute styles. Token ids are copied only when the response itself carried them (vLLM-style
``prompt_token_ids`` and choice ``token_ids``); nothing is re-tokenized.
"""

from __future__ import annotations

import json
import re
from typing import Any

from agl import semconv as sc

_MSG = re.compile(r"^llm\.(input|output)_messages\.(\d+)\.message\.(.+)$")
_TOOL = re.compile(r"^tool_calls\.(\d+)\.tool_call\.(.+)$")


def _messages(attrs: dict[str, Any], direction: str) -> list[dict[str, Any]]:
    by_index: dict[int, dict[str, Any]] = {}
    for key, value in attrs.items():
        m = _MSG.match(key)
        if not m or m.group(1) != direction:
            continue
        msg = by_index.setdefault(int(m.group(2)), {})
        field = m.group(3)
        tool = _TOOL.match(field)
        if tool:
            calls = msg.setdefault("_tool_calls", {})
            call = calls.setdefault(int(tool.group(1)), {"type": "function", "function": {}})
            part = tool.group(2)
            if part == "id":
                call["id"] = value
            elif part.startswith("function."):
                call["function"][part.removeprefix("function.")] = value
        elif field in ("role", "content", "name", "tool_call_id"):
            msg[field] = value
        elif field.startswith("contents.") and field.endswith("message_content.text"):
            msg["content"] = (msg.get("content") or "") + str(value)
    out = []
    for index in sorted(by_index):
        msg = by_index[index]
        calls = msg.pop("_tool_calls", None)
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        out.append(msg)
    return out


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def normalize_openinference(attrs: dict[str, Any]) -> dict[str, Any]:
    """Canonical ``agl.llm.*`` attributes for an OpenInference LLM span (empty if it is not one)."""
    if attrs.get("openinference.span.kind") != "LLM":
        return {}
    out: dict[str, Any] = {sc.LLM_SOURCE: "openinference", sc.LLM_API: "chat.completions"}
    request = _json(attrs.get("input.value"))
    response = _json(attrs.get("output.value"))
    if isinstance(request, dict):
        out[sc.LLM_REQUEST] = request
        if "prompt" in request and "messages" not in request:
            out[sc.LLM_API] = "completions"
            out[sc.LLM_PROMPT] = request["prompt"]
        elif "input" in request and "messages" not in request:
            out[sc.LLM_API] = "responses"
    inputs = _messages(attrs, "input")
    if inputs:
        out[sc.LLM_REQUEST_MESSAGES] = inputs
    elif isinstance(request, dict) and isinstance(request.get("messages"), list):
        out[sc.LLM_REQUEST_MESSAGES] = request["messages"]
    outputs = _messages(attrs, "output")
    if outputs:
        out[sc.LLM_RESPONSE_MESSAGE] = outputs[0]
        out[sc.LLM_TOOL_CALLS] = outputs[0].get("tool_calls", [])
    if "llm.model_name" in attrs:
        out[sc.LLM_MODEL] = attrs["llm.model_name"]
    usage = {
        name: attrs[f"llm.token_count.{key}"]
        for name, key in (
            ("prompt_tokens", "prompt"),
            ("completion_tokens", "completion"),
            ("total_tokens", "total"),
        )
        if f"llm.token_count.{key}" in attrs
    }
    if usage:
        out[sc.LLM_USAGE] = usage
    if isinstance(response, dict):
        out[sc.LLM_RESPONSE] = response
        out.update(_from_response(response))
    out[sc.LLM_HAS_TOKEN_IDS] = sc.LLM_PROMPT_TOKEN_IDS in out and sc.LLM_COMPLETION_TOKEN_IDS in out
    return out


def _langchain_response_id(result: dict[str, Any]) -> str | None:
    """The provider's response id in a LangChain ``LLMResult`` (``llm_output.id``, or the first
    generation's ``response_metadata.id``); a streamed one often has none."""
    output = result.get("llm_output")
    if isinstance(output, dict) and isinstance(output.get("id"), str):
        return str(output["id"])
    generations = result.get("generations")
    first = generations[0] if isinstance(generations, list) and generations else None
    generation = first[0] if isinstance(first, list) and first and isinstance(first[0], dict) else {}
    message = generation.get("message")
    kwargs = message.get("kwargs") if isinstance(message, dict) else None
    metadata = kwargs.get("response_metadata") if isinstance(kwargs, dict) else None
    found = metadata.get("id") if isinstance(metadata, dict) else None
    return found if isinstance(found, str) else None


def _from_response(response: dict[str, Any]) -> dict[str, Any]:
    """Response id, finish reason, message text and engine token ids out of a chat/completions body
    (or, for the id alone, out of LangChain's ``LLMResult``, which wraps the body it was parsed from)."""
    out: dict[str, Any] = {}
    if "id" in response:
        out[sc.LLM_RESPONSE_ID] = response["id"]
    elif "generations" in response and (lc_id := _langchain_response_id(response)) is not None:
        out[sc.LLM_RESPONSE_ID] = lc_id
    choices = response.get("choices") or []
    choice = choices[0] if choices and isinstance(choices[0], dict) else {}
    if choice.get("finish_reason"):
        out[sc.LLM_FINISH_REASON] = choice["finish_reason"]
    message = choice.get("message")
    if isinstance(message, dict):
        out[sc.LLM_RESPONSE_MESSAGE] = {
            k: message.get(k) for k in ("role", "content", "tool_calls") if k in message
        }
        out[sc.LLM_TOOL_CALLS] = message.get("tool_calls") or []
    elif "text" in choice:
        out[sc.LLM_RESPONSE_MESSAGE] = {"role": "assistant", "content": choice["text"]}
    if isinstance(response.get("prompt_token_ids"), list):
        out[sc.LLM_PROMPT_TOKEN_IDS] = response["prompt_token_ids"]
    if isinstance(choice.get("token_ids"), list):
        out[sc.LLM_COMPLETION_TOKEN_IDS] = choice["token_ids"]
    content = (
        (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    )
    if isinstance(content, list) and content:
        out[sc.LLM_LOGPROBS] = [float(t.get("logprob", 0.0)) for t in content]
    if response.get("model_version") is not None:
        out[sc.LLM_MODEL_VERSION] = str(response["model_version"])
    return out
