"""Turn a proxied call into one ``agl.llm.call`` span.

The request path only captures raw data (:class:`CallRecord`); parsing, secret scrubbing and
:func:`build_span` run later on the gateway's :class:`agl.tracer.writer.SpanWriter` task, which batches
the spans into the store and rides out store outages. A full queue drops the span (counted) rather
than slow or fail the agent's call.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from secrets import token_hex
from typing import Any

import orjson

from agl import semconv as sc
from agl.gateway.streaming import assemble
from agl.schemas.span import Span, SpanKind, SpanStatus, StatusCode

logger = logging.getLogger(__name__)

_SECRET_KEYS = frozenset(
    {"api_key", "apikey", "api-key", "authorization", "password", "secret", "access_token"}
)
_TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "logprobs")


@dataclass
class CallRecord:
    """What the request path keeps about one call; cheap to build, parsed later."""

    rollout_id: str
    attempt_id: str
    resources_id: str | None
    api: str
    request: dict[str, Any]
    start_ns: int
    end_ns: int = 0
    status_code: int = 0
    backend: str | None = None
    response: bytes | None = None
    chunks: list[bytes] | None = None
    error: str | None = None
    secrets: tuple[str, ...] = ()
    trace_id: str | None = None
    parent_id: str | None = None
    tags: dict[str, Any] = field(default_factory=dict)


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: ("[redacted]" if k.lower() in _SECRET_KEYS else _scrub(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def _redact_strings(value: Any, secrets: tuple[str, ...]) -> Any:
    """Replace any occurrence of a known secret (API keys) in string values.

    Keys shorter than 8 characters (placeholders such as ``"x"``) are not real secrets and would
    corrupt unrelated text, so they are left alone.
    """
    secrets = tuple(s for s in secrets if len(s) >= 8)
    if not secrets:
        return value
    text = orjson.dumps(value).decode()
    hits = [s for s in secrets if s in text]
    if not hits:
        return value
    for secret in hits:
        text = text.replace(orjson.dumps(secret).decode()[1:-1], "[redacted]")
    return orjson.loads(text)


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def _tokens(api: str, body: dict[str, Any], choice: dict[str, Any]) -> dict[str, Any]:
    """Token ids and logprobs exactly as the engine returned them; never recomputed."""
    prompt_ids = _int_list(body.get("prompt_token_ids")) or _int_list(choice.get("prompt_token_ids"))
    completion_ids = _int_list(choice.get("token_ids"))
    logprobs: list[float] | None = None
    lp = choice.get("logprobs")
    if isinstance(lp, dict):
        if api == "completions" and isinstance(lp.get("token_logprobs"), list):
            logprobs = [float(x) for x in lp["token_logprobs"] if isinstance(x, int | float)]
        elif isinstance(lp.get("content"), list):
            logprobs = [float(x["logprob"]) for x in lp["content"] if isinstance(x, dict) and "logprob" in x]
    out: dict[str, Any] = {sc.LLM_HAS_TOKEN_IDS: prompt_ids is not None and completion_ids is not None}
    if prompt_ids is not None:
        out[sc.LLM_PROMPT_TOKEN_IDS] = prompt_ids
    if completion_ids is not None:
        out[sc.LLM_COMPLETION_TOKEN_IDS] = completion_ids
    if logprobs is not None:
        out[sc.LLM_LOGPROBS] = logprobs
    return out


def _request_view(api: str, request: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if api == "chat.completions" and isinstance(request.get("messages"), list):
        out[sc.LLM_REQUEST_MESSAGES] = request["messages"]
    elif api == "completions" and "prompt" in request:
        out[sc.LLM_PROMPT] = request["prompt"]
    elif api == "responses":
        given = request.get("input")
        messages = [{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])
        if request.get("instructions"):
            messages.insert(0, {"role": "system", "content": request["instructions"]})
        out[sc.LLM_REQUEST_MESSAGES] = messages
    return out


def _embeddings_view(body: dict[str, Any]) -> dict[str, Any]:
    """What an embeddings call leaves on its span: usage and shape, not the vectors (nothing trains on them)."""
    data: list[Any] = body["data"] if isinstance(body.get("data"), list) else []
    lean = {k: v for k, v in body.items() if k != "data"}
    lean["count"] = len(data)
    first = data[0].get("embedding") if data and isinstance(data[0], dict) else None
    if isinstance(first, list):
        lean["dimensions"] = len(first)
    elif isinstance(first, str):  # base64 float32
        lean["dimensions"] = len(first) * 3 // 4 // 4
    out: dict[str, Any] = {sc.LLM_RESPONSE: lean, sc.LLM_USAGE: body.get("usage") or {}}
    if body.get("model"):
        out[sc.LLM_MODEL] = body["model"]
    if body.get("model_version") is not None:
        out[sc.LLM_MODEL_VERSION] = str(body["model_version"])
    return out


def _reasoning(message: dict[str, Any]) -> str | None:
    """A chat message's thinking: ``reasoning_content`` (agl's engine, vLLM) or ``reasoning`` (newer vLLM)."""
    for key in ("reasoning_content", "reasoning"):
        if isinstance(message.get(key), str) and message[key]:
            return str(message[key])
    return None


def _response_view(api: str, body: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if api == "embeddings":
        return _embeddings_view(body)
    choices = body.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    if api == "responses":
        texts, calls, thinking = [], [], []
        for item in body.get("output") or []:
            if not isinstance(item, dict):
                continue
            if item.get("type") == "message":
                texts += [p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict)]
            elif item.get("type") == "reasoning":  # agl's engine and vLLM: the thinking as reasoning_text
                thinking += [p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict)]
            elif item.get("type") == "function_call":
                calls.append(
                    {
                        "id": item.get("call_id"),
                        "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                    }
                )
        out[sc.LLM_RESPONSE_MESSAGE] = {
            "role": "assistant",
            "content": "".join(texts) or None,
            "tool_calls": calls,
        }
        if thinking:
            out[sc.LLM_RESPONSE_MESSAGE]["reasoning_content"] = out[sc.LLM_REASONING] = "".join(thinking)
        out[sc.LLM_TOOL_CALLS] = calls
        out[sc.LLM_FINISH_REASON] = body.get("status")
    elif api == "completions":
        out[sc.LLM_RESPONSE_MESSAGE] = {"role": "assistant", "content": choice.get("text"), "tool_calls": []}
        out[sc.LLM_FINISH_REASON] = choice.get("finish_reason")
    else:
        message = dict(choice.get("message") or {})
        message["tool_calls"] = list(message.get("tool_calls") or [])
        out[sc.LLM_RESPONSE_MESSAGE] = {k: message.get(k) for k in ("role", "content", "tool_calls")}
        reasoning = _reasoning(message)
        if reasoning is not None:  # kept on the message too, so a replayed turn carries its thinking
            out[sc.LLM_RESPONSE_MESSAGE]["reasoning_content"] = out[sc.LLM_REASONING] = reasoning
        out[sc.LLM_TOOL_CALLS] = message["tool_calls"]
        out[sc.LLM_FINISH_REASON] = choice.get("finish_reason")
    out.update(_tokens(api, body, body if api == "responses" else choice))  # Responses: ids at the top
    lean = {k: v for k, v in body.items() if k not in _TOKEN_FIELDS}  # token data lives in its own keys
    if isinstance(choices, list):
        lean["choices"] = [
            {k: v for k, v in c.items() if k not in _TOKEN_FIELDS} if isinstance(c, dict) else c
            for c in choices
        ]
    out[sc.LLM_RESPONSE] = lean
    out[sc.LLM_RESPONSE_ID] = body.get("id")
    out[sc.LLM_USAGE] = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    if body.get("model_version") is not None:
        out[sc.LLM_MODEL_VERSION] = str(body["model_version"])
    if body.get("model"):
        out[sc.LLM_MODEL] = body["model"]
    return out


def build_span(record: CallRecord) -> Span:
    """The ``agl.llm.call`` span of a finished call."""
    request = _scrub(record.request)
    attrs: dict[str, Any] = {
        sc.LLM_SOURCE: "gateway",
        sc.LLM_API: record.api,
        sc.LLM_REQUEST: request,
        sc.LLM_MODEL: request.get("model"),
        sc.LLM_BACKEND: record.backend,
        sc.LLM_STREAM: record.chunks is not None,
        sc.LLM_STATUS_CODE: record.status_code,
        sc.LLM_LATENCY_MS: round((record.end_ns - record.start_ns) / 1e6, 3),
        sc.LLM_HAS_TOKEN_IDS: False,
        sc.LLM_TOOL_CALLS: [],
        **_request_view(record.api, request),
    }
    if record.resources_id is not None:
        attrs[sc.RESOURCES_ID] = record.resources_id
    attrs.update(record.tags)
    body: Any = None
    if record.chunks is not None and record.status_code < 400:
        body = assemble(record.chunks, record.api)
    elif record.response:
        try:
            body = orjson.loads(record.response)
        except orjson.JSONDecodeError:
            body = None
    if isinstance(body, dict):
        if record.status_code < 400 and body.get("error") is None:  # Responses bodies carry "error": null
            # a Messages call went upstream as chat: its recorded answer (and token ids) is the chat one
            view = "chat.completions" if record.api == "anthropic.messages" else record.api
            attrs.update(_response_view(view, body))
        else:
            attrs[sc.LLM_RESPONSE] = body
            err = body.get("error")
            attrs[sc.LLM_ERROR] = str(err.get("message") if isinstance(err, dict) else err)
    if record.error is not None:
        attrs[sc.LLM_ERROR] = record.error
    attrs = _redact_strings(attrs, record.secrets)
    failed = record.status_code >= 400 or sc.LLM_ERROR in attrs
    status = (
        SpanStatus(code=StatusCode.ERROR, description=attrs.get(sc.LLM_ERROR))
        if failed
        else SpanStatus(code=StatusCode.OK)
    )
    trace_id = record.trace_id or hashlib.md5(f"{record.rollout_id}/{record.attempt_id}".encode()).hexdigest()
    # every field is made here (ids fresh, times ordered, JSON from orjson): skip re-validation on this path
    return Span.model_construct(
        rollout_id=record.rollout_id,
        attempt_id=record.attempt_id,
        trace_id=trace_id,
        span_id=token_hex(8),
        parent_id=record.parent_id,
        name=sc.SPAN_EMBEDDINGS if record.api == "embeddings" else sc.SPAN_LLM_CALL,
        kind=SpanKind.CLIENT,
        start_time_ns=record.start_ns,
        end_time_ns=max(record.end_ns, record.start_ns),
        attributes=attrs,
        events=[],
        links=[],
        status=status,
        resource={},
        sequence_id=None,
    )


def now_ns() -> int:
    return time.time_ns()
