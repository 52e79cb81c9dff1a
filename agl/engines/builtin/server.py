"""The OpenAI-compatible HTTP server over an :class:`Engine`, and an in-process form for tests and trainers.

Routes: ``POST /v1/chat/completions`` (incl. ``stream``), ``POST /v1/completions``, ``POST /v1/responses``
(incl. ``stream``), ``POST /v1/embeddings`` (see :mod:`.embeddings`), ``GET /v1/models``,
``GET /health``, ``POST /v1/weights``. Bad input answers 400 with an OpenAI error body naming the field.
Any ``model`` name is accepted: one engine serves one model. With a ``token`` every route but ``/health``
needs ``Authorization: Bearer <token>`` (as vLLM's ``--api-key``): model calls as well as weight loads,
since an open engine lets anyone on the network use the GPU; the gateway sends it as its upstream key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from agl.asgi_server import BackgroundServer
from agl.engines.builtin.embeddings import EmbeddingsRequest, embeddings_body, token_inputs
from agl.engines.builtin.engine import Engine, Generation, StreamDelta
from agl.engines.builtin.protocol import (
    ChatRequest,
    CompletionRequest,
    WeightsRequest,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_view,
)
from agl.engines.builtin.reasoning import ReasoningStream, opens_thinking, split_reply
from agl.engines.builtin.responses import ResponsesRequest, response_body, stream_events, to_chat
from agl.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)


def error_body(
    message: str, param: str | None, code: int = 400, type_: str = "invalid_request_error"
) -> Response:
    """An OpenAI-style error response."""
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(orjson.dumps(body), status_code=code, media_type="application/json")


def _validation_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": str(exc)}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    return error_body(f"{param or 'body'}: {first.get('msg')} (got {first.get('input')!r:.200})", param)


def _config_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ConfigError)
    return error_body(exc.message, getattr(exc, "param", None))


def _split(engine: Engine, prompt: list[int], content: str | None) -> tuple[str | None, str | None]:
    """``(reasoning_content, content)`` of a chat reply: the thinking split off when the model thinks."""
    return split_reply(engine.reasoning_tags, prompt, content)


def _chat_choice(engine: Engine, gen: Generation, index: int) -> dict[str, Any]:
    choice = gen.choices[index]
    reasoning, content = _split(engine, gen.prompt_token_ids, choice.content)
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if choice.tool_calls:
        message["tool_calls"] = choice.tool_calls
    return {
        "index": choice.index,
        "message": message,
        "finish_reason": choice.finish_reason,
        "logprobs": chat_logprobs(engine.tokenizer, choice),
        "token_ids": choice.token_ids,
    }


def _usage(gen: Generation) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in gen.choices)
    prompt = len(gen.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _chat_stream(
    engine: Engine, req: ChatRequest, prompt: list[int], stream: AsyncIterator[StreamDelta | Generation]
) -> AsyncIterator[bytes]:
    """SSE chunks; with ``tools`` each choice's text is held until it ends, then sent as content or tool_calls."""
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
    }
    head["model"] = req.model or engine.model_name
    started: set[int] = set()
    first = True
    out: dict[str, Any]
    tags = engine.reasoning_tags
    splitters: dict[int, ReasoningStream] = {}
    async for item in stream:
        if isinstance(item, Generation):
            if req.tools:
                for choice in item.choices:
                    reasoning, content = _split(engine, prompt, choice.content)
                    delta: dict[str, Any] = {"role": "assistant", "content": content}
                    if reasoning is not None:
                        delta["reasoning_content"] = reasoning
                    if choice.tool_calls:
                        delta["tool_calls"] = [
                            dict(call, index=i) for i, call in enumerate(choice.tool_calls)
                        ]
                    chunk = {"index": choice.index, "delta": delta, "finish_reason": choice.finish_reason}
                    chunk["logprobs"], chunk["token_ids"] = (
                        chat_logprobs(engine.tokenizer, choice),
                        choice.token_ids,
                    )
                    out = {**head, "model_version": item.model_version, "choices": [chunk]}
                    if first:  # vLLM's shape: the prompt's ids ride on the first chunk
                        out["prompt_token_ids"], first = prompt, False
                    yield _sse(out)
            if req.stream_options is not None and req.stream_options.include_usage:
                yield _sse(
                    {**head, "choices": [], "usage": _usage(item), "model_version": item.model_version}
                )
            yield b"data: [DONE]\n\n"
            return
        if req.tools:
            continue
        delta = {"content": item.text}
        if tags is not None:
            splitter = splitters.setdefault(item.index, ReasoningStream(opens_thinking(prompt, tags)))
            reasoning, content = splitter.feed(item.text, final=item.finish_reason is not None)
            delta = {"content": content}
            if reasoning:
                delta["reasoning_content"] = reasoning
        if item.index not in started:
            started.add(item.index)
            delta["role"] = "assistant"
        entries = [
            {"token": engine.tokenizer.decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
            for t, lp in zip(item.token_ids, item.logprobs, strict=True)
        ]
        chunk = {"index": item.index, "delta": delta, "finish_reason": item.finish_reason}
        chunk["logprobs"], chunk["token_ids"] = {"content": entries}, item.token_ids
        out = {**head, "model_version": engine.model_version, "choices": [chunk]}
        if first:
            out["prompt_token_ids"], first = prompt, False
        yield _sse(out)


class _BearerAuth:
    """401 (OpenAI error body) unless ``Authorization: Bearer <token>`` matches; ``/health`` stays open."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                message = (
                    "missing or wrong bearer token; send Authorization: Bearer <token> (AGL_ENGINE_TOKEN)"
                )
                body = {"error": {"message": message, "type": "authentication_error", "param": None}}
                body["error"]["code"] = "invalid_api_key"
                await Response(orjson.dumps(body), 401, media_type="application/json")(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _served(request: Request) -> Engine:
    """The app's engine, for each route. Routes take it from the app instead of closing over it because
    FastAPI's module-level caches keep route functions alive after their app is gone (up to 4,096 of them):
    a closure there would keep a stopped engine's weights in memory for the rest of the process."""
    engine: Engine = request.app.state.engine
    return engine


def build_app(engine: Engine, token: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; with ``token`` every route but ``/health`` needs it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.loop = asyncio.get_running_loop()  # lets other threads run engine coroutines here
        yield

    app = FastAPI(title="agl engine", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.engine = engine
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ConfigError, _config_error)

    @app.get("/health")
    async def health(engine: Engine = Depends(_served)) -> dict[str, Any]:
        return {"status": "ok", "model": engine.model_name, "model_version": engine.model_version}

    @app.get("/v1/models")
    async def models(engine: Engine = Depends(_served)) -> dict[str, Any]:
        entry = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "agl"}
        return {"object": "list", "data": [{**entry, "model_version": engine.model_version}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest, engine: Engine = Depends(_served)) -> Response:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        tools = req.tools if req.tool_choice != "none" else None
        prompt = engine.encode_chat(messages, tools, req.chat_template_kwargs)
        engine.check_prompt(prompt, "messages")
        params = req.sampling(req.top_logprobs or 0)
        if req.stream:
            stream = engine.stream(prompt, params, tools=tools)
            return StreamingResponse(
                _chat_stream(engine, req, prompt, stream), media_type="text/event-stream"
            )
        gen = await engine.generate(prompt, params, tools=tools)
        body = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": gen.created,
            "model": req.model or engine.model_name,
            "choices": [_chat_choice(engine, gen, i) for i in range(len(gen.choices))],
            "usage": _usage(gen),
            "prompt_token_ids": gen.prompt_token_ids,
            "model_version": gen.model_version,
        }
        return Response(orjson.dumps(body), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, engine: Engine = Depends(_served)) -> Response:
        if req.stream:
            raise InvalidRequestError("stream is not supported on /v1/completions; use chat", param="stream")
        prompt = engine.encode_prompt(req.prompt)
        gen = await engine.generate(prompt, req.sampling(req.logprobs or 0))
        scored = None
        if req.prompt_logprobs is not None:
            scored = prompt_logprobs_view(
                engine.tokenizer, prompt, await engine.prompt_logprobs(prompt, req.prompt_logprobs)
            )
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": completion_logprobs(engine.tokenizer, c),
                "token_ids": c.token_ids,
                "prompt_token_ids": gen.prompt_token_ids,
                **({"prompt_logprobs": scored} if scored is not None else {}),
            }
            for c in gen.choices
        ]
        body = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": gen.created,
            "model": req.model or engine.model_name,
            "choices": choices,
            "usage": _usage(gen),
            "prompt_token_ids": gen.prompt_token_ids,
            "model_version": gen.model_version,
        }
        return Response(orjson.dumps(body), media_type="application/json")

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, engine: Engine = Depends(_served)) -> Response:
        messages, tools = to_chat(req)
        prompt = engine.encode_chat(messages, tools, req.chat_template_kwargs)
        engine.check_prompt(prompt, "input")
        if req.stream:
            stream = engine.stream(prompt, req.sampling(), tools=tools)
            return StreamingResponse(stream_events(engine, req, stream), media_type="text/event-stream")
        gen = await engine.generate(prompt, req.sampling(), tools=tools)
        return Response(orjson.dumps(response_body(engine, req, gen)), media_type="application/json")

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingsRequest, engine: Engine = Depends(_served)) -> Response:
        hidden = int(engine.model.config.hidden_size)
        if req.dimensions is not None and req.dimensions != hidden:
            raise InvalidRequestError(
                f"dimensions={req.dimensions} is not supported: this model's embeddings have {hidden} "
                "dimensions and cannot be shortened; leave dimensions out",
                param="dimensions",
            )
        inputs = token_inputs(
            req.input, engine.encode_prompt, int(engine.model.config.vocab_size), engine.max_model_len
        )
        vectors, version = await engine.embed(inputs)
        tokens = sum(len(ids) for ids in inputs)
        body = embeddings_body(vectors, req.encoding_format, req.model or engine.model_name, tokens, version)
        return Response(orjson.dumps(body), media_type="application/json")

    @app.post("/v1/weights")
    async def weights(req: WeightsRequest, engine: Engine = Depends(_served)) -> JSONResponse:
        version = await engine.update_weights(Path(req.path), req.version, lora=req.lora)
        return JSONResponse({"model_version": version})

    if token:
        app.add_middleware(_BearerAuth, token=token)
    return app


class EngineServer:
    """``EngineServer(engine).start()`` serves on a free port in a background thread; ``base_url`` ends in /v1.

    ``token`` guards every route but ``/health``; pass it to the gateway as the
    upstream's ``api_key``.
    """

    def __init__(
        self,
        engine: Engine | str | Path,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        token: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.engine = engine if isinstance(engine, Engine) else Engine(engine, **engine_kwargs)
        self.token = token or None
        self.app = build_app(self.engine, self.token)
        self._server = BackgroundServer(self.app, host=host, port=port)

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def base_url(self) -> str:
        return f"{self._server.url}/v1"

    def start(self) -> EngineServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def update_weights(
        self, source: dict[str, Any] | str | Path, version: str | None = None, *, lora: bool | None = None
    ) -> str:
        """Blocking :meth:`Engine.update_weights` from any thread (e.g. a trainer pushing a state dict)."""
        loop = getattr(self.app.state, "loop", None)
        if loop is None:
            raise ConfigError("the engine server is not running; call start() first")
        future = asyncio.run_coroutine_threadsafe(
            self.engine.update_weights(source, version, lora=lora), loop
        )
        return future.result()

    def drop_prefix_cache(self) -> None:
        """Blocking :meth:`Engine.drop_prefix_cache` from any thread."""
        loop = getattr(self.app.state, "loop", None)
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self.engine.drop_prefix_cache(), loop).result()

    def release_weights(self) -> None:
        """Blocking :meth:`Engine.release_weights` from any thread."""
        loop = getattr(self.app.state, "loop", None)
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self.engine.release_weights(), loop).result()

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
