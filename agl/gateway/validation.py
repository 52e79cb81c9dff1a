"""Request checks that turn bad input into OpenAI-style 4xx error bodies naming the field."""

from __future__ import annotations

from typing import Any

import orjson

API_PATHS = {
    "chat/completions": "chat.completions",
    "completions": "completions",
    "responses": "responses",
    "embeddings": "embeddings",
}
_HEX = frozenset("0123456789abcdef")


class HTTPError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or ("invalid_request_error" if status < 500 else "server_error")
        self.code = code
        self.headers = headers or []

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None) -> HTTPError:
    return HTTPError(400, message, param=param, code="invalid_value" if param else "invalid_json")


def parse_request(api: str, raw: bytes) -> dict[str, Any]:
    """The JSON body of a model call, checked just enough that the upstream gets a well-formed request."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _bad(f"the request body is not valid JSON ({exc}); send a JSON object", None) from None
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {type(body).__name__}", None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad(f"'model' must be a non-empty string, got {model!r}", "model")
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise _bad(f"'stream' must be true or false, got {body['stream']!r}", "stream")
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise _bad(f"'n' must be a positive integer, got {n!r}", "n")
    if api == "chat.completions":
        _check_messages(body.get("messages"))
        kwargs = body.get("chat_template_kwargs")  # forwarded as is (e.g. {"enable_thinking": false})
        if kwargs is not None and not isinstance(kwargs, dict):
            raise _bad(
                f"'chat_template_kwargs' must be an object such as {{\"enable_thinking\": false}}, got {kwargs!r:.80}",
                "chat_template_kwargs",
            )
    elif api == "completions":
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
            raise _bad(f"'prompt' must be a string or a non-empty list, got {prompt!r:.80}", "prompt")
    elif api == "responses":
        given = body.get("input")
        if not (isinstance(given, str) or (isinstance(given, list) and given)):
            raise _bad(f"'input' must be a string or a non-empty list of items, got {given!r:.80}", "input")
    elif api == "embeddings":
        _check_embedding_input(body.get("input"))
    return body


def _check_embedding_input(given: Any) -> None:
    """A string, or a non-empty list of strings, of token ids, or of token-id lists (the upstream checks the rest)."""
    if isinstance(given, str):
        return
    if isinstance(given, list) and given:
        if all(isinstance(x, str) for x in given) or all(_is_int(x) for x in given):
            return
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in given):
            return
    raise _bad(
        "'input' must be a string, a non-empty list of strings, a list of token ids or a list of token-id "
        f"lists, got {given!r:.80}",
        "input",
    )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise _bad(f"'messages' must be a non-empty list of chat messages, got {messages!r:.80}", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]")
        if not isinstance(message.get("role"), str):
            raise _bad(f"messages[{i}].role must be a string such as 'user'", f"messages[{i}].role")


def traceparent(value: str | None) -> tuple[str, str] | None:
    """``(trace_id, parent_span_id)`` of a W3C ``traceparent`` header, or None if absent or malformed."""
    if not value:
        return None
    parts = value.strip().split("-")
    if len(parts) < 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    trace_id, span_id = parts[1].lower(), parts[2].lower()
    if not (set(trace_id) <= _HEX and set(span_id) <= _HEX) or trace_id == "0" * 32:
        return None
    return trace_id, span_id
