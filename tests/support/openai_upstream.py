"""A deterministic, scripted OpenAI-compatible HTTP server on loopback: the upstream for gateway and client tests.

``with OpenAIUpstream() as up:`` serves ``up.base_url`` (``http://127.0.0.1:PORT/v1``) from a background
thread. By default it echoes: the reply is ``echo: <last user text>``. When the request has ``tools`` and the
last user message names a tool (or says ``tool``), it calls that tool (the first one if none is named) with
``{<first parameter>: <user text>}``; after a ``tool`` message it answers ``tool result: <content>``.
``up.script(...)`` queues exact replies instead, ``up.fail(...)`` makes the next calls fail (5xx, hang or a
dropped connection), and ``up.requests`` records every request received.

With ``token_ids=True`` it behaves like vLLM: a request with ``return_token_ids`` gets top-level
``prompt_token_ids`` and per-choice ``token_ids``; ``logprobs`` gets ``logprobs.content[*].logprob``. Token ids
are a stable hash of whitespace-separated words, so tests can recompute them with :func:`token_ids_of`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from agl.asgi_server import BackgroundServer

FailureMode = Literal["500", "503", "429", "hang", "close"]


class _QuietDrops(logging.Filter):
    """Hide uvicorn's traceback for a connection this module drops on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (isinstance(exc, ConnectionAbortedError) and "scripted dropped" in str(exc))


if not any(isinstance(f, _QuietDrops) for f in logging.getLogger("uvicorn.error").filters):
    logging.getLogger("uvicorn.error").addFilter(_QuietDrops())


def token_ids_of(text: str) -> list[int]:
    """The upstream's deterministic "tokenization": one id per whitespace-separated word."""
    return [zlib.crc32(word.encode()) % 50_000 + 100 for word in text.split()]


def logprob_of(index: int) -> float:
    """The deterministic logprob of the ``index``-th completion token."""
    return -round(0.05 + 0.1 * (index % 7), 4)


def prompt_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """How the upstream renders chat messages into the prompt it "tokenizes"."""
    return " ".join(f"<{m.get('role')}> {_text(m.get('content'))}" for m in messages)


@dataclass
class RecordedRequest:
    """One request the upstream received."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class ScriptedReply:
    """A reply to give instead of the echo rule; ``status`` other than 200 returns an error body."""

    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    status: int = 200
    delay_s: float = 0.0


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": None}}, status)


class OpenAIUpstream:
    """The server; see the module docstring. Thread-safe: tests change scripts while requests run."""

    def __init__(
        self,
        *,
        model: str = "test-model",
        token_ids: bool = False,
        model_version: str | None = None,
        api_key: str | None = None,
        delay_s: float = 0.0,
        chunk_delay_s: float = 0.0,
        record_bodies: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.model = model
        self.token_ids = token_ids
        self.model_version = model_version
        self.api_key = api_key
        self.delay_s = delay_s
        self.chunk_delay_s = chunk_delay_s
        self.record_bodies = record_bodies
        self.requests: list[RecordedRequest] = []
        self.healthy = True
        self._script: deque[ScriptedReply] = deque()
        self._failures: deque[FailureMode] = deque()
        self._fail_forever: FailureMode | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        self._server = BackgroundServer(self.app(), host=host, port=port)

    # ----- lifecycle --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._server.url

    @property
    def base_url(self) -> str:
        return f"{self._server.url}/v1"

    def start(self) -> OpenAIUpstream:
        self._stopping.clear()
        self._server.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # releases hanging requests so shutdown does not wait on them
        self._server.stop()

    def __enter__(self) -> OpenAIUpstream:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ----- scripting --------------------------------------------------------------------------
    def script(self, *replies: str | ScriptedReply) -> None:
        """Queue replies for the next calls, in order; a ``str`` is an assistant text reply."""
        with self._lock:
            self._script.extend(ScriptedReply(content=r) if isinstance(r, str) else r for r in replies)

    def fail(self, mode: FailureMode = "500", times: int | None = 1) -> None:
        """Make the next ``times`` calls fail (``None``: every call until :meth:`recover`).

        ``"hang"`` never answers (until stop); ``"close"`` drops the connection mid-response.
        """
        with self._lock:
            if times is None:
                self._fail_forever = mode
            else:
                self._failures.extend([mode] * times)

    def recover(self) -> None:
        """Stop failing and report healthy again."""
        with self._lock:
            self._failures.clear()
            self._fail_forever = None
            self.healthy = True

    def paths(self) -> list[str]:
        """The paths of the requests received so far, in order."""
        with self._lock:
            return [r.path for r in self.requests]

    # ----- the app ----------------------------------------------------------------------------
    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/responses", self._responses, methods=["POST"]),
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    async def _health(self, request: Request) -> Response:
        with self._lock:
            failing = self._fail_forever is not None
        ok = self.healthy and not failing
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, 200 if ok else 503)

    async def _models(self, request: Request) -> Response:
        await self._record(request, None)
        return JSONResponse(
            {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "agl"}]}
        )

    async def _record(self, request: Request, body: Any) -> None:
        entry = RecordedRequest(
            request.method, request.url.path, dict(request.headers), body if self.record_bodies else None
        )
        with self._lock:
            self.requests.append(entry)

    async def _prologue(self, request: Request) -> tuple[dict[str, Any] | None, Response | None]:
        """Parse, record and apply auth and scripted failures; a Response means answer with it."""
        raw = await request.body()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            await self._record(request, raw.decode(errors="replace"))
            return None, _error(400, "the body is not valid JSON")
        await self._record(request, body)
        if self.api_key is not None and request.headers.get("authorization") != f"Bearer {self.api_key}":
            return None, _error(401, "missing or wrong API key")
        with self._lock:
            mode = self._failures.popleft() if self._failures else self._fail_forever
        if mode == "hang":
            while not self._stopping.is_set():
                await asyncio.sleep(0.02)
            return None, _error(503, "shutting down")
        if mode == "close":
            return None, _DroppedConnection()
        if mode is not None:
            return None, _error(int(mode), f"scripted failure {mode}")
        if not isinstance(body, dict):
            return None, _error(400, "the body must be a JSON object")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return body, None

    def _next_reply(self, body: dict[str, Any], messages: list[dict[str, Any]]) -> ScriptedReply:
        with self._lock:
            if self._script:
                return self._script.popleft()
        last = messages[-1] if messages else {}
        if last.get("role") == "tool":
            return ScriptedReply(content=f"tool result: {_text(last.get('content'))}")
        user = next((_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        tools = [t for t in body.get("tools") or [] if isinstance(t, dict) and "function" in t]
        if tools and last.get("role") == "user":
            named = [t for t in tools if t["function"].get("name") and t["function"]["name"] in user]
            if named or "tool" in user.lower():
                fn = (named or tools)[0]["function"]
                params = list((fn.get("parameters") or {}).get("properties") or {})
                args = {params[0]: user} if params else {}
                call = {
                    "id": f"call_{next(self._ids)}",
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": orjson.dumps(args).decode()},
                }
                return ScriptedReply(content=None, tool_calls=[call])
        return ScriptedReply(content=f"echo: {user}")

    def _extras(self, body: dict[str, Any], prompt: str, completion: list[str]) -> dict[str, Any]:
        """vLLM-style token fidelity fields, when enabled and asked for."""
        out: dict[str, Any] = {}
        if self.token_ids and body.get("return_token_ids"):
            out["prompt_token_ids"] = token_ids_of(prompt)
            out["token_ids"] = [token_ids_of(w)[0] for w in completion]
        if self.token_ids and body.get("logprobs"):
            out["logprobs"] = [logprob_of(i) for i in range(len(completion))]
        return out

    async def _chat(self, request: Request) -> Response:
        body, failure = await self._prologue(request)
        if failure is not None or body is None:
            return failure or _error(400, "no body")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return _error(400, "messages must be a non-empty list of message objects", "messages")
        reply = self._next_reply(body, messages)
        if reply.delay_s:
            await asyncio.sleep(reply.delay_s)
        if reply.status != 200:
            return _error(reply.status, f"scripted error {reply.status}")
        words = (reply.content or "").split()
        extras = self._extras(body, prompt_text(messages), words)
        finish = reply.finish_reason or ("tool_calls" if reply.tool_calls else "stop")
        usage = {
            "prompt_tokens": len(prompt_text(messages).split()),
            "completion_tokens": len(words),
            "total_tokens": len(prompt_text(messages).split()) + len(words),
        }
        rid = f"chatcmpl-{next(self._ids)}"
        model = str(body.get("model") or self.model)
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = self._chat_chunks(
                rid, model, reply, words, extras, finish, usage if include_usage else None
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        choice: dict[str, Any] = {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": reply.content,
                "tool_calls": reply.tool_calls or None,
            },
            "finish_reason": finish,
        }
        if "token_ids" in extras:
            choice["token_ids"] = extras["token_ids"]
        if "logprobs" in extras:
            choice["logprobs"] = {
                "content": [
                    {"token": w, "logprob": lp, "top_logprobs": []}
                    for w, lp in zip(words, extras["logprobs"], strict=True)
                ]
            }
        out: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage,
        }
        if "prompt_token_ids" in extras:
            out["prompt_token_ids"] = extras["prompt_token_ids"]
        if self.model_version is not None:
            out["model_version"] = self.model_version
        return Response(orjson.dumps(out), media_type="application/json")

    async def _chat_chunks(
        self,
        rid: str,
        model: str,
        reply: ScriptedReply,
        words: list[str],
        extras: dict[str, Any],
        finish: str,
        usage: dict[str, Any] | None,
    ) -> Any:
        base: dict[str, Any] = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        if self.model_version is not None:
            base["model_version"] = self.model_version

        def chunk(delta: dict[str, Any], finish_reason: str | None = None, **more: Any) -> bytes:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, **more}
            return b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n"

        first: dict[str, Any] = {
            **base,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        }
        if "prompt_token_ids" in extras:
            first["prompt_token_ids"] = extras["prompt_token_ids"]
        yield b"data: " + orjson.dumps(first) + b"\n\n"
        for i, word in enumerate(words):
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)
            more: dict[str, Any] = {}
            if "token_ids" in extras:
                more["token_ids"] = [extras["token_ids"][i]]
            if "logprobs" in extras:
                more["logprobs"] = {
                    "content": [{"token": word, "logprob": extras["logprobs"][i], "top_logprobs": []}]
                }
            yield chunk({"content": word if i == 0 else " " + word}, **more)
        for i, call in enumerate(reply.tool_calls):
            yield chunk({"tool_calls": [{"index": i, **call}]})
        yield chunk({}, finish)
        if usage is not None:
            yield b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def _completions(self, request: Request) -> Response:
        body, failure = await self._prologue(request)
        if failure is not None or body is None:
            return failure or _error(400, "no body")
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return _error(400, "prompt must be a string", "prompt")
        with self._lock:
            scripted = self._script.popleft() if self._script else None
        text = scripted.content if scripted and scripted.content is not None else f"echo: {prompt}"
        words = text.split()
        extras = self._extras(body, prompt, words)
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
        if "token_ids" in extras:
            choice["prompt_token_ids"] = extras["prompt_token_ids"]
            choice["token_ids"] = extras["token_ids"]
        if "logprobs" in extras:
            choice["logprobs"] = {"tokens": words, "token_logprobs": extras["logprobs"]}
        out: dict[str, Any] = {
            "id": f"cmpl-{next(self._ids)}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": str(body.get("model") or self.model),
            "choices": [choice],
            "usage": {
                "prompt_tokens": len(prompt.split()),
                "completion_tokens": len(words),
                "total_tokens": len(prompt.split()) + len(words),
            },
        }
        if self.model_version is not None:
            out["model_version"] = self.model_version
        return Response(orjson.dumps(out), media_type="application/json")

    async def _responses(self, request: Request) -> Response:
        body, failure = await self._prologue(request)
        if failure is not None or body is None:
            return failure or _error(400, "no body")
        given = body.get("input")
        if isinstance(given, str):
            user = given
        elif isinstance(given, list) and given:
            user = _text(given[-1].get("content")) if isinstance(given[-1], dict) else str(given[-1])
        else:
            return _error(400, "input must be a string or a non-empty list of items", "input")
        text = f"echo: {user}"
        out = {
            "id": f"resp_{next(self._ids)}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "completed",
            "model": str(body.get("model") or self.model),
            "output": [
                {
                    "type": "message",
                    "id": f"msg_{next(self._ids)}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "usage": {
                "input_tokens": len(user.split()),
                "output_tokens": len(text.split()),
                "total_tokens": len(user.split()) + len(text.split()),
            },
        }
        return Response(orjson.dumps(out), media_type="application/json")


class _DroppedConnection(Response):
    """Starts a response that promises a body, then breaks off: the client sees a dropped connection."""

    def __init__(self) -> None:
        super().__init__(status_code=200)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"1000")]})
        await send({"type": "http.response.body", "body": b'{"partial":', "more_body": True})
        raise ConnectionAbortedError("scripted dropped connection")
