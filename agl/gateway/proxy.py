"""Forward one model call upstream: replica choice, retries with backoff, failover, SSE relay.

Upstream calls use one pooled ``aiohttp.ClientSession`` per gateway: httpx costs several times more CPU
per call and its pool degrades sharply at a few dozen concurrent requests (encode/httpx#3215), which
would make the gateway the bottleneck (see benchmarks/gateway_overhead.py). Given an
``httpx.AsyncBaseTransport`` (the seam for running a gateway without a model server, e.g.
:class:`agl.testing.InMemoryUpstream`), calls go through an ``httpx.AsyncClient`` on it instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import aiohttp
import httpx
import orjson

from agl.gateway.config import GatewayConfig
from agl.gateway.recording import CallRecord, now_ns
from agl.gateway.upstreams import Replica, UpstreamPool
from agl.gateway.validation import API_PATHS, HTTPError

logger = logging.getLogger(__name__)

_SUFFIX = {v: k for k, v in API_PATHS.items()}
_UPSTREAM_ERRORS = (aiohttp.ClientError, httpx.TransportError, TimeoutError)


class _Retry(Exception):
    """A transport error or 5xx from one replica, before anything reached the agent: try again."""


def auth_header(replica: Replica, incoming: str | None) -> dict[str, str]:
    """The upstream's own key when configured, else the agent's Authorization header passed through."""
    if replica.config.api_key:
        return {"authorization": f"Bearer {replica.config.api_key}"}
    return {"authorization": incoming} if incoming else {}


class _Reply(Protocol):
    """An upstream response, whichever client fetched it."""

    status: int
    content_type: str | None

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def release(self) -> None: ...


class _AiohttpReply:
    __slots__ = ("_response", "content_type", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response, self.status = response, response.status
        self.content_type = response.headers.get("content-type")

    async def read(self) -> bytes:
        return await self._response.read()

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.content.iter_any()

    async def release(self) -> None:
        self._response.release()


class _HttpxReply:
    __slots__ = ("_response", "content_type", "status")

    def __init__(self, response: httpx.Response) -> None:
        self._response, self.status = response, response.status_code
        self.content_type = response.headers.get("content-type")

    async def read(self) -> bytes:
        return await self._response.aread()

    def chunks(self) -> AsyncIterator[bytes]:
        return self._response.aiter_bytes()

    async def release(self) -> None:
        await self._response.aclose()


class Forwarder:
    """Sends calls to the pool's replicas; ``open()`` binds it to the running loop.

    ``transport``, when given, carries every upstream request instead of the network (see the module docstring).
    """

    def __init__(
        self, pool: UpstreamPool, config: GatewayConfig, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.pool = pool
        self.config = config
        self.transport = transport
        self._session: aiohttp.ClientSession | None = None
        self._client: httpx.AsyncClient | None = None
        self._health: asyncio.Task[None] | None = None

    def open(self) -> None:
        if self._session is None and self._client is None:
            cfg = self.config
            if self.transport is not None:
                timeout = httpx.Timeout(None, connect=cfg.connect_timeout_s, read=cfg.read_timeout_s)
                self._client = httpx.AsyncClient(transport=self.transport, timeout=timeout)
            else:
                self._session = aiohttp.ClientSession(
                    connector=aiohttp.TCPConnector(limit=cfg.max_connections, limit_per_host=0),
                    timeout=aiohttp.ClientTimeout(
                        total=None, sock_connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
                    ),
                    auto_decompress=False,
                    skip_auto_headers=("User-Agent",),
                )
            self._health = asyncio.get_running_loop().create_task(
                self._health_loop(), name="agl-gateway-health"
            )

    async def aclose(self) -> None:
        if self._health is not None:
            self._health.cancel()
        if self._session is not None:
            await self._session.close()
        if self._client is not None:
            await self._client.aclose()
        self._session = self._client = self._health = None

    async def _request(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        data: bytes | None = None,
        timeout_s: float | None = None,
    ) -> _Reply:
        """Send one request upstream; the caller reads the reply and must release it."""
        if self._client is not None:
            limit = httpx.USE_CLIENT_DEFAULT if timeout_s is None else httpx.Timeout(timeout_s)
            request = self._client.build_request(method, url, content=data, headers=headers, timeout=limit)
            return _HttpxReply(await self._client.send(request, stream=True))
        if self._session is None:
            raise RuntimeError("Forwarder.open() was not called")
        if timeout_s is None:
            return _AiohttpReply(await self._session.request(method, url, data=data, headers=headers))
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        return _AiohttpReply(
            await self._session.request(method, url, data=data, headers=headers, timeout=timeout)
        )

    async def forward(
        self,
        api: str,
        request: dict[str, Any],
        raw: bytes,
        auth: str | None,
        rollout_id: str | None,
        record: CallRecord | None,
        send: Any,
    ) -> tuple[int, float]:
        """Answer the agent through ``send`` from the first replica that works; 502 when none does.

        Returns the status sent and the seconds spent in the upstream exchange (all tries), for metrics.
        """
        model = request.get("model")
        candidates = self.pool.candidates(model if isinstance(model, str) else None, rollout_id, api)
        if not candidates:
            raise HTTPError(
                404, f"no upstream serves model {model!r} on {api}", param="model", code="model_not_found"
            )
        tried: list[Replica] = []
        errors: list[str] = []
        began = time.perf_counter()
        for n in range(self.config.max_attempts):
            replica = next((r for r in candidates if r not in tried), candidates[n % len(candidates)])
            if replica in tried:  # every replica failed once: back off before going round again
                delay = self.config.backoff_s * 2 ** (n - len(candidates))
                await asyncio.sleep(min(delay, self.config.backoff_max_s))
            tried.append(replica)
            if record is not None:
                record.backend = replica.config.backend
            waited = time.perf_counter() - began  # failed tries and backoff count as upstream time
            try:
                status, spent = await self._try(replica, api, request, raw, auth, record, send)
                return status, waited + spent
            except _Retry as exc:
                errors.append(str(exc))
                self.pool.mark_failed(replica, str(exc))
        message = f"upstream failed after {len(errors)} attempts: " + "; ".join(errors[-3:])
        raise HTTPError(502, message, type_="upstream_error", code="upstream_failed")

    def _body(self, replica: Replica, api: str, request: dict[str, Any], raw: bytes) -> bytes:
        """The forwarded body: the agent's, plus the replica kind's token-id fields it did not set."""
        extra = {k: v for k, v in replica.config.fields_for(api).items() if k not in request}
        streamed = request.get("stream") is True and api != "responses"
        if streamed and self.config.stream_usage and "stream_options" not in request:
            extra["stream_options"] = {"include_usage": True}
        return orjson.dumps({**request, **extra}) if extra else raw

    async def _try(
        self,
        replica: Replica,
        api: str,
        request: dict[str, Any],
        raw: bytes,
        auth: str | None,
        record: CallRecord | None,
        send: Any,
    ) -> tuple[int, float]:
        cfg = replica.config
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",
            **auth_header(replica, auth),
        }
        replica.inflight += 1
        replica.calls += 1
        data = self._body(replica, api, request, raw)
        began = time.perf_counter()
        try:
            try:
                response = await self._request("POST", f"{cfg.url}/{_SUFFIX[api]}", headers, data)
            except _UPSTREAM_ERRORS as exc:
                raise _Retry(f"{cfg.backend}: {type(exc).__name__}: {exc}") from exc
            try:
                is_sse = (response.content_type or "").startswith("text/event-stream")
                if request.get("stream") is True and is_sse and response.status < 400:
                    self.pool.mark_ok(replica)
                    await self._relay(response, replica, record, send)
                    return response.status, time.perf_counter() - began
                try:
                    content = await response.read()
                except _UPSTREAM_ERRORS as exc:
                    raise _Retry(f"{cfg.backend}: {type(exc).__name__} reading the response: {exc}") from exc
                spent = time.perf_counter() - began
                if response.status >= 500:
                    raise _Retry(
                        f"{cfg.backend} returned {response.status}: {content[:300].decode(errors='replace')}"
                    )
                self.pool.mark_ok(replica)
                if record is not None:
                    record.status_code, record.response, record.end_ns = response.status, content, now_ns()
                ctype = (response.content_type or "application/json").encode()
                head = [(b"content-type", ctype), (b"content-length", str(len(content)).encode())]
                await send({"type": "http.response.start", "status": response.status, "headers": head})
                await send({"type": "http.response.body", "body": content})
                return response.status, spent
            finally:
                await response.release()
        finally:
            replica.inflight -= 1

    async def _relay(self, response: _Reply, replica: Replica, record: CallRecord | None, send: Any) -> None:
        """Pass SSE chunks through as they arrive, keeping them for the recorder."""
        chunks: list[bytes] = []
        if record is not None:
            record.chunks, record.status_code = chunks, response.status
        head = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": response.status, "headers": head})
        try:
            async for chunk in response.chunks():
                chunks.append(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except _UPSTREAM_ERRORS as exc:  # too late to retry: the agent has part of the answer
            if record is not None:
                record.error = f"the stream from {replica.config.backend} broke: {type(exc).__name__}: {exc}"
            self.pool.mark_failed(replica, str(exc))
        finally:
            if record is not None:
                record.end_ns = now_ns()
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def list_models(self) -> list[str]:
        """Configured model names, plus what the first healthy catch-all replica reports."""
        ids = dict.fromkeys(self.pool.models())
        for replica in [r for r in self.pool.replicas if r.config.models is None and r.healthy][:1]:
            try:
                response = await self._request(
                    "GET", f"{replica.config.url}/models", auth_header(replica, None)
                )
                try:
                    body = orjson.loads(await response.read())
                finally:
                    await response.release()
                ids.update(dict.fromkeys(str(item["id"]) for item in body.get("data", [])))
            except (*_UPSTREAM_ERRORS, ValueError, KeyError, TypeError, AttributeError) as exc:
                logger.warning("could not list the models of %s: %s", replica.config.backend, exc)
        return list(ids)

    async def probe(self, replica: Replica) -> bool:
        """GET the server's ``/health`` (vLLM, agl engine), falling back to ``/v1/models``."""
        root = replica.config.url.removesuffix("/v1")
        for url in (f"{root}/health", f"{replica.config.url}/models"):
            try:
                response = await self._request("GET", url, auth_header(replica, None), timeout_s=2.0)
                status = response.status
                await response.release()
            except _UPSTREAM_ERRORS:
                return False
            if status < 400:
                return True
            if status != 404:
                return False
        return False

    async def _health_loop(self) -> None:
        """Probe unhealthy replicas every ``health_interval_s`` and bring back those that answer."""
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            for replica in [r for r in self.pool.replicas if not r.healthy]:
                if await self.probe(replica):
                    self.pool.mark_ok(replica)
