"""``LightningStoreClient``: the LightningStore API over HTTP, raising what a local store raises.

Concurrency model: one pooled ``aiohttp.ClientSession`` per event loop (a runner's threads may each run
their own loop), HTTP/1.1 with keep-alive. The client speaks aiohttp directly: httpx on top of it cost
the runners more CPU per request than the server spent answering. Connection
errors and 5xx are retried with exponential backoff; every mutating call is safe to retry: enqueue and
add_resources get client-chosen ids, span batches are deduplicated by span id, and the rest carry an
``Idempotency-Key`` the server answers from its cache.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import urllib.request
import uuid
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, TypeVar

import aiohttp
import orjson
from pydantic import BaseModel, TypeAdapter

from agl import errors
from agl.schemas import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    Resource,
    ResourcesVersion,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Span,
    Worker,
    WorkerStatus,
    new_id,
)
from agl.schemas.span import spans_json
from agl.store import _logic
from agl.store._wire import API_PREFIX, MAX_WAIT_S, StoredSpan
from agl.store.base import Page, RolloutOrder
from agl.store.read_model import (
    AttemptDigest,
    RolloutMatches,
    RolloutSearch,
    StoreReadModel,
    StoreStatistics,
    StoreWithReadModel,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

_ERRORS: dict[str, type[errors.AglError]] = {
    cls.__name__: cls
    for cls in (
        errors.NotFoundError,
        errors.StaleAttemptError,
        errors.ConflictError,
        errors.InvalidTransitionError,
        errors.InvalidSpanError,
        errors.UnauthorizedError,
        errors.StoreUnavailableError,
        errors.StoreError,
        errors.ConfigError,
    )
}


def _raise_for(status: int, content: bytes) -> None:
    """Turn an error response back into the agl exception the server raised."""
    try:
        body = orjson.loads(content)["error"]
    except Exception:
        body = {"type": "StoreError", "message": content[:500].decode("utf-8", "replace")}
    cls = _ERRORS.get(str(body.get("type")), errors.StoreError)
    if status == 401:
        cls = errors.UnauthorizedError
    message = str(body.get("message") or f"HTTP {status}")
    if body.get("field"):
        message += f" (field: {body['field']})"
    raise cls(message, rollout_id=body.get("rollout_id"), attempt_id=body.get("attempt_id"))


#: what a request that never got an answer raises: refused or dropped connections, timeouts
_TRANSPORT_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


class _ReadModelOverHttp(StoreReadModel):
    """The read model's routes (digests, search, statistics, workers), as the server groups them."""

    @abstractmethod
    async def _get(self, path: str, adapter: TypeAdapter[T]) -> T: ...

    @abstractmethod
    async def _post(self, path: str, body: Any, adapter: TypeAdapter[T], **kw: Any) -> T: ...

    async def query_digests(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        after: int = 0,
        limit: int = 10_000,
    ) -> Page[AttemptDigest]:
        body = {
            "rollout_ids": None if rollout_ids is None else list(rollout_ids),
            "after": after,
            "limit": limit,
        }
        return await self._post("/digests/query", body, _DIGEST_PAGE)

    async def search_rollouts(self, query: RolloutSearch) -> RolloutMatches:
        return await self._post("/rollouts/search", query, _MATCHES)

    async def get_worker(self, worker_id: str) -> Worker:
        return await self._get(f"/workers/{worker_id}", _WORKER)

    async def query_workers(
        self, *, status: Sequence[WorkerStatus] | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[Worker]:
        body = {
            "status": None if status is None else [WorkerStatus(s).value for s in status],
            "limit": limit,
            "cursor": cursor,
        }
        return await self._post("/workers/query", body, _WORKER_PAGE)

    async def statistics(self) -> StoreStatistics:
        return await self._get("/statistics", TypeAdapter(StoreStatistics))


class LightningStoreClient(_ReadModelOverHttp, StoreWithReadModel):
    """A remote LightningStore and its read model at ``url`` (e.g. ``http://127.0.0.1:4747``).

    Args:
        token: bearer token; defaults to ``AGL_STORE_TOKEN``.
        retries: attempts beyond the first for connection errors and 5xx.
        timeout_s: per-request timeout (waits add their own long-poll time).
    """

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        retries: int = 5,
        backoff_s: float = 0.2,
        timeout_s: float = 60.0,
    ) -> None:
        super().__init__(watchdog_interval_s=0)  # the server runs the watchdog
        self.url = url.rstrip("/")
        self.token = token if token is not None else os.environ.get("AGL_STORE_TOKEN")
        self.retries, self.backoff_s, self.timeout_s = retries, backoff_s, timeout_s
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._lock = threading.Lock()

    # ----- transport --------------------------------------------------------------------------
    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.get(loop)
            if session is None or session.closed:
                headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
                ssl: Any = True
                if self.url.startswith("https:"):  # the CA bundle and SSL_CERT_FILE, as httpx chose them
                    import httpx

                    ssl = httpx.create_ssl_context(trust_env=True)
                connector = aiohttp.TCPConnector(
                    limit=256,
                    limit_per_host=0,
                    keepalive_timeout=4.0,  # below uvicorn's 5 s, so an idle connection is never reused as it closes
                    ssl=ssl,
                )
                session = aiohttp.ClientSession(
                    self.url,
                    connector=connector,
                    headers=headers,
                    auto_decompress=False,
                    # HTTP(S)_PROXY and NO_PROXY are honoured (looked up per request) only when set at all
                    trust_env=bool(urllib.request.getproxies()),
                )
                self._sessions[loop] = session
            return session

    async def _request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        idempotency_key: bool = False,
        timeout_s: float | None = None,
    ) -> Any:
        headers = {"Idempotency-Key": uuid.uuid4().hex} if idempotency_key else {}
        content = None
        if body is not None:
            if isinstance(body, _Raw):
                content = body.data
            elif isinstance(body, BaseModel):
                content = body.model_dump_json().encode()
            else:
                content = orjson.dumps(body)
            headers["Content-Type"] = "application/json"
        url = path if path.startswith("/v1/traces") or path == "/health" else f"{API_PREFIX}{path}"
        seconds = self.timeout_s if timeout_s is None else timeout_s
        timeout = aiohttp.ClientTimeout(total=None, connect=seconds, sock_connect=seconds, sock_read=seconds)
        for attempt in range(self.retries + 1):
            try:
                async with self._session().request(
                    method, url, data=content, headers=headers, timeout=timeout, allow_redirects=False
                ) as response:
                    status, answer = response.status, await response.read()
                # one line per request at debug level, as httpx logged them (the runner shows them at debug)
                log.debug(
                    'HTTP Request: %s %s%s "HTTP/1.1 %d %s"', method, self.url, url, status, response.reason
                )
            except _TRANSPORT_ERRORS as exc:
                if attempt == self.retries:
                    raise errors.StoreUnavailableError(f"store at {self.url} unreachable: {exc!r}") from exc
            else:
                if status < 400:
                    return orjson.loads(answer)
                if status < 500 or attempt == self.retries:
                    _raise_for(status, answer)
            await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def _get(self, path: str, adapter: TypeAdapter[T]) -> T:
        return adapter.validate_python(await self._request("GET", path))

    async def _post(self, path: str, body: Any, adapter: TypeAdapter[T], **kw: Any) -> T:
        return adapter.validate_python(await self._request("POST", path, body, **kw))

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health")
        except errors.StoreError:
            return False
        return True

    async def aclose(self) -> None:
        await super().aclose()
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._sessions.pop(loop, None)
        if session is not None:
            await session.close()

    # ----- rollouts -------------------------------------------------------------------------
    async def enqueue_rollouts(self, requests: Sequence[RolloutCreate]) -> list[Rollout]:
        reqs = [
            r if r.rollout_id else r.model_copy(update={"rollout_id": new_id("ro")})
            for r in _logic.coerce_rollout_creates(requests)
        ]
        return await self._post(
            "/rollouts", {"rollouts": [r.model_dump(mode="json") for r in reqs]}, _ROLLOUTS
        )

    async def dequeue(self, worker_id: str) -> AttemptedRollout | None:
        return await self._post(
            "/rollouts/dequeue", {"worker_id": worker_id}, _MAYBE_ATTEMPTED, idempotency_key=True
        )

    async def start_rollout(self, request: RolloutCreate, worker_id: str | None = None) -> AttemptedRollout:
        (req,) = _logic.coerce_rollout_creates([request])
        body = {"rollout": req.model_dump(mode="json"), "worker_id": worker_id}
        return await self._post("/rollouts/start", body, _ATTEMPTED, idempotency_key=True)

    async def update_rollout(
        self, rollout_id: str, *, status: RolloutStatus | None = None, metadata: dict[str, Any] | None = None
    ) -> Rollout:
        body = {"status": None if status is None else RolloutStatus(status).value, "metadata": metadata}
        return _ROLLOUT.validate_python(await self._request("PATCH", f"/rollouts/{rollout_id}", body))

    async def query_rollouts(
        self,
        *,
        status: Sequence[RolloutStatus] | None = None,
        mode: str | None = None,
        group_id: str | None = None,
        rollout_ids: Sequence[str] | None = None,
        order_by: RolloutOrder = "created_at",
        descending: bool = False,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Rollout]:
        body = {
            "status": None if status is None else [RolloutStatus(s).value for s in status],
            "mode": mode,
            "group_id": group_id,
            "rollout_ids": None if rollout_ids is None else list(rollout_ids),
            "order_by": order_by,
            "descending": descending,
            "limit": limit,
            "cursor": cursor,
        }
        return await self._post("/rollouts/query", body, _ROLLOUT_PAGE)

    async def wait_for_rollouts(
        self, rollout_ids: Sequence[str], timeout_s: float | None = None
    ) -> list[Rollout]:
        """Long-polls the server (one request per ``MAX_WAIT_S`` or per completion batch)."""
        ids = list(dict.fromkeys(rollout_ids))
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while True:
            remaining = None if deadline is None else max(deadline - loop.time(), 0.0)
            poll = MAX_WAIT_S if remaining is None else min(remaining, MAX_WAIT_S)
            finished = await self._post(
                "/rollouts/wait",
                {"rollout_ids": ids, "timeout_s": poll},
                _ROLLOUTS,
                timeout_s=poll + self.timeout_s,
            )
            if len(finished) == len(ids) or (deadline is not None and loop.time() >= deadline):
                return finished

    async def _finished(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        return await self.wait_for_rollouts(rollout_ids, timeout_s=0)

    async def next_sequence_id(self, rollout_id: str) -> int:
        return int(await self._request("POST", f"/rollouts/{rollout_id}/sequence_id", idempotency_key=True))

    # ----- attempts -------------------------------------------------------------------------
    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        *,
        status: AttemptStatus | None = None,
        error: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Attempt:
        body = {
            "status": None if status is None else AttemptStatus(status).value,
            "error": error,
            "metadata": metadata,
        }
        path = f"/rollouts/{rollout_id}/attempts/{attempt_id}"
        return _ATTEMPT.validate_python(await self._request("PATCH", path, body))

    async def heartbeat(self, rollout_id: str, attempt_id: str) -> Rollout:
        return await self._post(f"/rollouts/{rollout_id}/attempts/{attempt_id}/heartbeat", None, _ROLLOUT)

    async def query_attempts(
        self,
        *,
        rollout_id: str | None = None,
        status: Sequence[AttemptStatus] | None = None,
        worker_id: str | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> Page[Attempt]:
        body = {
            "rollout_id": rollout_id,
            "status": None if status is None else [AttemptStatus(s).value for s in status],
            "worker_id": worker_id,
            "limit": limit,
            "cursor": cursor,
        }
        return await self._post("/attempts/query", body, _ATTEMPT_PAGE)

    # ----- spans ----------------------------------------------------------------------------
    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        batch = _logic.coerce_spans(spans)
        body = _spans_body(batch)
        stored = _STORED.validate_python(await self._request("POST", "/spans", _Raw(body)))
        by_key = {(s.rollout_id, s.attempt_id, s.span_id): s for s in batch}
        rid = {(s.attempt_id, s.span_id): s.rollout_id for s in batch}
        return [
            by_key[(rid[(st.attempt_id, st.span_id)], st.attempt_id, st.span_id)].model_copy(
                update={"sequence_id": st.sequence_id}
            )
            for st in stored
        ]

    async def query_spans(
        self,
        *,
        rollout_id: str | None = None,
        attempt_id: str | None = None,
        name: str | None = None,
        limit: int = 1000,
        cursor: str | None = None,
    ) -> Page[Span]:
        body = {
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "name": name,
            "limit": limit,
            "cursor": cursor,
        }
        return await self._post("/spans/query", body, _SPAN_PAGE)

    # ----- resources ------------------------------------------------------------------------
    async def add_resources(
        self,
        resources: dict[str, Resource],
        *,
        resources_id: str | None = None,
        parent_id: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> ResourcesVersion:
        named = _logic.coerce_resources(resources)
        body = {
            "resources": {k: v.model_dump(mode="json") for k, v in named.items()},
            "resources_id": resources_id or new_id("rs"),
            "parent_id": parent_id,
            "metadata": metadata,
        }
        return await self._post("/resources", body, _RESOURCES)

    async def get_resources(self, resources_id: str) -> ResourcesVersion:
        return await self._get(f"/resources/{resources_id}", _RESOURCES)

    async def query_resources(
        self, *, descending: bool = False, limit: int = 100, cursor: str | None = None
    ) -> Page[ResourcesVersion]:
        body = {"descending": descending, "limit": limit, "cursor": cursor}
        return await self._post("/resources/query", body, _RESOURCES_PAGE)

    # ----- workers, watchdog ----------------------------------------------------------------
    async def update_worker(
        self, worker_id: str, *, status: WorkerStatus | None = None, host: dict[str, Any] | None = None
    ) -> Worker:
        body = {"status": None if status is None else WorkerStatus(status).value, "host": host}
        return _WORKER.validate_python(await self._request("PUT", f"/workers/{worker_id}", body))

    async def run_watchdog(self) -> list[Attempt]:
        return await self._post("/watchdog", None, TypeAdapter(list[Attempt]))


def _spans_body(spans: list[Span]) -> bytes:
    """The ``POST /spans`` body, with each span as ``spans_json`` writes it."""
    return b'{"spans":[' + b",".join(spans_json(spans)) + b"]}"


class _Raw:
    """A request body already serialized to JSON."""

    def __init__(self, data: bytes) -> None:
        self.data = data


_STORED = TypeAdapter(list[StoredSpan])
_ROLLOUT = TypeAdapter(Rollout)
_ROLLOUTS = TypeAdapter(list[Rollout])
_ATTEMPT = TypeAdapter(Attempt)
_ATTEMPTED = TypeAdapter(AttemptedRollout)
_MAYBE_ATTEMPTED = TypeAdapter(AttemptedRollout | None)
_RESOURCES = TypeAdapter(ResourcesVersion)
_MAYBE_RESOURCES = TypeAdapter(ResourcesVersion | None)
_WORKER = TypeAdapter(Worker)
_ROLLOUT_PAGE = TypeAdapter(Page[Rollout])
_ATTEMPT_PAGE = TypeAdapter(Page[Attempt])
_SPAN_PAGE = TypeAdapter(Page[Span])
_DIGEST_PAGE = TypeAdapter(Page[AttemptDigest])
_MATCHES = TypeAdapter(RolloutMatches)
_RESOURCES_PAGE = TypeAdapter(Page[ResourcesVersion])
_WORKER_PAGE = TypeAdapter(Page[Worker])
