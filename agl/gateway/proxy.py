"""Forward one model call upstream: replica choice, retries with backoff, failover, SSE relay.

Upstream calls use one pooled ``aiohttp.ClientSession`` per gateway: httpx costs several times more CPU
per call and its pool degrades sharply at a few dozen concurrent requests (encode/httpx#3215), which
would make the gateway the bottleneck (see benchmarks/gateway_overhead.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import orjson

from agl.gateway.config import GatewayConfig
from agl.gateway.recording import CallRecord, now_ns
from agl.gateway.upstreams import Replica, UpstreamPool
from agl.gateway.validation import API_PATHS, HTTPError

logger = logging.getLogger(__name__)

_SUFFIX = {v: k for k, v in API_PATHS.items()}
_UPSTREAM_ERRORS = (aiohttp.ClientError, TimeoutError)


class _Retry(Exception):
    """A transport error or 5xx from one replica, before anything reached the agent: try again."""


def auth_header(replica: Replica, incoming: str | None) -> dict[str, str]:
    """The upstream's own key when configured, else the agent's Authorization header passed through."""
    if replica.config.api_key:
        return {"authorization": f"Bearer {replica.config.api_key}"}
    return {"authorization": incoming} if incoming else {}


class Forwarder:
    """Sends calls to the pool's replicas; ``open()`` binds it to the running loop."""

    def __init__(self, pool: UpstreamPool, config: GatewayConfig) -> None:
        self.pool = pool
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._health: asyncio.Task[None] | None = None

    def open(self) -> None:
        if self._session is None:
            cfg = self.config
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
        self._session = self._health = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Forwarder.open() was not called")
        return self._session

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
                response = await self.session.post(f"{cfg.url}/{_SUFFIX[api]}", data=data, headers=headers)
            except _UPSTREAM_ERRORS as exc:
                raise _Retry(f"{cfg.backend}: {type(exc).__name__}: {exc}") from exc
            try:
                is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
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
                ctype = response.headers.get("content-type", "application/json").encode()
                head = [(b"content-type", ctype), (b"content-length", str(len(content)).encode())]
                await send({"type": "http.response.start", "status": response.status, "headers": head})
                await send({"type": "http.response.body", "body": content})
                return response.status, spent
            finally:
                response.release()
        finally:
            replica.inflight -= 1

    async def _relay(
        self, response: aiohttp.ClientResponse, replica: Replica, record: CallRecord | None, send: Any
    ) -> None:
        """Pass SSE chunks through as they arrive, keeping them for the recorder."""
        chunks: list[bytes] = []
        if record is not None:
            record.chunks, record.status_code = chunks, response.status
        head = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": response.status, "headers": head})
        try:
            async for chunk in response.content.iter_any():
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
                url = f"{replica.config.url}/models"
                async with self.session.get(url, headers=auth_header(replica, None)) as response:
                    body = orjson.loads(await response.read())
                ids.update(dict.fromkeys(str(item["id"]) for item in body.get("data", [])))
            except (*_UPSTREAM_ERRORS, ValueError, KeyError, TypeError, AttributeError) as exc:
                logger.warning("could not list the models of %s: %s", replica.config.backend, exc)
        return list(ids)

    async def probe(self, replica: Replica) -> bool:
        """GET the server's ``/health`` (vLLM, agl engine), falling back to ``/v1/models``."""
        root = replica.config.url.removesuffix("/v1")
        timeout = aiohttp.ClientTimeout(total=2.0)
        for url in (f"{root}/health", f"{replica.config.url}/models"):
            try:
                async with self.session.get(
                    url, headers=auth_header(replica, None), timeout=timeout
                ) as response:
                    status = response.status
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
