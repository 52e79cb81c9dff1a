"""Replay a recorded model call: its messages and tools resent to a chosen endpoint, model or policy
version with edited sampling settings, and the reply set beside the recorded one.

The dashboard has no model of its own: the call goes server-side (no CORS in the browser) to an
OpenAI-compatible endpoint, by default the unattributed ``/v1`` of the gateway the call's resources version
names (so the replay is not recorded into the rollout). It never forwards the dashboard's token.
"""

from __future__ import annotations

import re
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from agl import errors
from agl import semconv as sc
from agl.dashboard import inputs, views
from agl.dashboard.inputs import BadGateway, BadRequest
from agl.schemas import LLM, LLMCall, ResourcesVersion, Span
from agl.store.read_model import StoreWithReadModel

#: how long a replayed call may take before the dashboard gives up on it
REPLAY_TIMEOUT_S = 120.0
#: request fields left out of a replay: one plain reply is compared, not a stream, n choices or token data
_DROPPED = frozenset({"stream", "stream_options", "n", "return_token_ids", "logprobs", "top_logprobs"})
#: an agl gateway's per-rollout scope (``/rollout/<id>/attempt/<id>[/agent/<name>]/v1``)
_SCOPED = re.compile(r"/rollout/[^/]+/attempt/[^/]+(?:/agent/[^/]+)?/v1$")


async def find_span(store: StoreWithReadModel, rollout_id: str, span_id: str, page_size: int) -> Span:
    """Span ``span_id`` of rollout ``rollout_id``, any attempt (404 when either is unknown)."""
    await store.get_rollout(rollout_id)
    cursor = None
    while True:
        page = await store.query_spans(rollout_id=rollout_id, limit=page_size, cursor=cursor)
        for found in page.items:
            if found.span_id == span_id:
                return found
        if (cursor := page.next_cursor) is None:
            raise errors.NotFoundError(f"rollout {rollout_id!r} has no span {span_id!r}")


def unscoped(endpoint: str) -> str:
    """An agl gateway endpoint without its rollout scope: calls through it are not recorded into a rollout."""
    return _SCOPED.sub("/v1", endpoint.rstrip("/"))


def _llm_of(version: ResourcesVersion | None) -> LLM | None:
    if version is None:
        return None
    return next((r for r in version.resources.values() if isinstance(r, LLM)), None)


def recorded_request(span: Span, call: LLMCall) -> dict[str, Any]:
    """The body to resend: the recorded request (messages, tools, sampling), or its messages alone."""
    if call.api != "chat.completions":
        raise BadRequest(
            "span_id", f"replay resends chat completions calls; this call used the {call.api} API"
        )
    request = span.attributes.get(sc.LLM_REQUEST)
    body = {k: v for k, v in request.items() if k not in _DROPPED} if isinstance(request, dict) else {}
    if not isinstance(body.get("messages"), list):
        if not call.request_messages:
            raise BadRequest("span_id", "this call recorded no request messages to resend")
        body["messages"] = call.request_messages
    return body


def _endpoint(given: str | None, llm: LLM | None) -> str:
    if given is None:
        if llm is None:
            raise BadRequest(
                "endpoint",
                "give an endpoint: the call's resources version has no LLM resource to take one from",
            )
        return unscoped(llm.endpoint)
    parts = urlsplit(given)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise BadRequest(
            "endpoint", f"endpoint must be an http(s) URL like http://host:8000/v1, got {given!r}"
        )
    return given.rstrip("/")


def _reply(body: dict[str, Any]) -> dict[str, Any]:
    """What the page shows of a chat completion: the message, finish reason, usage and model."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise BadGateway(f"the endpoint answered without choices: {str(body)[:300]}")
    message = choices[0].get("message")
    return {
        "message": views.message_view(message) if isinstance(message, dict) else None,
        "finish_reason": choices[0].get("finish_reason"),
        "usage": views.usage_of(body.get("usage")),
        "model": body.get("model"),
    }


async def _send(url: str, body: dict[str, Any], api_key: str | None, timeout_s: float) -> dict[str, Any]:
    """POST the chat completion; a failure is a 502 saying what the endpoint answered."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=timeout_s, follow_redirects=False, trust_env=False) as client:
            answer = await client.post(url, json=body, headers=headers)
    except httpx.TimeoutException:
        raise BadGateway(f"{url} did not answer within {timeout_s:g} s") from None
    except httpx.HTTPError as exc:
        raise BadGateway(f"could not reach {url}: {type(exc).__name__}: {exc}") from None
    if answer.status_code >= 400:
        raise BadGateway(f"{url} answered HTTP {answer.status_code}: {answer.text[:500]}")
    try:
        parsed = answer.json()
    except ValueError:
        raise BadGateway(
            f"{url} answered HTTP {answer.status_code} with no JSON: {answer.text[:300]}"
        ) from None
    if not isinstance(parsed, dict):
        raise BadGateway(f"{url} answered with JSON that is no object: {answer.text[:300]}")
    return parsed


async def replay(store: StoreWithReadModel, body: dict[str, Any], page_size: int) -> dict[str, Any]:
    """``{"rollout_id", "span_id", "endpoint"?, "resources_id"?, "model"?, "temperature"?, "max_tokens"?,
    "api_key"?}`` -> ``{"recorded": ..., "replayed": ...}``: the call resent, both replies side by side.

    The endpoint, model and key come from ``resources_id``'s LLM resource (a policy version) or else from
    the rollout's own; a recorded key goes only to the endpoint it was recorded with.
    """
    rollout_id = inputs.text(body, "rollout_id", required=True) or ""
    span_id = inputs.text(body, "span_id", required=True) or ""
    given, resources_id = inputs.text(body, "endpoint"), inputs.text(body, "resources_id")
    temperature = inputs.number(body, "temperature", 0.0, 2.0)
    max_tokens = inputs.integer(body, "max_tokens", 1, 1_000_000)
    span = await find_span(store, rollout_id, span_id, page_size)
    call = LLMCall.from_span(span)
    if call is None:
        raise BadRequest("span_id", f"span {span_id!r} ({span.name}) is no model call")
    request = recorded_request(span, call)
    if resources_id is not None:
        try:
            llm = _llm_of(await store.get_resources(resources_id))
        except errors.NotFoundError:
            raise BadRequest("resources_id", f"no resources version {resources_id!r}") from None
        if llm is None:
            raise BadRequest("resources_id", f"resources version {resources_id!r} has no LLM resource")
    else:
        rollout = await store.get_rollout(rollout_id)
        version = None
        if rollout.resources_id:
            try:
                version = await store.get_resources(rollout.resources_id)
            except errors.NotFoundError:
                version = None
        llm = _llm_of(version)
    endpoint = _endpoint(given, llm)
    key = inputs.text(body, "api_key") or (llm.api_key if llm is not None and given is None else None)
    model = inputs.text(body, "model") or (llm.model if resources_id and llm else None)
    sent = {**request, "model": model or request.get("model") or call.model or (llm.model if llm else "")}
    if temperature is not None:
        sent["temperature"] = temperature
    if max_tokens is not None:
        sent.pop("max_completion_tokens", None)
        sent["max_tokens"] = max_tokens
    started = time.perf_counter()
    answer = await _send(f"{endpoint}/chat/completions", sent, key, REPLAY_TIMEOUT_S)
    settings = {k: sent[k] for k in ("temperature", "max_tokens", "top_p") if k in sent}
    replayed = {**_reply(answer), "endpoint": endpoint, "latency_ms": (time.perf_counter() - started) * 1000}
    recorded = {
        "message": views.message_view(call.response_message) if call.response_message else None,
        "finish_reason": call.finish_reason,
        "usage": views.usage_of(call.usage),
        "model": call.model,
        "settings": {
            k: v
            for k, v in views.request_settings(span.attributes.get(sc.LLM_REQUEST)).items()
            if k not in ("tools", "tool_choice")
        },
    }
    return {
        "recorded": views.redact(recorded),
        "replayed": {**views.redact(replayed), "request": {"model": sent["model"], **settings}},
        "tools": [
            (t.get("function") or {}).get("name") for t in request.get("tools") or [] if isinstance(t, dict)
        ],
    }
