"""The LightningStore and its read model over HTTP: a FastAPI app serving every store method as JSON
under ``/v1/agl``, its routes grouped as the methods are (lifecycle core, read model).

Errors keep their class across the wire: ``_http_errors`` maps each ``agl.errors`` class to a status
code and the body names it (``{"error": {"type", "message", "field", "rollout_id", "attempt_id"}}``);
the client raises the same class again. Bad input is always a 4xx, never a 5xx. The four calls a
runner makes per rollout skip FastAPI's machinery (``_hot_routes``); FastAPI serves the rest.

Auth and exposure: with a token, every route but ``/health`` needs ``Authorization: Bearer <token>``
(compared in constant time), ``/metrics`` included (``_metrics`` says why). Request bodies are
capped (``max_body_bytes``, 413 beyond; for gzip OTLP bodies the decompressed size counts too).
Non-idempotent calls (dequeue, start, sequence ids) honour an ``Idempotency-Key`` header, so a
client retry after a lost response gets the first answer instead of a second claim; the same key
sent with another route or body is refused (409) rather than answered with the other call's result.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException as StarletteHTTPException

from agl import errors
from agl.schemas import Attempt, AttemptedRollout, ResourcesVersion, Rollout, Span, Worker
from agl.store import _wire as w
from agl.store._hot_routes import HotRoute, HotRoutes
from agl.store._http_errors import agl_error, error_body, validation_error
from agl.store._metrics import CONTENT_TYPE, UNMATCHED, StoreMetrics
from agl.store.base import LightningStore, Page
from agl.store.read_model import (
    AttemptDigest,
    RolloutMatches,
    RolloutSearch,
    StoreReadModel,
    StoreStatistics,
)

_STORED_SPANS = TypeAdapter(list[w.StoredSpan])
_MAYBE_CLAIM = TypeAdapter(AttemptedRollout | None)
_ATTEMPT = TypeAdapter(Attempt)
_ROLLOUT = TypeAdapter(Rollout)


class _GuardMiddleware:
    """Bearer-token check (all routes but /health) and a request body size cap, as plain ASGI.

    Behind the checks, the hot routes are answered here and everything else goes to FastAPI.
    """

    def __init__(
        self, app: Any, token: str | None, max_body_bytes: int, hot: HotRoutes, metrics: StoreMetrics
    ) -> None:
        self.app = app
        self.hot = hot
        self.expected = f"Bearer {token}".encode() if token else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start, status = time.perf_counter(), 500

        async def send_and_note(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self._guarded(scope, receive, send_and_note)
        finally:
            # route templates only (FastAPI leaves its matched route in the scope), never raw paths
            route = scope.get("agl.route") or getattr(scope.get("route"), "path", None) or UNMATCHED
            method = scope["method"] if scope["method"] in _METHODS else "OTHER"
            self.metrics.observe(route, method, status, time.perf_counter() - start)

    async def _guarded(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                body = error_body(
                    "UnauthorizedError", "missing or wrong bearer token; send Authorization: Bearer <token>"
                )
                return await JSONResponse(body, status_code=401)(scope, receive, send)
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body_bytes:
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
            hot = self.hot.match(scope)
            if hot is not None:
                scope["agl.route"] = hot[0].path
                await self.hot.serve(*hot, scope, limited_receive, send)
            else:
                await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: Any, receive: Any, send: Any) -> None:
        body = error_body(
            "PayloadTooLarge", f"request body exceeds {self.max_body_bytes} bytes; send smaller batches"
        )
        await JSONResponse(body, status_code=413)(scope, receive, send)


class IdempotencyKeyReusedError(errors.ConflictError):
    """An Idempotency-Key sent again with a different route or body."""

    param = "Idempotency-Key"


_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class _BodyTooLarge(BaseException):  # not Exception: FastAPI would turn it into a 400
    pass


class _IdempotencyCache:
    """First answers of keyed requests, kept for ``ttl_s`` so retries are answered, not re-executed.

    An entry holds what ``keep`` makes of the answer (a claim's ids, not the claim) and ``replay``
    turns that back into an answer, so a full cache costs a few MB, not one object graph per key.
    """

    def __init__(self, ttl_s: float = 600.0, max_entries: int = 20_000) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._entries: OrderedDict[str, tuple[float, bytes, asyncio.Future[Any]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def run(
        self,
        key: str | None,
        call: Callable[[], Awaitable[Any]],
        keep: Callable[[Any], Any] = lambda answer: answer,
        replay: Callable[[Any], Awaitable[Any]] | None = None,
        request: str = "",
    ) -> Any:
        """``call``'s answer, or the first answer to ``key`` when it was seen with the same ``request``.

        ``request`` names the route and body; a key reused for another request is refused (409),
        since replaying the other request's answer would be wrong and running it would break the
        key's promise.
        """
        if key is None:
            return await call()
        now = time.monotonic()
        while self._entries and next(iter(self._entries.values()))[0] < now - self.ttl_s:
            self._entries.popitem(last=False)
        fingerprint = hashlib.blake2b(request.encode(), digest_size=16).digest()
        if key in self._entries:
            _, first, pending = self._entries[key]
            if first != fingerprint:
                raise IdempotencyKeyReusedError(
                    f"Idempotency-Key {key[:80]!r} was first sent with another request (route or body); "
                    f"this one is {request.split(' ', 1)[0]}. Send a fresh key for each distinct request"
                )
            kept = await asyncio.shield(pending)
            return kept if replay is None else await replay(kept)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._entries[key] = (now, fingerprint, future)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        try:
            answer = await call()
        except BaseException as exc:
            self._entries.pop(key, None)  # a failed call may be retried for real
            future.set_exception(exc)
            future.exception()  # mark retrieved
            raise
        future.set_result(keep(answer))
        return answer


def _claim_ids(claim: AttemptedRollout | None) -> tuple[str, str] | None:
    return None if claim is None else (claim.rollout.rollout_id, claim.attempt.attempt_id)


async def _claim_now(store: LightningStore, ids: tuple[str, str] | None) -> AttemptedRollout | None:
    """A remembered claim as the store holds it now (the watchdog may have moved it since)."""
    if ids is None:
        return None
    rollout_id, attempt_id = ids
    rollout = await store.get_rollout(rollout_id)
    attempts = await store.query_attempts(rollout_id=rollout_id, limit=10_000)
    attempt = next((a for a in attempts.items if a.attempt_id == attempt_id), None)
    if attempt is None:
        raise errors.NotFoundError(
            f"no attempt {attempt_id!r} of rollout {rollout_id!r}",
            rollout_id=rollout_id,
            attempt_id=attempt_id,
        )
    return AttemptedRollout(rollout=rollout, attempt=attempt)


def create_app(
    store: LightningStore, *, token: str | None = None, max_body_bytes: int = 64 * 1024 * 1024
) -> Any:
    """The ASGI app serving ``store``; run it with uvicorn (see ``agl store serve``).

    Routes come in groups as the store's methods do: the lifecycle core (rollouts; attempts and spans;
    resources, worker updates and the watchdog), the read model (digests, search, statistics, workers;
    served when the store has one, as every agl backend does), OTLP ingestion, and health and metrics.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await store.start()  # the watchdog runs on the server's loop
        yield

    app = FastAPI(title="agl LightningStore", version="1", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.store = store
    calls = _Calls(store)
    _add_error_handlers(app)
    _add_health_routes(app, store, calls)
    _add_rollout_routes(app, calls)
    _add_attempt_and_span_routes(app, calls)
    _add_resource_and_worker_routes(app, calls)
    if isinstance(store, StoreReadModel):
        _add_read_model_routes(app, store)
    _add_otlp_route(app, calls, max_body_bytes)
    return _GuardMiddleware(app, token, max_body_bytes, calls.hot_routes(), calls.metrics)


class _Calls:
    """What the core routes share: the store, the idempotency cache, the metrics, and the calls behind
    the hot routes (also declared to FastAPI, for the schema and for clients that send no length)."""

    def __init__(self, store: LightningStore) -> None:
        self.store = store
        self.cache = _IdempotencyCache()
        self.metrics = StoreMetrics()

    async def replay_claim(self, ids: tuple[str, str] | None) -> AttemptedRollout | None:
        return await _claim_now(self.store, ids)

    async def dequeue(
        self, _: dict[str, str], body: w.DequeueRequest, key: str | None
    ) -> AttemptedRollout | None:
        call = lambda: self.store.dequeue(body.worker_id)  # noqa: E731
        request = f"dequeue {body.worker_id}"
        return await self.cache.run(key, call, _claim_ids, self.replay_claim, request)  # type: ignore[no-any-return]

    async def add_spans(self, _: dict[str, str], body: w.SpansRequest, __: str | None) -> list[w.StoredSpan]:
        stored = await self.store.add_spans(body.spans)
        self.metrics.spans.inc(len(stored))
        return [w.StoredSpan.of(s) for s in stored]

    async def update_attempt(self, ids: dict[str, str], body: w.AttemptPatch, _: str | None) -> Attempt:
        return await self.store.update_attempt(
            ids["rollout_id"], ids["attempt_id"], status=body.status, error=body.error, metadata=body.metadata
        )

    async def heartbeat(self, ids: dict[str, str], _: None, __: str | None) -> Rollout:
        return await self.store.heartbeat(ids["rollout_id"], ids["attempt_id"])

    def hot_routes(self) -> HotRoutes:
        p = w.API_PREFIX
        return HotRoutes(
            [
                HotRoute("POST", f"{p}/rollouts/dequeue", w.DequeueRequest, _MAYBE_CLAIM, self.dequeue),
                HotRoute(
                    "POST", f"{p}/spans", w.SpansRequest, _STORED_SPANS, self.add_spans, w.parse_spans_request
                ),
                HotRoute("PATCH", _ATTEMPT_PATH, w.AttemptPatch, _ATTEMPT, self.update_attempt),
                HotRoute("POST", f"{_ATTEMPT_PATH}/heartbeat", None, _ROLLOUT, self.heartbeat),
            ]
        )


_ATTEMPT_PATH = f"{w.API_PREFIX}/rollouts/{{rollout_id}}/attempts/{{attempt_id}}"


def _key(request: Request) -> str | None:
    return request.headers.get("idempotency-key")


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.AglError)
    async def _agl_error(request: Request, exc: errors.AglError) -> JSONResponse:
        status, body = agl_error(exc)
        return JSONResponse(body, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, body = validation_error(exc.errors())
        return JSONResponse(body, status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown paths (404) and methods (405) answer in the same error shape as everything else."""
        names = {404: "NotFoundError", 405: "MethodNotAllowed"}
        message = f"{request.method} {request.url.path}: {exc.detail}"
        body = error_body(names.get(exc.status_code, "HTTPError"), message)
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _add_health_routes(app: FastAPI, store: LightningStore, calls: _Calls) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition; see ``_metrics`` for what it holds and why it needs the token."""
        stats = await store.statistics() if isinstance(store, StoreReadModel) else StoreStatistics()
        scraped = calls.metrics.scrape(stats, len(calls.cache))
        return Response(scraped, media_type=CONTENT_TYPE)


def _add_rollout_routes(app: FastAPI, calls: _Calls) -> None:
    store, cache, p = calls.store, calls.cache, w.API_PREFIX

    @app.post(f"{p}/rollouts")
    async def enqueue(body: w.EnqueueRequest) -> list[Rollout]:
        return await store.enqueue_rollouts(body.rollouts)

    @app.post(f"{p}/rollouts/dequeue")
    async def dequeue(body: w.DequeueRequest, request: Request) -> AttemptedRollout | None:
        return await calls.dequeue({}, body, _key(request))

    @app.post(f"{p}/rollouts/start")
    async def start(body: w.StartRequest, request: Request) -> AttemptedRollout:
        call = lambda: store.start_rollout(body.rollout, body.worker_id)  # noqa: E731
        seen = f"start {body.model_dump_json()}"
        return await cache.run(_key(request), call, _claim_ids, calls.replay_claim, seen)  # type: ignore[no-any-return]

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
        call = lambda: store.next_sequence_id(rollout_id)  # noqa: E731
        return await cache.run(_key(request), call, request=f"sequence_id {rollout_id}")  # type: ignore[no-any-return]


def _add_attempt_and_span_routes(app: FastAPI, calls: _Calls) -> None:
    store, p = calls.store, w.API_PREFIX

    @app.patch(_ATTEMPT_PATH)
    async def update_attempt(rollout_id: str, attempt_id: str, body: w.AttemptPatch) -> Attempt:
        return await calls.update_attempt({"rollout_id": rollout_id, "attempt_id": attempt_id}, body, None)

    @app.post(f"{_ATTEMPT_PATH}/heartbeat")
    async def heartbeat(rollout_id: str, attempt_id: str) -> Rollout:
        return await calls.heartbeat({"rollout_id": rollout_id, "attempt_id": attempt_id}, None, None)

    @app.post(f"{p}/attempts/query")
    async def query_attempts(body: w.AttemptQuery) -> Page[Attempt]:
        return await store.query_attempts(**body.model_dump())

    @app.post(f"{p}/spans")
    async def add_spans(body: w.SpansRequest) -> list[w.StoredSpan]:
        """Stores a batch; answers with the ids and sequence ids of the newly stored spans only."""
        return await calls.add_spans({}, body, None)

    @app.post(f"{p}/spans/query")
    async def query_spans(body: w.SpanQuery) -> Page[Span]:
        return await store.query_spans(**body.model_dump())


def _add_resource_and_worker_routes(app: FastAPI, calls: _Calls) -> None:
    store, cache, p = calls.store, calls.cache, w.API_PREFIX

    @app.post(f"{p}/resources")
    async def add_resources(body: w.ResourcesRequest, request: Request) -> ResourcesVersion:
        call = lambda: store.add_resources(  # noqa: E731
            body.resources, resources_id=body.resources_id, parent_id=body.parent_id, metadata=body.metadata
        )
        keep = lambda version: version.resources_id  # noqa: E731
        seen = f"resources {body.model_dump_json()}"
        return await cache.run(_key(request), call, keep, store.get_resources, seen)  # type: ignore[no-any-return]

    @app.get(f"{p}/resources/latest")
    async def latest_resources() -> ResourcesVersion | None:
        return await store.get_latest_resources()

    @app.get(f"{p}/resources/{{resources_id}}")
    async def get_resources(resources_id: str) -> ResourcesVersion:
        return await store.get_resources(resources_id)

    @app.post(f"{p}/resources/query")
    async def query_resources(body: w.ResourcesQuery) -> Page[ResourcesVersion]:
        return await store.query_resources(**body.model_dump())

    @app.put(f"{p}/workers/{{worker_id}}")
    async def update_worker(worker_id: str, body: w.WorkerPatch) -> Worker:
        return await store.update_worker(worker_id, status=body.status, host=body.host)

    @app.post(f"{p}/watchdog")
    async def watchdog() -> list[Attempt]:
        return await store.run_watchdog()


def _add_read_model_routes(app: FastAPI, store: StoreReadModel) -> None:
    p = w.API_PREFIX

    @app.post(f"{p}/digests/query")
    async def query_digests(body: w.DigestQuery) -> Page[AttemptDigest]:
        return await store.query_digests(**body.model_dump())

    @app.post(f"{p}/rollouts/search")
    async def search_rollouts(body: RolloutSearch) -> RolloutMatches:
        return await store.search_rollouts(body)

    @app.get(f"{p}/statistics")
    async def statistics() -> StoreStatistics:
        return await store.statistics()

    @app.get(f"{p}/workers/{{worker_id}}")
    async def get_worker(worker_id: str) -> Worker:
        return await store.get_worker(worker_id)

    @app.post(f"{p}/workers/query")
    async def query_workers(body: w.WorkerQuery) -> Page[Worker]:
        return await store.query_workers(**body.model_dump())


def _add_otlp_route(app: FastAPI, calls: _Calls, max_body_bytes: int) -> None:
    @app.post("/v1/traces")
    async def otlp_traces(request: Request) -> Response:
        from agl.store.otlp import BodyTooLargeError, decode_content, parse_otlp

        try:
            body = decode_content(
                await request.body(), request.headers.get("content-encoding", ""), max_body_bytes
            )
            spans = parse_otlp(body, request.headers.get("content-type", ""))
        except BodyTooLargeError as exc:
            return JSONResponse(error_body("PayloadTooLarge", exc.message), status_code=413)
        except errors.StoreError as exc:  # OTLP/HTTP clients expect 400 for requests they must not retry
            return JSONResponse(agl_error(exc)[1], status_code=400)
        stored = await calls.store.add_spans(spans)
        calls.metrics.otlp_spans.inc(len(stored))
        return Response(
            orjson.dumps({"partialSuccess": {}, "accepted": len(stored)}), media_type="application/json"
        )
