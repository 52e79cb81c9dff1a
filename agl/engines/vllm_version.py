"""An ASGI middleware that vLLM loads (``--middleware``) to stamp each response with its ``model_version``.

The built-in engine returns ``model_version`` in every completion body and stream chunk, and the gateway
records it on the call's span; vLLM has no such field, so this middleware adds it. The version is read
when a request arrives and set with ``POST /agl/model_version`` (or env ``AGL_MODEL_VERSION`` at start).
That call may also set model aliases: vLLM refuses a LoRA adapter named like the base model, so the
trained adapter is loaded as ``policy@v3`` and requests for ``policy`` are rewritten to it.
It runs inside vLLM's own venv, so it imports nothing but the standard library; the launcher copies this
file to a folder on the server's PYTHONPATH under :data:`MODULE_NAME`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

MODULE_NAME = "agl_vllm_version"  # the name vLLM imports this file under (--middleware <name>.<class>)
ENV_VERSION = "AGL_MODEL_VERSION"
ADMIN_PATH = "/agl/model_version"
STAMPED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class ModelVersionMiddleware:
    """Adds ``"model_version"`` to JSON bodies and SSE ``data:`` chunks of the completion routes."""

    version: str = os.environ.get(ENV_VERSION, "v0")  # one per server process
    aliases: dict[str, str] = {}  # requested model name -> the name vLLM serves it under

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == ADMIN_PATH:
            await self._admin(scope, receive, send)
        elif path in STAMPED_PATHS:
            cls = type(self)
            if cls.aliases and scope.get("method") == "POST":
                scope, receive = await _rewrite_model(scope, receive, cls.aliases)
            await self.app(scope, receive, _Stamper(send, cls.version).send)
        else:
            await self.app(scope, receive, send)

    async def _admin(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        cls = type(self)
        if scope["method"] == "POST":
            try:
                value = json.loads(await _read_body(receive) or b"null")
            except ValueError:
                value = None
            value = value if isinstance(value, dict) else {}
            version, aliases = value.get("model_version"), value.get("model_aliases", cls.aliases)
            if not isinstance(version, str) or not version:
                await _bad_request(send, 'send {"model_version": "<non-empty string>"}', "model_version")
                return
            if not isinstance(aliases, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in aliases.items()
            ):
                await _bad_request(send, "model_aliases must map model names to model names", "model_aliases")
                return
            cls.version, cls.aliases = version, dict(aliases)
        elif scope["method"] != "GET":
            await _json(send, 405, {"error": {"message": f"{ADMIN_PATH} takes GET or POST"}})
            return
        await _json(send, 200, {"model_version": cls.version, "model_aliases": cls.aliases})


async def _read_body(receive: Receive) -> bytes:
    body = b""
    while True:
        message = await receive()
        body += bytes(message.get("body", b""))
        if not message.get("more_body"):
            return body


async def _rewrite_model(
    scope: MutableMapping[str, Any], receive: Receive, aliases: dict[str, str]
) -> tuple[MutableMapping[str, Any], Receive]:
    """The request with ``"model"`` replaced by its alias (and a matching content-length), if it has one."""
    body = await _read_body(receive)
    try:
        value = json.loads(body)
    except ValueError:
        value = None
    if isinstance(value, dict) and isinstance(value.get("model"), str) and value["model"] in aliases:
        value["model"] = aliases[value["model"]]
        body = json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()  # later messages: the client disconnecting
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return scope, replay


class _Stamper:
    """Wraps one response's ``send``: rewrites a JSON body whole, an SSE stream event by event."""

    def __init__(self, send: Send, version: str) -> None:
        self._send = send
        self._version = version
        self._mode = "pass"
        self._start: Message | None = None
        self._buffer = b""

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            ctype = dict(message.get("headers") or []).get(b"content-type", b"")
            if ctype.startswith(b"application/json"):
                self._mode, self._start = "json", message  # held until the body is complete
                return
            self._mode = "sse" if ctype.startswith(b"text/event-stream") else "pass"
            await self._send(message)
        elif message["type"] != "http.response.body" or self._mode == "pass":
            await self._send(message)
        elif self._mode == "json":
            self._buffer += message.get("body", b"")
            if not message.get("more_body"):
                await self._send_json_body()
        else:
            self._buffer += message.get("body", b"")
            more = bool(message.get("more_body"))
            done, sep, rest = self._buffer.rpartition(b"\n\n")
            out, self._buffer = (self._stamp_events(done + sep), rest) if sep else (b"", self._buffer)
            if not more:
                out, self._buffer = out + self._buffer, b""
            if out or not more:
                await self._send({"type": "http.response.body", "body": out, "more_body": more})

    async def _send_json_body(self) -> None:
        assert self._start is not None
        body, self._buffer = self._buffer, b""
        stamped = self._stamp(body)
        headers = [(k, v) for k, v in self._start.get("headers") or [] if k != b"content-length"]
        headers.append((b"content-length", str(len(stamped)).encode()))
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": stamped, "more_body": False})

    def _stamp(self, payload: bytes) -> bytes:
        """``payload`` with ``model_version`` added when it is a JSON object, else unchanged."""
        try:
            value = json.loads(payload)
        except ValueError:
            return payload
        if not isinstance(value, dict):
            return payload
        value["model_version"] = self._version
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()

    def _stamp_events(self, events: bytes) -> bytes:
        lines = events.split(b"\n")
        for i, line in enumerate(lines):
            if line.startswith(b"data:") and line[5:].lstrip().startswith(b"{"):
                lines[i] = b"data: " + self._stamp(line[5:].lstrip())
        return b"\n".join(lines)


async def _bad_request(send: Send, message: str, param: str) -> None:
    await _json(send, 400, {"error": {"message": message, "param": param, "type": "invalid_request_error"}})


async def _json(send: Send, status: int, value: Any) -> None:
    body = json.dumps(value).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
