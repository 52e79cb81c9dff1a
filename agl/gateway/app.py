"""The gateway: an OpenAI-compatible ASGI proxy that attributes each model call to a rollout and records it.

Agents reach it at ``/rollout/{rollout_id}/attempt/{attempt_id}/v1`` (``attempt_id`` may be ``latest``) or
at ``/v1`` with ``x-agl-rollout-id`` / ``x-agl-attempt-id`` headers. Calls without a rollout (production
traffic no trainer queued) are proxied, and recorded only with ``GatewayConfig.record_unattributed``: each
conversation (``x-agl-session-id`` header or OpenAI ``user`` field; else the call alone) becomes a rollout
of mode ``online`` that is written in the background, so an unreachable store never holds a call up
(:mod:`agl.gateway.online`). ``POST /v1/agl/rewards`` records a reward that arrives later for a response,
rollout or session id (:mod:`agl.gateway.rewards`).
The hot path is a raw ASGI handler: attribution is a cached dict lookup, bodies are passed as bytes, and
span building happens in the background recorder. ``GET /metrics`` serves Prometheus metrics.

Besides the OpenAI APIs (chat, completions, Responses, embeddings) it serves the Anthropic Messages API
(``POST .../v1/messages``, also at ``.../v1/v1/messages``, where the anthropic SDK lands when its base URL is
the agent's ``/v1`` endpoint): translated to chat upstream by :mod:`agl.gateway.anthropic`, answered and
failed in Anthropic's shapes, and recorded with the engine's token ids like any chat call.

Auth: with ``token`` (``--token`` / ``AGL_GATEWAY_TOKEN``) ``/admin/*`` and ``/metrics`` need
``Authorization: Bearer <token>``. Model routes stay open unless ``client_token`` is set, because agents
send their own key (forwarded upstream when the upstream has no ``api_key``); with ``client_token`` they
need it (or the admin token), and it is never forwarded; the anthropic SDK's ``x-api-key`` counts as the
bearer token on the Messages route. With ``reward_token`` (``--reward-token`` / ``AGL_GATEWAY_REWARD_TOKEN``)
``POST /v1/agl/rewards`` needs it or the admin token (with only ``token`` set, the admin token); the reward
token is refused (403) everywhere else. ``/health`` is always open.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import re
import time
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from agl import semconv as sc
from agl.asgi_server import BackgroundServer
from agl.errors import GatewayError, NotFoundError, StoreUnavailableError
from agl.gateway import anthropic
from agl.gateway.config import GatewayConfig, UpstreamConfig
from agl.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from agl.gateway.online import Conversation, OnlineRollouts, session_of
from agl.gateway.proxy import Forwarder
from agl.gateway.recording import CallRecord, build_span, now_ns
from agl.gateway.rewards import REWARDS_PATH, Rewards, parse_reward
from agl.gateway.upstreams import UpstreamPool
from agl.gateway.validation import API_PATHS, HTTPError, parse_request, traceparent
from agl.schemas.span import Span
from agl.seeding import ROLLOUT_SEED, derive_seed
from agl.semconv import AGENT_NAME
from agl.store.base import LightningStore
from agl.tracer.writer import SpanWriter

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
_JSON = [(b"content-type", b"application/json")]
_MAX_BODY = 64 * 1024 * 1024
#: on shutdown, how long recorded spans may still wait for an unreachable store before they count failed
_CLOSE_TIMEOUT_S = 5.0


class Gateway:
    """``Gateway(store, upstreams=[url, ...])``: ``await gw.app(scope, receive, send)`` or ``gw.start()``.

    ``upstreams`` are base URLs (``http://host:port/v1``) or :class:`UpstreamConfig`. ``start()`` serves on a
    background thread (port 0: a free port); ``stop()`` drains the recorder into the store. ``token`` guards
    the admin routes, ``client_token`` the model routes and ``reward_token`` the rewards route (see the module
    docstring). ``transport`` carries
    upstream requests instead of the network, to run a gateway without a model server (for example
    ``agl.testing.InMemoryUpstream().transport``, or any ``httpx`` transport). ``agent_models`` routes each
    agent's calls (agent endpoint or ``x-agl-agent``) that name ``policy_model`` or no model to the agent's
    own model (e.g. its LoRA adapter): ``{"solver": "solver"}``.
    """

    def __init__(
        self,
        store: LightningStore,
        upstreams: Sequence[str | UpstreamConfig],
        config: GatewayConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        client_token: str | None = None,
        reward_token: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        agent_models: Mapping[str, str] | None = None,
        policy_model: str = "policy",
    ) -> None:
        if not upstreams:
            raise GatewayError("a gateway needs at least one upstream URL (e.g. http://127.0.0.1:8000/v1)")
        self.store = store
        self.config = config or GatewayConfig()
        self.upstreams = [u if isinstance(u, UpstreamConfig) else UpstreamConfig(url=u) for u in upstreams]
        self.pool = UpstreamPool(self.upstreams)
        self.agent_models, self.policy_model = dict(agent_models or {}), policy_model
        self.forwarder = Forwarder(self.pool, self.config, transport)
        self.paused = False
        self.inflight = 0
        self._drained = asyncio.Event()
        self._admin_auth = f"Bearer {token}".encode() if token else None
        self._client_auth = f"Bearer {client_token}".encode() if client_token else None
        self._reward_auth = f"Bearer {reward_token}".encode() if reward_token else None
        secrets = (token, client_token, reward_token, *(u.api_key for u in self.upstreams))
        self._secrets = tuple(s for s in secrets if s)
        self.metrics = GatewayMetrics(self.stats)
        # (rollout, attempt) -> (attempt, resources id, the attempt's sampling seed or None)
        self._attribution: dict[tuple[str, str], tuple[str, str | None, int | None]] = {}
        self._calls: dict[str, int] = {}  # a seeded attempt's model calls so far (its next call's index)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        # one writer for the gateway's life: its counters survive restarts; backoff is capped low (one
        # request every 2 s at most while the store is down) so spans flow again soon after it returns
        self.spans = SpanWriter(
            store,
            who="gateway",
            queue_size=self.config.queue_size,
            batch_size=self.config.batch_size,
            deadline_s=self.config.span_deadline_s,
            backoff_s=0.2,
            max_backoff_s=2.0,
        )
        self.online = OnlineRollouts(
            store,
            self._submit,
            self.spans.outage,
            cache_size=self.config.attribution_cache_size,
            queue_size=self.config.queue_size,
            deadline_s=self.config.span_deadline_s,
        )
        self.rewards = Rewards(
            store,
            self.online,
            self._flush,
            index_size=self.config.response_index_size,
            scan_rollouts=self.config.reward_scan_rollouts,
        )
        self._server = BackgroundServer(
            self.app, host=host, port=port, interface="asgi3", proxy_headers=False
        )

    # ----- lifecycle ------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._server.url

    @property
    def base_url(self) -> str:
        """The unattributed OpenAI base URL."""
        return f"{self.url}/v1"

    @property
    def endpoint_template(self) -> str:
        """An ``LLM.endpoint`` the runner scopes per rollout (see :meth:`agl.schemas.LLM.base_url`)."""
        return f"{self.url}/rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1"

    def rollout_base_url(self, rollout_id: str, attempt_id: str = "latest") -> str:
        return f"{self.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"

    def start(self) -> Gateway:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()  # the lifespan shutdown flushes the recorder

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _runtime(self) -> None:
        """The upstream session and health task, opened on first use in the serving loop."""
        if not self._started:
            self._started = True
            self._loop = asyncio.get_running_loop()
            self.forwarder.open()

    def _span(self, record: CallRecord) -> Span:
        """Build a call's span on the writer's task, counting its tokens (so metrics cover recorded calls)."""
        span = build_span(record)
        self.metrics.add_tokens(span.attributes.get(sc.LLM_USAGE))
        self.rewards.remember(span)
        return span

    def _submit(self, record: CallRecord) -> bool:
        """Queue a finished call's span (built later, on the writer's task)."""
        return self.spans.submit(functools.partial(self._span, record))

    async def aclose(self) -> None:
        """Flush recorded spans and close upstream connections (the lifespan shutdown calls this)."""
        await self.online.aclose(timeout_s=_CLOSE_TIMEOUT_S)
        await self.spans.aclose(timeout_s=_CLOSE_TIMEOUT_S)
        await self.forwarder.aclose()
        self._started, self._loop = False, None
        from agl.store.client import LightningStoreClient

        if isinstance(
            self.store, LightningStoreClient
        ):  # drops only this loop's pool; the client stays usable
            await self.store.aclose()

    async def _on_loop(self, coro_fn: Any) -> Any:
        """Run ``coro_fn()`` on the serving loop (callers may live on another loop or thread)."""
        loop, current = self._loop, asyncio.get_running_loop()
        if loop is None or loop is current or loop.is_closed():
            return await coro_fn()
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro_fn(), loop))

    # ----- control --------------------------------------------------------------------------
    async def pause(self, timeout_s: float | None = None) -> dict[str, float]:
        """Refuse new calls (429 + Retry-After) and return once in-flight calls have finished."""
        return dict(await self._on_loop(lambda: self._pause(timeout_s)))

    async def _pause(self, timeout_s: float | None) -> dict[str, float]:
        self.paused = True
        start, at_pause = time.monotonic(), self.inflight
        if self.inflight:
            self._drained.clear()
            try:
                await asyncio.wait_for(self._drained.wait(), timeout_s)
            except TimeoutError:
                raise GatewayError(
                    f"{self.inflight} calls still in flight after {timeout_s}s; the gateway stays paused"
                ) from None
        return {"inflight_at_pause": float(at_pause), "drain_s": round(time.monotonic() - start, 4)}

    async def resume(self) -> None:
        self.paused = False

    async def flush(self) -> None:
        """Return once every call finished so far is in the store."""
        await self._on_loop(self._flush)

    async def _flush(self) -> None:
        await self.online.flush()  # online rollouts first: their calls' spans are queued once they exist
        await self.spans.flush()

    def stats(self) -> dict[str, Any]:
        w = self.spans.stats
        return {
            "paused": self.paused,
            "inflight": self.inflight,
            "recorded_spans": w.written,
            "dropped_spans": w.dropped,
            "failed_spans": w.failed,
            "queued_spans": self.spans.queued,
            "span_store_errors": w.store_errors,
            "online_rollouts": self.online.created,
            "online_waiting_spans": self.online.waiting,
            "online_dropped_spans": self.online.dropped,
            "online_failed_spans": self.online.failed,
            "rewards_recorded": self.rewards.recorded,
            "rewards_duplicate": self.rewards.duplicates,
            "upstreams": [
                {
                    "backend": r.config.backend,
                    "healthy": r.healthy,
                    "inflight": r.inflight,
                    "calls": r.calls,
                    "failures": r.failures,
                }
                for r in self.pool.replicas
            ],
        }

    # ----- ASGI -----------------------------------------------------------------------------
    async def app(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            await self._route(scope, receive, send)
        except HTTPError as exc:
            if scope.get("agl.anthropic"):  # the anthropic SDK reads only its own error shape
                await _send_json(send, exc.status, anthropic.error_body(exc.status, exc.message), exc.headers)
            else:
                await _send_error(send, exc)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._runtime()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _route(self, scope: Scope, receive: Any, send: Any) -> None:
        path, method = scope["path"], scope["method"]
        rollout_id = attempt_id = None
        if path.startswith("/rollout/"):
            parts = path.split("/", 6)  # '', rollout, rid, attempt, aid, v1, rest
            if len(parts) >= 6 and parts[3] == "attempt" and parts[2] and parts[4]:
                rollout_id, attempt_id, path = parts[2], parts[4], "/" + "/".join(parts[5:])
                if path.startswith("/agent/"):  # /rollout/<id>/attempt/<id>/agent/<name>/v1: tag the agent
                    agent, _, rest = path[len("/agent/") :].partition("/")
                    if not _AGENT.fullmatch(agent):
                        raise HTTPError(
                            400,
                            f"bad agent name {agent!r} in {scope['path']}: use 1-128 letters, digits or '_.:-'",
                            param="agent",
                            code="invalid_agent",
                        )
                    scope["agl.agent"], path = agent, "/" + rest
            else:
                raise HTTPError(
                    404, f"unknown path {scope['path']}; use /rollout/<id>/attempt/<id|latest>/v1/..."
                )
        if path.startswith("/v1/v1/messages"):  # the anthropic SDK's /v1/messages after an agent's /v1 URL
            path = path[3:]
        if path.startswith("/v1/messages"):
            scope["agl.anthropic"] = True
            if path != "/v1/messages":
                raise HTTPError(404, f"{scope['path']} is not served; the gateway serves POST /v1/messages")
            _need(method, "POST", path)
            await self._model_call(scope, receive, send, ANTHROPIC_API, rollout_id, attempt_id)
            return
        if path == REWARDS_PATH and rollout_id is None:
            _need(method, "POST", path)
            await self._reward(scope, receive, send)
            return
        if path.startswith("/v1/"):
            api = API_PATHS.get(path[4:])
            if api is not None:
                _need(method, "POST", path)
                await self._model_call(scope, receive, send, api, rollout_id, attempt_id)
                return
            if path == "/v1/models":
                _need(method, "GET", path)
                self._authorize(scope, self._client_auth)
                await _send_json(send, 200, await self._models())
                return
        await self._admin(path, method, scope, receive, send)

    def _authorize(self, scope: Scope, expected: bytes | None) -> bool:
        """True if a required token was given (then it is the gateway's, not the agent's); 401 if wrong,
        403 for the reward token anywhere but the rewards route (even on open model routes: never forwarded)."""
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        if not given and scope.get("agl.anthropic"):
            given = b"Bearer " + next((v for k, v in scope["headers"] if k == b"x-api-key"), b"")
        admin, reward = self._admin_auth, self._reward_auth
        if reward is not None and expected is not reward and hmac.compare_digest(given, reward):
            raise HTTPError(
                403,
                f"the reward token (AGL_GATEWAY_REWARD_TOKEN) may only POST {REWARDS_PATH}",
                type_="permission_error",
                code="reward_token_only",
            )
        if expected is None:
            return False
        if hmac.compare_digest(given, expected) or (admin is not None and hmac.compare_digest(given, admin)):
            return True
        if expected is admin:
            which = "AGL_GATEWAY_TOKEN"
        else:
            which = "AGL_GATEWAY_REWARD_TOKEN" if expected is reward else "AGL_GATEWAY_CLIENT_TOKEN"
        raise HTTPError(
            401,
            f"missing or wrong bearer token; send Authorization: Bearer <token> ({which})",
            type_="authentication_error",
            code="invalid_api_key",
        )

    async def _admin(self, path: str, method: str, scope: Scope, receive: Any, send: Any) -> None:
        if path == "/health":
            await _send_json(send, 200, {"status": "ok", "paused": self.paused})
            return
        if path.startswith("/admin/") or path == "/metrics":
            self._authorize(scope, self._admin_auth)
        if path == "/metrics":
            _need(method, "GET", path)
            body = self.metrics.render()
            head = [(b"content-type", CONTENT_TYPE.encode()), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 200, "headers": head})
            await send({"type": "http.response.body", "body": body})
        elif path == "/admin/stats":
            await _send_json(send, 200, self.stats())
        elif path == "/admin/pause":
            _need(method, "POST", path)
            await _send_json(send, 200, {"paused": True, **(await self._pause(None))})
        elif path == "/admin/resume":
            _need(method, "POST", path)
            await self.resume()
            await _send_json(send, 200, {"paused": False})
        elif path == "/admin/flush":
            _need(method, "POST", path)
            await self._flush()
            await _send_json(send, 200, {"flushed": True})
        else:
            raise HTTPError(404, f"unknown path {scope['path']}", code="not_found")

    async def _reward(self, scope: Scope, receive: Any, send: Any) -> None:
        """``POST /v1/agl/rewards``: a late reward, written before the answer (503 while the store is down)."""
        self._authorize(scope, self._reward_auth or self._admin_auth)
        self._runtime()
        headers = dict(scope["headers"])
        post = parse_reward(await _read_body(receive), _header(headers, b"idempotency-key"))
        try:
            answer = await self.rewards.post(post)
        except StoreUnavailableError as exc:
            raise self._store_down("the reward is not recorded", f"(it is idempotent) ({exc})") from None
        await _send_json(send, 200, answer)

    async def _models(self) -> dict[str, Any]:
        self._runtime()
        ids = await self.forwarder.list_models()
        return {"object": "list", "data": [{"id": m, "object": "model", "owned_by": "agl"} for m in ids]}

    # ----- model calls ----------------------------------------------------------------------
    async def _model_call(
        self, scope: Scope, receive: Any, send: Any, api: str, rollout_id: str | None, attempt_id: str | None
    ) -> None:
        try:
            gateway_key = self._authorize(scope, self._client_auth)
        except HTTPError as exc:
            self.metrics.count(api, exc.status)
            raise
        if self.paused:
            self.metrics.count(api, 429)
            raise HTTPError(
                429,
                f"the gateway is paused for a model update; retry after {self.config.retry_after_s} s",
                type_="rate_limit_error",
                code="gateway_paused",
                headers=[(b"retry-after", str(self.config.retry_after_s).encode())],
            )
        self._runtime()
        self.inflight += 1
        began, status, upstream_s = time.perf_counter(), 500, None
        try:
            start = now_ns()
            headers = dict(scope["headers"])
            raw = await _read_body(receive)
            if api == ANTHROPIC_API and b"authorization" not in headers and b"x-api-key" in headers:
                headers[b"authorization"] = (
                    b"Bearer " + headers[b"x-api-key"]
                )  # the anthropic SDK's key header
            rollout_id = rollout_id or _header(headers, b"x-agl-rollout-id")
            attempt_id = attempt_id or _header(headers, b"x-agl-attempt-id") or "latest"
            target = await self._attribute(rollout_id, attempt_id)
            online: Conversation | None = None
            if target is None and rollout_id is None and self.config.record_unattributed:
                online = self.online.conversation(session_of(headers, raw))  # no store call: never waits
                target = (online.rollout_id, online.attempt_id or "", None, None)
            auth = None if gateway_key else _header(headers, b"authorization")
            record = None
            agent = scope.get("agl.agent") or _header(headers, b"x-agl-agent")
            if agent is not None and not _AGENT.fullmatch(agent):
                raise HTTPError(
                    400, f"bad x-agl-agent header {agent!r}", param="x-agl-agent", code="invalid_agent"
                )
            if target is not None:
                trace = traceparent(_header(headers, b"traceparent"))
                record = CallRecord(
                    target[0],
                    target[1],
                    target[2],
                    api,
                    {},
                    start,
                    secrets=self._secrets + ((auth.removeprefix("Bearer ").strip(),) if auth else ()),
                    trace_id=trace[0] if trace else None,
                    parent_id=trace[1] if trace else None,
                )
                if agent:
                    record.tags[AGENT_NAME] = agent
            try:
                if (
                    api == ANTHROPIC_API
                ):  # translated to chat: the upstream serves chat, the agent sees Messages
                    given = anthropic.parse(raw)
                    if record is not None:
                        record.request = given
                    request = self._for_agent(agent, anthropic.to_chat(given), b"")[0]
                    if record is not None:
                        record.tags[sc.LLM_REQUEST_MESSAGES] = request["messages"]
                    request = self._seeded(target, "chat.completions", request, b"")[0]
                    raw = orjson.dumps(request)
                    send = anthropic.ASGITranslator(send, given, lambda: record.error if record else None)
                    forward_api = "chat.completions"
                else:
                    request, forward_api = parse_request(api, raw), api
                    request, raw = self._for_agent(agent, request, raw)
                    request, raw = self._seeded(target, forward_api, request, raw)
                    if record is not None:
                        record.request = request
                status, upstream_s = await self.forwarder.forward(
                    forward_api, request, raw, auth, rollout_id, record, send
                )
            except HTTPError as exc:
                status = exc.status
                if record is not None:
                    record.status_code, record.error, record.end_ns = exc.status, exc.message, now_ns()
                    if not record.request:
                        record.request = {"_raw": raw[:4096].decode(errors="replace")}
                raise
            finally:
                if record is not None:
                    record.end_ns = record.end_ns or now_ns()
                    if online is not None:
                        self.online.record(online, record)
                    else:
                        self._submit(record)
        except HTTPError as exc:
            status = exc.status
            raise
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._drained.set()
            self.metrics.observe(api, status, time.perf_counter() - began, upstream_s)

    def _store_down(self, consequence: str, detail: str) -> HTTPError:
        """A 503 for a store that cannot be reached, with when to retry."""
        after = self.config.retry_after_s
        return HTTPError(
            503,
            f"the store is unreachable, so {consequence}; retry after {after} s {detail}",
            code="store_unavailable",
            headers=[(b"retry-after", str(after).encode())],
        )

    def _for_agent(
        self, agent: str | None, request: dict[str, Any], raw: bytes
    ) -> tuple[dict[str, Any], bytes]:
        """The request (and body) sent to the agent's own model (``agent_models``) when it names the
        policy or no model; any other model name (a teacher's) goes where it says."""
        own = self.agent_models.get(agent) if agent else None
        if own is None or request.get("model") not in (None, self.policy_model):
            return request, raw
        routed = {**request, "model": own}
        return routed, orjson.dumps(routed)

    def _seeded(
        self, target: _Target | None, api: str, request: dict[str, Any], raw: bytes
    ) -> tuple[dict[str, Any], bytes]:
        """The request (and body) with a sampling ``seed`` when its attempt is seeded and it sets none: the
        attempt's seed and the call's index in the attempt, so a rerun samples each call the same way."""
        if target is None or target[3] is None or api == "embeddings" or "seed" in request:
            return request, raw
        index = self._calls.get(target[1], 0)
        if target[1] not in self._calls and len(self._calls) >= max(self.config.attribution_cache_size, 1):
            self._calls.pop(next(iter(self._calls)))
        self._calls[target[1]] = index + 1
        seeded = {**request, "seed": derive_seed(target[3], index)}
        return seeded, orjson.dumps(seeded)

    async def _attribute(self, rollout_id: str | None, attempt_id: str) -> _Target | None:
        """``(rollout_id, attempt_id, resources_id, seed)`` the call belongs to (``seed``: its attempt's
        sampling seed, from the rollout's :data:`~agl.seeding.ROLLOUT_SEED`), or None when it names no rollout."""
        if rollout_id is None:  # unrecorded, or an online rollout's call (see _model_call)
            return None
        cached = self._attribution.get((rollout_id, attempt_id))
        if cached is not None:
            return rollout_id, *cached
        try:
            rollout = await self.store.get_rollout(rollout_id)
            attempts = (await self.store.query_attempts(rollout_id=rollout_id, limit=1000)).items
        except NotFoundError:
            raise HTTPError(
                404, f"unknown rollout {rollout_id!r}", param="rollout_id", code="rollout_not_found"
            ) from None
        except StoreUnavailableError as exc:  # calls of attempts seen before go on; new ones must wait
            raise self._store_down(
                f"the call cannot be attributed to rollout {rollout_id!r}", f"({exc})"
            ) from None
        if attempt_id == "latest":
            if not attempts:
                raise HTTPError(
                    404,
                    f"rollout {rollout_id!r} has no attempt yet",
                    param="attempt_id",
                    code="attempt_not_found",
                )
            latest = max(attempts, key=lambda a: a.attempt_number)
            return (
                rollout_id,
                latest.attempt_id,
                rollout.resources_id,
                _seed(rollout.metadata, latest.attempt_number),
            )
        attempt = next((a for a in attempts if a.attempt_id == attempt_id), None)
        if attempt is None:
            raise HTTPError(
                404,
                f"rollout {rollout_id!r} has no attempt {attempt_id!r}",
                param="attempt_id",
                code="attempt_not_found",
            )
        if len(self._attribution) >= self.config.attribution_cache_size > 0:
            self._attribution.pop(next(iter(self._attribution)))
        seed = _seed(rollout.metadata, attempt.attempt_number)
        if self.config.attribution_cache_size:
            self._attribution[(rollout_id, attempt_id)] = (attempt_id, rollout.resources_id, seed)
        return rollout_id, attempt_id, rollout.resources_id, seed


ANTHROPIC_API = "anthropic.messages"
#: ``(rollout_id, attempt_id, resources_id, sampling seed)`` of an attributed call
_Target = tuple[str, str, str | None, int | None]


def _seed(metadata: dict[str, Any] | None, attempt_number: int) -> int | None:
    """An attempt's sampling seed: its rollout's seed and its number (a retry samples afresh), or None."""
    seed = (metadata or {}).get(ROLLOUT_SEED)
    return derive_seed(int(seed), attempt_number) if isinstance(seed, int) else None


_AGENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return value.decode("latin-1") if value else None


def _need(method: str, expected: str, path: str) -> None:
    if method != expected:
        raise HTTPError(405, f"{path} takes {expected}, got {method}", code="method_not_allowed")


async def _read_body(receive: Any) -> bytes:
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise HTTPError(400, "the client disconnected before sending the whole body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_BODY:
            raise HTTPError(413, f"the request body is over {_MAX_BODY} bytes", code="body_too_large")
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts) if len(parts) != 1 else parts[0]


async def _send_json(
    send: Any, status: int, value: Any, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = orjson.dumps(value)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [*_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])],
        }
    )
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Any, exc: HTTPError) -> None:
    await _send_json(send, exc.status, exc.body(), exc.headers)
