"""The LightningStore over HTTP: a FastAPI app serving every store method as JSON under ``/v1/agl``.

Errors keep their class across the wire: one table maps each ``agl.errors`` class to a status code
and the body names it (``{"error": {"type", "message", "field", "rollout_id", "attempt_id"}}``);
the client raises the same class again. Bad input is always a 4xx, never a 5xx.

Auth and exposure: with a token, every route but ``/health`` needs ``Authorization: Bearer <token>``
(compared in constant time). Request bodies are capped (``max_body_bytes``, 413 beyond).
Non-idempotent calls (dequeue, start, sequence ids) honour an ``Idempotency-Key`` header, so a
client retry after a lost response gets the first answer instead of a second claim.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter, ValidationError

from agl import errors
from agl.schemas import Attempt, AttemptedRollout, ResourcesVersion, Rollout, Span, Worker
from agl.store import _wire as w
from agl.store.base import LightningStore, Page, StoreStatistics

_STORED_SPANS = TypeAdapter(list[w.StoredSpan])

ERROR_STATUS: list[tuple[type[errors.AglError], int]] = [
    (errors.NotFoundError, 404),
    (errors.StaleAttemptError, 409),
    (errors.ConflictError, 409),
    (errors.InvalidTransitionError, 409),
    (errors.InvalidSpanError, 422),
    (errors.UnauthorizedError, 401),
    (errors.StoreUnavailableError, 503),
    (errors.StoreError, 400),
    (errors.ConfigError, 400),
    (errors.AglError, 400),
]


def status_for(exc: errors.AglError) -> int:
    """The HTTP status of an agl error: the first table entry in its MRO wins."""
    for cls in type(exc).__mro__:
        for known, status in ERROR_STATUS:
            if cls is known:
                return status
    return 400


def error_body(type_name: str, message: str, **extra: Any) -> dict[str, Any]:
    return {
        "error": {"type": type_name, "message": message, **{k: v for k, v in extra.items() if v is not None}}
    }


class _GuardMiddleware:
    """Bearer-token check (all routes but /health) and a request body size cap, as plain ASGI."""

    def __init__(self, app: Any, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body(
                    "UnauthorizedError", "missing or wrong bearer token; send Authorization: Bearer <token>"
                )
                return await JSONResponse(body, status_code=401)(scope, receive, send)
        declared = int(headers.get(b"content-length", b"0") or 0)
        if declared > self.max_body_bytes:
            return await self._too_large(scope, receive, send)
        seen = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message: dict[str, Any] = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body_bytes:
                raise _BodyTooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Any, receive: Any, send: Any) -> None:
        body = error_body(
            "PayloadTooLarge", f"request body exceeds {self.max_body_bytes} bytes; send smaller batches"
        )
        await JSONResponse(body, status_code=413)(scope, receive, send)


class _BodyTooLarge(BaseException):  # not Exception: FastAPI would turn it into a 400
    pass


class _IdempotencyCache:
    """First responses of keyed requests, kept for ``ttl_s`` so retries are answered, not re-executed."""

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 20_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: OrderedDict[str, tuple[float, asyncio.Future[Any]]] = OrderedDict()

    async def run(self, key: str | None, call: Callable[[], Awaitable[Any]]) -> Any:
        if key is None:
            return await call()
        now = time.monotonic()
        while self._entries and next(iter(self._entries.values()))[0] < now - self.ttl_s:
            self._entries.popitem(last=False)
        if key in self._entries:
            return await asyncio.shield(self._entries[key][1])
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._entries[key] = (now, future)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        try:
            result = await call()
        except BaseException as exc:
            del self._entries[key]  # a failed call may be retried for real
            future.set_exception(exc)
            future.exception()  # mark retrieved
            raise
        future.set_result(result)
        return result


def create_app(
    store: LightningStore, *, token: str | None = None, max_body_bytes: int = 64 * 1024 * 1024
) -> Any:
    """The ASGI app serving ``store``; run it with uvicorn (see ``agl store serve``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.start()  # the watchdog runs on the server's loop
        yield

    app = FastAPI(title="agl LightningStore", version="1", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.store = store
    cache = _IdempotencyCache()
    p = w.API_PREFIX

    @app.exception_handler(errors.AglError)
    async def _agl_error(request: Request, exc: errors.AglError) -> JSONResponse:
        body = error_body(
            type(exc).__name__,
            exc.message,
            rollout_id=exc.rollout_id,
            attempt_id=exc.attempt_id,
            field=getattr(exc, "param", None),
        )
        return JSONResponse(body, status_code=status_for(exc))

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = exc.errors()
        fields = [".".join(str(p) for p in e.get("loc", ()) if p != "body") for e in problems]
        message = "; ".join(f"{f or '<body>'}: {e.get('msg')}" for f, e in zip(fields, problems, strict=True))
        status = 400 if any(e.get("type") == "json_invalid" for e in problems) else 422
        return JSONResponse(
            error_body("ValidationError", message, field=fields[0] if fields else None), status
        )

    def key(request: Request) -> str | None:
        return request.headers.get("idempotency-key")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # ----- rollouts -------------------------------------------------------------------------
    @app.post(f"{p}/rollouts")
    async def enqueue(body: w.EnqueueRequest) -> list[Rollout]:
        return await store.enqueue_rollouts(body.rollouts)

    @app.post(f"{p}/rollouts/dequeue")
    async def dequeue(body: w.DequeueRequest, request: Request) -> AttemptedRollout | None:
        return await cache.run(key(request), lambda: store.dequeue(body.worker_id))  # type: ignore[no-any-return]

    @app.post(f"{p}/rollouts/start")
    async def start(body: w.StartRequest, request: Request) -> AttemptedRollout:
        return await cache.run(key(request), lambda: store.start_rollout(body.rollout, body.worker_id))  # type: ignore[no-any-return]

    @app.post(f"{p}/rollouts/query")
    async def query_rollouts(body: w.RolloutQuery) -> Page[Rollout]:
        return await store.query_rollouts(**body.model_dump())

    @app.post(f"{p}/rollouts/wait")
    async def wait(body: w.WaitRequest) -> list[Rollout]:
        timeout = w.MAX_WAIT_S if body.timeout_s is None else min(body.timeout_s, w.MAX_WAIT_S)
        return await store.wait_for_rollouts(body.rollout_ids, timeout_s=timeout)

    @app.get(f"{p}/rollouts/{{rollout_id}}")
    async def get_rollout(rollout_id: str) -> Rollout:
        return await store.get_rollout(rollout_id)

    @app.patch(f"{p}/rollouts/{{rollout_id}}")
    async def update_rollout(rollout_id: str, body: w.RolloutPatch) -> Rollout:
        return await store.update_rollout(rollout_id, status=body.status, metadata=body.metadata)

    @app.post(f"{p}/rollouts/{{rollout_id}}/sequence_id")
    async def next_sequence_id(rollout_id: str, request: Request) -> int:
        return await cache.run(key(request), lambda: store.next_sequence_id(rollout_id))  # type: ignore[no-any-return]

    # ----- attempts -------------------------------------------------------------------------
    @app.patch(f"{p}/rollouts/{{rollout_id}}/attempts/{{attempt_id}}")
    async def update_attempt(rollout_id: str, attempt_id: str, body: w.AttemptPatch) -> Attempt:
        return await store.update_attempt(
            rollout_id, attempt_id, status=body.status, error=body.error, metadata=body.metadata
        )

    @app.post(f"{p}/rollouts/{{rollout_id}}/attempts/{{attempt_id}}/heartbeat")
    async def heartbeat(rollout_id: str, attempt_id: str) -> Rollout:
        return await store.heartbeat(rollout_id, attempt_id)

    @app.post(f"{p}/attempts/query")
    async def query_attempts(body: w.AttemptQuery) -> Page[Attempt]:
        return await store.query_attempts(**body.model_dump())

    # ----- spans ----------------------------------------------------------------------------
    @app.post(
        f"{p}/spans",
        response_model=list[w.StoredSpan],
        openapi_extra={
            "requestBody": {
                "content": {"application/json": {"schema": w.SpansRequest.model_json_schema()}},
                "required": True,
            }
        },
    )
    async def add_spans(request: Request) -> Response:
        # the hot path: parse straight from bytes with pydantic-core, answer with ids only (not the spans back)
        try:
            body = w.SpansRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from exc
        stored = await store.add_spans(body.spans)
        return Response(
            _STORED_SPANS.dump_json([w.StoredSpan.of(s) for s in stored]), media_type="application/json"
        )

    @app.post(f"{p}/spans/query")
    async def query_spans(body: w.SpanQuery) -> Page[Span]:
        return await store.query_spans(**body.model_dump())

    # ----- resources, workers, statistics ---------------------------------------------------
    @app.post(f"{p}/resources")
    async def add_resources(body: w.ResourcesRequest, request: Request) -> ResourcesVersion:
        call = lambda: store.add_resources(  # noqa: E731
            body.resources, resources_id=body.resources_id, parent_id=body.parent_id, metadata=body.metadata
        )
        return await cache.run(key(request), call)  # type: ignore[no-any-return]

    @app.get(f"{p}/resources/latest")
    async def latest_resources() -> ResourcesVersion | None:
        return await store.get_latest_resources()

    @app.get(f"{p}/resources/{{resources_id}}")
    async def get_resources(resources_id: str) -> ResourcesVersion:
        return await store.get_resources(resources_id)

    @app.post(f"{p}/resources/query")
    async def query_resources(body: w.PageQuery) -> Page[ResourcesVersion]:
        return await store.query_resources(limit=body.limit, cursor=body.cursor)

    @app.put(f"{p}/workers/{{worker_id}}")
    async def update_worker(worker_id: str, body: w.WorkerPatch) -> Worker:
        return await store.update_worker(worker_id, status=body.status, host=body.host)

    @app.get(f"{p}/workers/{{worker_id}}")
    async def get_worker(worker_id: str) -> Worker:
        return await store.get_worker(worker_id)

    @app.post(f"{p}/workers/query")
    async def query_workers(body: w.WorkerQuery) -> Page[Worker]:
        return await store.query_workers(**body.model_dump())

    @app.get(f"{p}/statistics")
    async def statistics() -> StoreStatistics:
        return await store.statistics()

    @app.post(f"{p}/watchdog")
    async def watchdog() -> list[Attempt]:
        return await store.run_watchdog()

    @app.post("/v1/traces")
    async def otlp_traces(request: Request) -> Response:
        from agl.store.otlp import parse_otlp

        try:
            spans = parse_otlp(await request.body(), request.headers.get("content-type", ""))
        except errors.StoreError as exc:  # OTLP/HTTP clients expect 400 for requests they must not retry
            return JSONResponse(error_body(type(exc).__name__, exc.message), status_code=400)
        stored = await store.add_spans(spans)
        return Response(
            orjson.dumps({"partialSuccess": {}, "accepted": len(stored)}), media_type="application/json"
        )

    return _GuardMiddleware(app, token, max_body_bytes)
