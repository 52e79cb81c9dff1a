"""The Anthropic Messages API (``POST /v1/messages``) over any OpenAI-compatible chat upstream.

The gateway turns a Messages request into a chat completions request (:func:`to_chat`), forwards it,
and turns the chat answer back into a Messages answer (:func:`from_chat`), or a chat stream into
Anthropic's SSE events (:class:`StreamTranslator`). The upstream only ever sees chat, so the call is
recorded with the engine's token ids exactly like a chat call and trains the same way. Pure functions
apart from :class:`ASGITranslator`, the thin ``send`` wrapper the gateway uses.

Not translated: server tools (web search, code execution), documents, thinking output; prompt caching
hints (``cache_control``) are ignored. A reply stopped by a stop sequence reports ``stop_sequence``
only when the upstream names it (vLLM's ``stop_reason``); otherwise ``end_turn``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from agl.gateway.validation import HTTPError

Send = Callable[[dict[str, Any]], Awaitable[None]]

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
_STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}
_SKIPPED_BLOCKS = frozenset({"thinking", "redacted_thinking"})  # another model's reasoning: not prompt text


# ----- errors ------------------------------------------------------------------------------------
def error_type(status: int) -> str:
    """Anthropic's error ``type`` for an HTTP status."""
    return _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}``, the shape the anthropic SDK parses."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def _bad(message: str) -> HTTPError:
    """A 400; Anthropic errors have no ``param``, so ``message`` starts with the field's dotted path."""
    return HTTPError(400, message, code="invalid_request_error")


# ----- requests ----------------------------------------------------------------------------------
def parse(raw: bytes) -> dict[str, Any]:
    """The JSON object of a Messages request body (400 otherwise)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"the request body is not valid JSON ({exc}); send a JSON object") from None
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _int(body: dict[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _bad(f"{key}: must be an integer >= {low}, got {value!r:.40}")
    return value


def _number(body: dict[str, Any], key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise _bad(f"{key}: must be a number in [{low}, {high}], got {value!r:.40}")
    return float(value)


def _text_of(content: Any, where: str) -> str:
    """A string, or the text of a list of text blocks (tool results, system prompts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of text blocks, got {content!r:.80}")
    parts = []
    for j, block in enumerate(content):
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise _bad(
                f"{where}.{j}: must be a text block {{'type': 'text', 'text': ...}}, got {block!r:.80}"
            )
        parts.append(block["text"])
    return "".join(parts)


def _image_part(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if isinstance(source, dict) and source.get("type") == "base64":
        url = f"data:{source.get('media_type')};base64,{source.get('data')}"
    elif isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _bad(f"{where}.source: must be a base64 or url image source, got {source!r:.80}")
    return {"type": "image_url", "image_url": {"url": url}}


def _user(content: list[Any], where: str) -> list[dict[str, Any]]:
    """Chat messages of one user turn: its tool results first (as ``tool`` messages), then its text."""
    tools: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block, at))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad(f"{at}.tool_use_id: must be the id of the tool_use block it answers")
            given = block.get("content") or ""
            text = _text_of(given, f"{at}.content")
            tools.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind in _SKIPPED_BLOCKS:
            continue
        else:
            raise _bad(
                f"{at}.type: {kind!r:.40} is not supported in a user message; use text, image or tool_result"
            )
    if not parts:
        return tools
    if len(parts) == 1 and parts[0]["type"] == "text":
        return [*tools, {"role": "user", "content": parts[0]["text"]}]
    return [*tools, {"role": "user", "content": parts}]


def _assistant(content: list[Any], where: str) -> dict[str, Any]:
    """One assistant turn: its text, and its tool_use blocks as chat ``tool_calls``."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(content):
        at = f"{where}.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            for key in ("id", "name"):
                if not isinstance(block.get(key), str) or not block[key]:
                    raise _bad(f"{at}.{key}: must be a non-empty string")
            if not isinstance(block.get("input"), dict):
                raise _bad(f"{at}.input: must be an object, got {block.get('input')!r:.80}")
            arguments = json.dumps(block["input"], ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind in _SKIPPED_BLOCKS:
            continue
        else:
            raise _bad(
                f"{at}.type: {kind!r:.40} is not supported in an assistant message; use text or tool_use"
            )
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(given: Any) -> list[dict[str, Any]]:
    if not isinstance(given, list) or not given:
        raise _bad(f"messages: must be a non-empty list of messages, got {given!r:.80}")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(given):
        where = f"messages.{i}"
        if not isinstance(message, dict):
            raise _bad(f"{where}: must be an object with role and content, got {message!r:.80}")
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise _bad(
                f"{where}.role: must be 'user' or 'assistant' (system goes in 'system'), got {role!r:.40}"
            )
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise _bad(f"{where}.content: must be a string or a list of content blocks, got {content!r:.80}")
        if role == "user":
            out += _user(content, f"{where}.content")
        else:
            out.append(_assistant(content, f"{where}.content"))
    return out


def _tools(given: Any) -> list[dict[str, Any]] | None:
    if given is None:
        return None
    if not isinstance(given, list):
        raise _bad(f"tools: must be a list of tools, got {given!r:.80}")
    out = []
    for i, tool in enumerate(given):
        if not isinstance(tool, dict):
            raise _bad(f"tools.{i}: must be an object, got {tool!r:.80}")
        if tool.get("type") not in (None, "custom"):
            raise _bad(
                f"tools.{i}.type: server tool {tool.get('type')!r:.60} is not available through this gateway; "
                "define a client tool with name and input_schema"
            )
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _bad(f"tools.{i}.name: must be a non-empty string")
        if not isinstance(tool.get("input_schema"), dict):
            raise _bad(f"tools.{i}.input_schema: must be a JSON schema object")
        fn: dict[str, Any] = {"name": tool["name"]}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        fn["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(given: Any, chat: dict[str, Any]) -> None:
    if given is None:
        return
    kind = given.get("type") if isinstance(given, dict) else None
    if kind == "auto":
        chat["tool_choice"] = "auto"
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "none":
        chat["tool_choice"] = "none"
    elif kind == "tool" and isinstance(given.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": given["name"]}}
    else:
        raise _bad(
            "tool_choice: must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}, "
            f"got {given!r:.80}"
        )
    if isinstance(given, dict) and given.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request equivalent to a Messages request; a bad field raises a 400 naming it."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad(f"model: must be a non-empty string, got {model!r:.40}")
    max_tokens = _int(body, "max_tokens", 1)
    if max_tokens is None:
        raise _bad("max_tokens: field required (the most tokens to generate, e.g. 1024)")
    messages = _messages(body.get("messages"))
    system = body.get("system")
    if system is not None:
        messages.insert(0, {"role": "system", "content": _text_of(system, "system")})
    chat: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    for key, high in (("temperature", 2.0), ("top_p", 1.0)):
        value = _number(body, key, 0.0, high)
        if value is not None:
            chat[key] = value
    top_k = _int(body, "top_k", 0)
    if top_k is not None:
        chat["top_k"] = top_k  # vLLM and the built-in engine's extra fields; OpenAI proper has none
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad(f"stop_sequences: must be a list of non-empty strings, got {stops!r:.80}")
        if stops:
            chat["stop"] = stops
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), chat)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _bad(f"stream: must be true or false, got {stream!r:.40}")
    if stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}  # message_delta reports output_tokens
    return chat


# ----- responses ---------------------------------------------------------------------------------
def _input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's ``input`` must be; unparsable text is kept, not lost."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except (TypeError, json.JSONDecodeError):
        value = None
    return value if isinstance(value, dict) else {"_raw_arguments": arguments}


def stop_reason(choice: dict[str, Any], stops: list[str]) -> tuple[str | None, str | None]:
    """``(stop_reason, stop_sequence)`` of a chat choice."""
    finish = choice.get("finish_reason")
    matched = choice.get("stop_reason")  # vLLM names the stop string that ended the text
    if finish == "stop" and isinstance(matched, str) and matched in stops:
        return "stop_sequence", matched
    if finish is None:
        return None, None
    return _STOP_REASONS.get(str(finish), "end_turn"), None


def usage(chat_usage: Any) -> dict[str, int]:
    u = _dict(chat_usage)
    return {
        "input_tokens": _count(u.get("prompt_tokens")),
        "output_tokens": _count(u.get("completion_tokens")),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def from_chat(chat: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    """The Messages ``message`` of a chat completion. Its id is the chat id, the one the call is recorded under
    (so ``agl.emit_reward(..., response_id=message.id)`` finds it)."""
    choices = chat.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    message = _dict(choice.get("message"))
    content: list[dict[str, Any]] = []
    if message.get("content"):
        content.append({"type": "text", "text": str(message["content"])})
    for call in message.get("tool_calls") or []:
        if not isinstance(call, dict):
            continue  # an upstream's malformed entry: skipped rather than failing the whole answer
        fn = _dict(call.get("function"))
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id"),
                "name": fn.get("name"),
                "input": _input(fn.get("arguments")),
            }
        )
    reason, sequence = stop_reason(choice, list(request.get("stop_sequences") or []))
    return {
        "id": str(chat.get("id") or ""),
        "type": "message",
        "role": "assistant",
        "model": request.get("model") or chat.get("model"),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(chat.get("usage")),
    }


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _event(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def message_events(message: dict[str, Any]) -> bytes:
    """The whole SSE stream of a finished message (for an upstream that answered a stream without streaming)."""
    head = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    head["usage"] = {**message["usage"], "output_tokens": 0}
    out = [_event("message_start", message=head)]
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            out.append(_event("content_block_start", index=index, content_block={"type": "text", "text": ""}))
            out.append(
                _event(
                    "content_block_delta", index=index, delta={"type": "text_delta", "text": block["text"]}
                )
            )
        else:
            out.append(_event("content_block_start", index=index, content_block={**block, "input": {}}))
            partial = json.dumps(block["input"], ensure_ascii=False)
            out.append(
                _event(
                    "content_block_delta",
                    index=index,
                    delta={"type": "input_json_delta", "partial_json": partial},
                )
            )
        out.append(_event("content_block_stop", index=index))
    delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    out.append(_event("message_delta", delta=delta, usage=message["usage"]))
    out.append(_event("message_stop"))
    return b"".join(out)


class StreamTranslator:
    """Chat completion SSE chunks in, Anthropic Messages SSE events out; ``feed`` takes bytes cut anywhere."""

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self._buffer = b""
        self._started = False
        self._block: tuple[str, int] | None = None  # ("text", -1) or ("tool", call index) of the open block
        self._index = -1
        self._finish: dict[str, Any] = {}
        self._usage: Any = None
        self._id = ""
        self._input_tokens = 0
        self.done = False

    def feed(self, data: bytes) -> bytes:
        """Events for the complete SSE lines in ``data`` (plus what earlier calls left unfinished)."""
        lines = (self._buffer + data).split(b"\n")
        self._buffer = lines.pop()
        out = []
        for line in lines:
            line = line.rstrip(b"\r")
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                out.append(self.close())
                continue
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError:
                continue  # a broken chunk is the upstream's problem; the recorder keeps the raw bytes
            if isinstance(chunk, dict):
                out.append(self._chunk(chunk))
        return b"".join(out)

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self._started = True
        self._id = str(chunk.get("id") or "")
        prompt_ids = chunk.get("prompt_token_ids")
        self._input_tokens = len(prompt_ids) if isinstance(prompt_ids, list) else 0
        message: dict[str, Any] = {
            "id": self._id,
            "type": "message",
            "role": "assistant",
            "model": self.request.get("model") or chunk.get("model"),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self._input_tokens, "output_tokens": 0},
        }
        return _event("message_start", message=message)

    def _open(self, key: tuple[str, int], block: dict[str, Any]) -> bytes:
        closing = self._close_block()
        self._index += 1
        self._block = key
        return closing + _event("content_block_start", index=self._index, content_block=block)

    def _close_block(self) -> bytes:
        if self._block is None:
            return b""
        self._block = None
        return _event("content_block_stop", index=self._index)

    def _chunk(self, chunk: dict[str, Any]) -> bytes:
        if self.done:
            return b""
        out = []
        if isinstance(chunk.get("error"), dict):
            message = str(chunk["error"].get("message") or chunk["error"])
            self.done = True
            return _event("error", error={"type": "api_error", "message": message})
        if not self._started:
            out.append(self._start(chunk))
        if isinstance(chunk.get("usage"), dict):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = _dict(choice.get("delta"))
            if delta.get("content"):
                if self._block != ("text", -1):
                    out.append(self._open(("text", -1), {"type": "text", "text": ""}))
                out.append(
                    _event(
                        "content_block_delta",
                        index=self._index,
                        delta={"type": "text_delta", "text": delta["content"]},
                    )
                )
            for call in delta.get("tool_calls") or []:
                if not isinstance(call, dict):
                    continue
                out.append(self._tool_delta(call))
            if choice.get("finish_reason"):
                self._finish = choice
        return b"".join(out)

    def _tool_delta(self, call: dict[str, Any]) -> bytes:
        index = call.get("index", 0)
        key = ("tool", index if isinstance(index, int) else 0)
        fn = _dict(call.get("function"))
        out = b""
        if self._block != key:
            block: dict[str, Any] = {
                "type": "tool_use",
                "id": call.get("id") or "",
                "name": fn.get("name") or "",
                "input": {},
            }
            out = self._open(key, block)
        if fn.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
            out += _event("content_block_delta", index=self._index, delta=delta)
        return out

    def close(self, error: str | None = None) -> bytes:
        """The closing events (once): the last block's stop, ``message_delta`` and ``message_stop``,
        or an ``error`` event when the upstream stream broke."""
        if self.done:
            return b""
        self.done = True
        if error is not None:
            return _event("error", error={"type": "api_error", "message": error})
        out = b"" if self._started else self._start({})
        out += self._close_block()
        reason, sequence = stop_reason(self._finish, list(self.request.get("stop_sequences") or []))
        final = usage(self._usage)
        if self._usage is None:
            final["input_tokens"] = self._input_tokens
        delta = {"stop_reason": reason or "end_turn", "stop_sequence": sequence}
        return out + _event("message_delta", delta=delta, usage=final) + _event("message_stop")


class ASGITranslator:
    """Wraps the gateway's ASGI ``send`` for one Messages call: what the upstream answers in chat form goes
    to the agent in Anthropic form (a JSON message, an event stream, or an Anthropic error body)."""

    def __init__(self, send: Send, request: dict[str, Any], broken: Callable[[], str | None]) -> None:
        self.send = send
        self.request = request
        self.broken = broken  # the forwarder's note that the upstream stream broke, read at the end
        self._status = 200
        self._stream: StreamTranslator | None = None

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self._status = int(message["status"])
            headers = dict(message.get("headers") or [])
            if self._status < 400 and headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                self._stream = StreamTranslator(self.request)
                await self.send(message)
            return  # a JSON answer's head is sent with its translated body
        body = message.get("body", b"")
        if self._stream is not None:
            out = self._stream.feed(body)
            if not message.get("more_body"):
                out += self._stream.close(self.broken())
            await self.send(
                {"type": "http.response.body", "body": out, "more_body": bool(message.get("more_body"))}
            )
            return
        content = self._translate(body)
        ctype = (
            b"text/event-stream" if self.request.get("stream") and self._status < 400 else b"application/json"
        )
        head = [(b"content-type", ctype), (b"content-length", str(len(content)).encode())]
        await self.send({"type": "http.response.start", "status": self._status, "headers": head})
        await self.send({"type": "http.response.body", "body": content})

    def _translate(self, body: bytes) -> bytes:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            value = None
        if self._status >= 400 or not isinstance(value, dict):
            err = value.get("error") if isinstance(value, dict) else None
            text = err.get("message") if isinstance(err, dict) else err
            text = text or body[:500].decode(errors="replace") or f"upstream status {self._status}"
            if self._status < 400:
                self._status = 502  # a 2xx the gateway cannot read is the upstream's failure
            return orjson.dumps(error_body(self._status, str(text)))
        message = from_chat(value, self.request)
        return message_events(message) if self.request.get("stream") else orjson.dumps(message)
