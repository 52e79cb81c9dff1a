"""The dashboard as an ASGI app: a static page under ``/ui`` and its JSON API under ``/ui/api``.

It reads everything through the async :class:`LightningStore` API, so it serves a local backend (inside
``agl store serve``) or a remote one (``agl dashboard --store URL``, through ``LightningStoreClient``)
alike. With a token, every ``/ui/api`` call needs ``Authorization: Bearer <token>``; the page and its
scripts hold no data and load without it (the page takes the token from ``?token=`` once and keeps it
in the tab's sessionStorage).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agl import errors
from agl import semconv as sc
from agl.adapter.rewards import final_reward
from agl.dashboard import views
from agl.schemas import Rollout, RolloutStatus, Span
from agl.store.base import LightningStore

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
PREFIX = "/ui"
#: finished rollouts the reward charts look back over (newest first)
CURVE_ROLLOUTS = 5000
#: spans of one attempt shown on its page (the first ones by sequence id)
MAX_SPANS = 10_000
#: uncached rollouts beyond which rewards are read by one scan of the store's reward spans
BULK_AFTER = 64
#: how long one computation of the curves serves every poll (several tabs, the resources page)
CURVES_TTL_S = 1.5
_FINISHED = [RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED]
Handler = Callable[[Request], Awaitable[Any]]


class BadRequest(Exception):
    """A query parameter the API cannot use; answered 422 naming the parameter."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


def _error(status: int, type_name: str, message: str, field: str | None = None) -> JSONResponse:
    body = {"type": type_name, "message": message, **({"field": field} if field else {})}
    return JSONResponse({"error": body}, status_code=status)


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(name, f"{name} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise BadRequest(name, f"{name} must be between {low} and {high}, got {value}")
    return value


def _statuses(request: Request) -> list[RolloutStatus] | None:
    raw = request.query_params.get("status")
    if not raw:
        return None
    known = {s.value: s for s in RolloutStatus}
    unknown = [s for s in raw.split(",") if s not in known]
    if unknown:
        raise BadRequest("status", f"unknown status {unknown}; use any of {sorted(known)}, comma-separated")
    return [known[s] for s in raw.split(",")]


class RewardCache:
    """Final reward per rollout, read from its latest attempt's reward spans and kept once it is finished."""

    def __init__(self, store: LightningStore, max_entries: int = 200_000) -> None:
        self.store, self.max_entries = store, max_entries
        self._done: dict[str, float | None] = {}
        self._gate = asyncio.Semaphore(16)

    async def _read(self, rollout: Rollout) -> float | None:
        if rollout.rollout_id in self._done:
            return self._done[rollout.rollout_id]
        async with self._gate:
            page = await self.store.query_spans(
                rollout_id=rollout.rollout_id, attempt_id="latest", name=sc.SPAN_REWARD, limit=10_000
            )
        reward = final_reward(page.items)
        if rollout.status.is_terminal:
            if len(self._done) >= self.max_entries:
                self._done.clear()
            self._done[rollout.rollout_id] = reward
        return reward

    async def rewards(self, rollouts: list[Rollout]) -> list[float | None]:
        missing = [r for r in rollouts if r.rollout_id not in self._done]
        if len(missing) > BULK_AFTER:  # one scan of all reward spans beats thousands of small queries
            await self._scan(missing)
        return list(await asyncio.gather(*(self._read(r) for r in rollouts)))

    async def _scan(self, rollouts: list[Rollout]) -> None:
        wanted = {r.rollout_id: r for r in rollouts if r.status.is_terminal}
        found: dict[str, list[Span]] = {}
        cursor = None
        while True:
            page = await self.store.query_spans(
                attempt_id="latest", name=sc.SPAN_REWARD, limit=10_000, cursor=cursor
            )
            for span in page.items:
                if span.rollout_id in wanted:
                    found.setdefault(span.rollout_id, []).append(span)
            if (cursor := page.next_cursor) is None:
                break
        if len(self._done) + len(wanted) >= self.max_entries:
            self._done.clear()
        for rollout_id in wanted:
            self._done[rollout_id] = final_reward(found.get(rollout_id, []))


def create_dashboard(
    store: LightningStore, *, token: str | None = None, metrics_dir: str | Path | None = None
) -> Starlette:
    """The dashboard over ``store``: the page at ``/ui/``, the JSON API at ``/ui/api/...``.

    ``metrics_dir`` is a training output directory; its ``metrics.csv`` files become charts.
    """
    expected = f"Bearer {token}".encode() if token else None
    metrics_path = Path(metrics_dir) if metrics_dir is not None else None
    cache = RewardCache(store)

    def api(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            if expected is not None:
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, expected):
                    return _error(
                        401,
                        "UnauthorizedError",
                        "missing or wrong bearer token; open the dashboard as /ui/?token=<token>",
                    )
            try:
                return JSONResponse(await handler(request))
            except BadRequest as exc:
                return _error(422, "ValidationError", exc.message, exc.field)
            except errors.NotFoundError as exc:
                return _error(404, type(exc).__name__, exc.message)
            except errors.StoreUnavailableError as exc:
                return _error(503, type(exc).__name__, exc.message)
            except errors.AglError as exc:
                return _error(400, type(exc).__name__, exc.message, getattr(exc, "param", None))

        return endpoint

    async def summary(request: Request) -> dict[str, Any]:
        stats = await store.statistics()
        latest = await store.get_latest_resources()
        return {
            "statistics": stats.model_dump(mode="json"),
            "latest_resources_id": latest.resources_id if latest else None,
            "metrics": metrics_path is not None,
        }

    async def rollouts(request: Request) -> dict[str, Any]:
        limit = _int(request, "limit", 50, 1, 1000)
        page = await store.query_rollouts(
            status=_statuses(request),
            mode=request.query_params.get("mode") or None,
            order_by="created_at",
            descending=True,
            limit=limit,
            cursor=request.query_params.get("cursor") or None,
        )
        rewards = await cache.rewards(page.items)
        return {
            "items": [views.rollout_view(r, w) for r, w in zip(page.items, rewards, strict=True)],
            "next_cursor": page.next_cursor,
        }

    async def rollout(request: Request) -> dict[str, Any]:
        rollout_id = request.path_params["rollout_id"]
        found = await store.get_rollout(rollout_id)
        attempts = (await store.query_attempts(rollout_id=rollout_id, limit=1000)).items
        attempt_id = request.query_params.get("attempt_id") or (attempts[-1].attempt_id if attempts else None)
        if attempt_id is not None and attempt_id not in {a.attempt_id for a in attempts}:
            raise BadRequest("attempt_id", f"rollout {rollout_id!r} has no attempt {attempt_id!r}")
        spans: list[Span] = []
        more = None
        if attempt_id is not None:
            page = await store.query_spans(rollout_id=rollout_id, attempt_id=attempt_id, limit=MAX_SPANS)
            spans, more = page.items, page.next_cursor
        return {
            "rollout": views.rollout_view(found, final_reward(spans)),
            "attempts": [a.model_dump(mode="json") for a in attempts],
            "attempt_id": attempt_id,
            "spans": views.span_tree(spans),
            "spans_truncated": more is not None,
        }

    async def resources(request: Request) -> dict[str, Any]:
        versions = []
        cursor = None
        while True:
            page = await store.query_resources(limit=1000, cursor=cursor)
            versions.extend(page.items)
            if (cursor := page.next_cursor) is None:
                break
        by_version = (await curves(request))["by_version"]
        scores = {row["resources_id"]: row for row in by_version}
        out = []
        for version in reversed(versions):  # newest first
            view = views.version_view(version)
            row = scores.get(version.resources_id, {})
            view["val_reward"], view["train_reward"] = row.get("val_mean"), row.get("train_mean")
            out.append(view)
        return {"items": out}

    async def resources_diff(request: Request) -> dict[str, Any]:
        version = await store.get_resources(request.path_params["resources_id"])
        against = request.query_params.get("against") or views.diff_parent(version)
        old = await store.get_resources(against) if against else None
        return {
            "resources_id": version.resources_id,
            "against": against,
            "diff": views.resources_diff(old, version),
        }

    last_curves: list[Any] = [0.0, None]  # (monotonic time, answer)

    async def curves(request: Request) -> dict[str, Any]:
        if last_curves[1] is None or time.monotonic() - last_curves[0] > CURVES_TTL_S:
            last_curves[:] = [time.monotonic(), await compute_curves()]
        return last_curves[1]  # type: ignore[no-any-return]

    async def compute_curves() -> dict[str, Any]:
        """Reward of recently finished rollouts, over time and as a mean per resources version and mode."""
        found: list[Rollout] = []
        cursor = None
        while len(found) < CURVE_ROLLOUTS:
            page = await store.query_rollouts(
                status=_FINISHED, order_by="updated_at", descending=True, limit=1000, cursor=cursor
            )
            found.extend(page.items)
            if (cursor := page.next_cursor) is None:
                break
        found = found[:CURVE_ROLLOUTS][::-1]
        rewards = await cache.rewards(found)
        points: list[dict[str, Any]] = [
            {
                "rollout_id": r.rollout_id,
                "t": r.ended_at or r.updated_at,
                "reward": w,
                "mode": r.mode,
                "resources_id": r.resources_id,
            }
            for r, w in zip(found, rewards, strict=True)
            if w is not None
        ]
        sums: dict[tuple[str | None, str], list[float]] = {}
        for p in points:
            sums.setdefault((p["resources_id"], p["mode"]), []).append(p["reward"])
        order: dict[str | None, int] = {}
        for p in points:
            order.setdefault(p["resources_id"], len(order))
        versions = {}
        for rid in order:
            if rid is not None:
                try:
                    versions[rid] = (await store.get_resources(rid)).version
                except errors.NotFoundError:
                    continue
        by_version = []
        for rid in sorted(order, key=lambda r: (versions.get(r, -1) if r else -1, order[r])):
            row: dict[str, Any] = {"resources_id": rid, "version": versions.get(rid) if rid else None}
            for mode in ("train", "val"):
                values = sums.get((rid, mode), [])
                row[f"{mode}_mean"] = sum(values) / len(values) if values else None
                row[f"{mode}_count"] = len(values)
            by_version.append(row)
        return {"points": points, "by_version": by_version}

    async def metrics(request: Request) -> dict[str, Any]:
        if metrics_path is None:
            return {"runs": [], "configured": False}
        return {"runs": await asyncio.to_thread(views.read_metrics, metrics_path), "configured": True}

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def to_index(request: Request) -> Response:
        query = f"?{request.url.query}" if request.url.query else ""
        return RedirectResponse(f"{PREFIX}/{query}", status_code=307)

    async def unknown_api(request: Request) -> Response:
        return _error(404, "NotFoundError", f"no dashboard API at {request.url.path}")

    routes = [
        Route("/", index),
        Route("/api/summary", api(summary)),
        Route("/api/rollouts", api(rollouts)),
        Route("/api/rollouts/{rollout_id}", api(rollout)),
        Route("/api/resources", api(resources)),
        Route("/api/resources/{resources_id}/diff", api(resources_diff)),
        Route("/api/curves", api(curves)),
        Route("/api/metrics", api(metrics)),
        Route("/api/{rest:path}", unknown_api),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=[Route(PREFIX, to_index), Mount(PREFIX, routes=routes)])


def mount_dashboard(
    app: Any, store: LightningStore, *, token: str | None = None, metrics_dir: str | Path | None = None
) -> Any:
    """``app`` (e.g. the store server) with the dashboard answering every path under ``/ui``."""
    ui = create_dashboard(store, token=token, metrics_dir=metrics_dir)

    async def dispatch(scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == PREFIX or path.startswith(PREFIX + "/")):
            await ui(scope, receive, send)
        else:
            await app(scope, receive, send)

    return dispatch


def standalone_app(
    store: LightningStore, *, token: str | None = None, metrics_dir: str | Path | None = None
) -> Any:
    """The dashboard on its own (``agl dashboard``): ``/`` leads to ``/ui/``; the store is closed on shutdown."""

    async def root(request: Request) -> Response:
        return RedirectResponse(f"{PREFIX}/", status_code=307)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await store.aclose()

    base = Starlette(routes=[Route("/", root), Route("/health", health)], lifespan=lifespan)
    return mount_dashboard(base, store, token=token, metrics_dir=metrics_dir)
