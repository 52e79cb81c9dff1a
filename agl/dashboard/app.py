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
import importlib
import logging
import operator
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from agl import errors
from agl import semconv as sc
from agl.adapter.rewards import final_reward
from agl.dashboard import training, views
from agl.schemas import ResourcesVersion, Rollout, RolloutStatus, Span
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
#: rollouts search, filters and non-default sorts look through (newest first)
SCAN_ROLLOUTS = 100_000
#: how long one read of the rollout index serves searches (every poll of every tab)
INDEX_TTL_S = 0.5
SORTS = frozenset({"created", "reward", "duration"})
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


def _offset(raw: str | None) -> int:
    """A search page's cursor: ``@<offset>`` into the sorted matches."""
    if not raw:
        return 0
    if not raw.startswith("@") or not raw[1:].isdigit():
        raise BadRequest("cursor", f"a search cursor looks like '@50', got {raw!r}")
    return int(raw[1:])


def _haystack(rollout: Rollout, output: str) -> str:
    """What search looks through, lower-cased: the rollout id, its input (as JSON text), its last reply."""
    given = rollout.input if isinstance(rollout.input, str) else orjson.dumps(rollout.input).decode()
    return "\n".join((rollout.rollout_id, given, output)).lower()


def _sorted(
    rollouts: list[Rollout], sort: str, descending: bool, facts: dict[str, tuple[float | None, str | None]]
) -> list[Rollout]:
    """Rollouts by reward, duration or creation; those without a value (running, no reward) go last."""
    if sort == "created":
        return sorted(rollouts, key=lambda r: r.created_at, reverse=descending)
    values = (
        [facts[r.rollout_id][0] for r in rollouts]
        if sort == "reward"
        else [views.duration_s(r) for r in rollouts]
    )
    known = [(v, n) for n, v in enumerate(values) if v is not None]
    known.sort(key=operator.itemgetter(0), reverse=descending)  # stable: ties stay newest first
    return [rollouts[n] for _, n in known] + [r for r, v in zip(rollouts, values, strict=True) if v is None]


def _settings(request: Request) -> training.Settings:
    """GRPO's settings for the training views: GRPOConfig's defaults, or the page's query parameters."""
    q = request.query_params
    level = q.get("level") or "trajectory"
    if level not in ("trajectory", "transition"):
        raise BadRequest("level", f"level must be 'trajectory' or 'transition', got {level!r}")
    scale = q.get("scale_by_std") or "true"
    if scale not in ("true", "false"):
        raise BadRequest("scale_by_std", f"scale_by_std must be 'true' or 'false', got {scale!r}")
    return training.Settings(
        level=level,  # type: ignore[arg-type]
        scale_by_std=scale == "true",
        max_sample_tokens=_int(request, "max_sample_tokens", 2048, 1, 10_000_000),
        agent=q.get("agent") or None,
    )


class RewardCache:
    """Final reward and agent name per rollout, read from its latest attempt's reward spans (the
    tracer tags them with the agent) and kept once the rollout is finished."""

    def __init__(self, store: LightningStore, max_entries: int = 200_000) -> None:
        self.store, self.max_entries = store, max_entries
        self._done: dict[str, tuple[float | None, str | None]] = {}
        self._gate = asyncio.Semaphore(16)

    async def _read(self, rollout: Rollout) -> tuple[float | None, str | None]:
        if rollout.rollout_id in self._done:
            return self._done[rollout.rollout_id]
        async with self._gate:
            page = await self.store.query_spans(
                rollout_id=rollout.rollout_id, attempt_id="latest", name=sc.SPAN_REWARD, limit=10_000
            )
        found = _facts(page.items)
        if rollout.status.is_terminal:
            if len(self._done) >= self.max_entries:
                self._done.clear()
            self._done[rollout.rollout_id] = found
        return found

    async def facts(self, rollouts: list[Rollout]) -> list[tuple[float | None, str | None]]:
        """(reward, agent name) of each rollout."""
        missing = [r for r in rollouts if r.rollout_id not in self._done]
        if len(missing) > BULK_AFTER:  # one scan of all reward spans beats thousands of small queries
            await self._scan(missing)
        return await _fill(rollouts, self._done, self._read)

    async def rewards(self, rollouts: list[Rollout]) -> list[float | None]:
        return [reward for reward, _ in await self.facts(rollouts)]

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
            self._done[rollout_id] = _facts(found.get(rollout_id, []))


def _facts(reward_spans: list[Span]) -> tuple[float | None, str | None]:
    agent = next(
        (str(s.attributes[sc.AGENT_NAME]) for s in reward_spans if sc.AGENT_NAME in s.attributes), None
    )
    return final_reward(reward_spans), agent


class TextCache:
    """What search and the error filter read per finished rollout: its last model reply and the
    type of its exception (a full read of its latest attempt's spans, so only when asked for)."""

    def __init__(self, store: LightningStore, max_entries: int = 200_000) -> None:
        self.store, self.max_entries = store, max_entries
        self._done: dict[str, tuple[str, str | None]] = {}
        self._gate = asyncio.Semaphore(16)

    @staticmethod
    def _of(spans: list[Span]) -> tuple[str, str | None]:
        errors_ = [s for s in spans if s.name == sc.SPAN_EXCEPTION]
        error = str(errors_[-1].attributes.get(sc.EXCEPTION_TYPE)) if errors_ else None
        return training.output_text(spans), error

    async def _read(self, rollout: Rollout) -> tuple[str, str | None]:
        if rollout.rollout_id in self._done:
            return self._done[rollout.rollout_id]
        async with self._gate:
            page = await self.store.query_spans(
                rollout_id=rollout.rollout_id, attempt_id="latest", limit=MAX_SPANS
            )
        found = self._of(page.items)
        if rollout.status.is_terminal:
            if len(self._done) >= self.max_entries:
                self._done.clear()
            self._done[rollout.rollout_id] = found
        return found

    async def texts(self, rollouts: list[Rollout]) -> list[tuple[str, str | None]]:
        missing = [r for r in rollouts if r.rollout_id not in self._done and r.status.is_terminal]
        if len(missing) > BULK_AFTER:
            wanted = {r.rollout_id for r in missing}
            found: dict[str, list[Span]] = {}
            cursor = None
            while True:
                page = await self.store.query_spans(attempt_id="latest", limit=10_000, cursor=cursor)
                for span in page.items:
                    if span.rollout_id in wanted:
                        found.setdefault(span.rollout_id, []).append(span)
                if (cursor := page.next_cursor) is None:
                    break
            if len(self._done) + len(wanted) >= self.max_entries:
                self._done.clear()
            for rollout_id in wanted:
                self._done[rollout_id] = self._of(found.get(rollout_id, []))
        return await _fill(rollouts, self._done, self._read)


async def _fill(
    rollouts: list[Rollout], done: dict[str, Any], read: Callable[[Rollout], Awaitable[Any]]
) -> list[Any]:
    """Cached values as they are; only the others are read (a search over 10k rollouts stays cheap)."""
    out = [done.get(r.rollout_id) for r in rollouts]
    todo = [i for i, value in enumerate(out) if value is None]
    for i, value in zip(todo, await asyncio.gather(*(read(rollouts[i]) for i in todo)), strict=True):
        out[i] = value
    return out


class RolloutIndex:
    """Every rollout (up to ``SCAN_ROLLOUTS``), newest first, kept current by reading only the rollouts
    updated since the last read: a search over 10k rollouts must not reread them all on each poll."""

    #: a full reread this often catches an update stamped before the newest one seen but committed after it
    FULL_EVERY_S = 60.0

    def __init__(self, store: LightningStore) -> None:
        self.store = store
        self._by_id: dict[str, Rollout] = {}
        self._order: list[Rollout] | None = None
        self._seen_until = float("-inf")
        self._read_at = float("-inf")
        self._full_at = float("-inf")
        self._lock = asyncio.Lock()

    async def rollouts(self) -> list[Rollout]:
        async with self._lock:
            if self._order is not None and time.monotonic() - self._read_at <= INDEX_TTL_S:
                return self._order
            changed = await self._changed()
            if changed or self._order is None:
                for rollout in changed:
                    self._by_id[rollout.rollout_id] = rollout
                self._order = sorted(self._by_id.values(), key=lambda r: r.created_at, reverse=True)
                self._order = self._order[:SCAN_ROLLOUTS]
            self._read_at = time.monotonic()
            return self._order

    async def _changed(self) -> list[Rollout]:
        """Rollouts updated since the last read (all of them the first time), newest update first."""
        found: list[Rollout] = []
        cursor = None
        if time.monotonic() - self._full_at > self.FULL_EVERY_S:
            self._seen_until, self._full_at = float("-inf"), time.monotonic()
        limit = 50 if self._seen_until > float("-inf") else 1000
        while len(found) < SCAN_ROLLOUTS:
            page = await self.store.query_rollouts(
                order_by="updated_at", descending=True, limit=limit, cursor=cursor
            )
            found.extend(page.items)
            if (cursor := page.next_cursor) is None or page.items[-1].updated_at < self._seen_until:
                break
            limit = 1000
        if found:
            self._seen_until = max(self._seen_until, found[0].updated_at)
        return [
            r
            for r in found
            if (known := self._by_id.get(r.rollout_id)) is None or known.updated_at != r.updated_at
        ]


def _previous(versions: list[ResourcesVersion]) -> dict[str, str]:
    """Each version's predecessor by version number (what a version without a parent is diffed against)."""
    ordered = sorted(versions, key=lambda v: v.version)
    return {b.resources_id: a.resources_id for a, b in zip(ordered, ordered[1:], strict=False)}


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
            except ImportError as exc:  # the GRPO views need torch (agl[train]); the rest does not
                return _error(501, "MissingDependency", f"this view needs agl[train] installed: {exc}")

        return endpoint

    async def summary(request: Request) -> dict[str, Any]:
        stats = await store.statistics()
        latest = await store.get_latest_resources()
        return {
            "statistics": stats.model_dump(mode="json"),
            "latest_resources_id": latest.resources_id if latest else None,
            "metrics": metrics_path is not None,
        }

    texts = TextCache(store)
    rollout_index = RolloutIndex(store)

    async def snapshot(
        statuses: list[RolloutStatus] | None, mode: str | None, group: str | None
    ) -> list[Rollout]:
        """Every rollout the filters match, newest first: search and other sorts look through them all."""
        everything = await rollout_index.rollouts()
        wanted = set(statuses) if statuses else None
        return [
            r
            for r in everything
            if (wanted is None or r.status in wanted)
            and (mode is None or r.mode == mode)
            and (group is None or r.group_id == group)
        ]

    haystacks: dict[str, str] = {}  # finished rollouts' search text, built once

    async def rollouts(request: Request) -> dict[str, Any]:
        limit = _int(request, "limit", 50, 1, 1000)
        q = request.query_params
        mode, group = q.get("mode") or None, q.get("group_id") or None
        text, sort = (q.get("q") or "").strip(), q.get("sort") or "created"
        resources_id, agent, error = (
            q.get("resources_id") or None,
            q.get("agent") or None,
            q.get("error") or None,
        )
        if sort not in SORTS:
            raise BadRequest("sort", f"sort must be one of {sorted(SORTS)}, got {sort!r}")
        order = q.get("order") or "desc"
        if order not in ("asc", "desc"):
            raise BadRequest("order", f"order must be 'asc' or 'desc', got {order!r}")
        if not (text or resources_id or agent or error or sort != "created" or order != "desc"):
            page = await store.query_rollouts(  # the store pages: fast on any size
                status=_statuses(request),
                mode=mode,
                group_id=group,
                order_by="created_at",
                descending=True,
                limit=limit,
                cursor=q.get("cursor") or None,
            )
            known = await cache.facts(page.items)
            return {
                "items": [views.rollout_view(r, w, a) for r, (w, a) in zip(page.items, known, strict=True)],
                "next_cursor": page.next_cursor,
            }
        offset = _offset(q.get("cursor"))
        found = await snapshot(_statuses(request), mode, group)
        if resources_id:
            found = [r for r in found if r.resources_id == resources_id]
        facts = dict(zip((r.rollout_id for r in found), await cache.facts(found), strict=True))
        if agent:
            found = [r for r in found if facts[r.rollout_id][1] == agent]
        if error:
            said = dict(zip((r.rollout_id for r in found), await texts.texts(found), strict=True))
            found = [r for r in found if said[r.rollout_id][1] == error]
        if text:
            needle = text.lower()
            unread = [r for r in found if r.rollout_id not in haystacks]  # a built haystack needs no spans
            fresh = {
                r.rollout_id: _haystack(r, output)
                for r, (output, _) in zip(unread, await texts.texts(unread), strict=True)
            }
            found = [r for r in found if needle in (haystacks.get(r.rollout_id) or fresh[r.rollout_id])]
            if len(haystacks) + len(fresh) > SCAN_ROLLOUTS:
                haystacks.clear()
            haystacks.update((r.rollout_id, fresh[r.rollout_id]) for r in unread if r.status.is_terminal)
        found = _sorted(found, sort, order == "desc", facts)
        chosen = found[offset : offset + limit]
        return {
            "items": [views.rollout_view(r, *facts[r.rollout_id]) for r in chosen],
            "next_cursor": f"@{offset + limit}" if offset + limit < len(found) else None,
            "total": len(found),
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
        view = views.rollout_view(
            found, final_reward(spans), _facts([s for s in spans if s.name == sc.SPAN_REWARD])[1]
        )
        version = None
        if found.resources_id:
            with contextlib.suppress(errors.NotFoundError):
                version = await store.get_resources(found.resources_id)
        view["resources_version"] = version.version if version else None
        view["model_version"] = views.model_version(version) if version else None
        return {
            "rollout": view,
            "attempts": [a.model_dump(mode="json") for a in attempts],
            "attempt_id": attempt_id,
            "spans": views.span_tree(spans),
            "spans_truncated": more is not None,
        }

    async def span(request: Request) -> dict[str, Any]:
        """One span in full (token ids, request and response bodies), secrets hidden: the raw JSON view."""
        rollout_id, span_id = request.path_params["rollout_id"], request.path_params["span_id"]
        await store.get_rollout(rollout_id)
        cursor = None
        while True:
            page = await store.query_spans(rollout_id=rollout_id, limit=MAX_SPANS, cursor=cursor)
            for found in page.items:
                if found.span_id == span_id:
                    return {"span": views.redact(found.model_dump(mode="json"))}
            if (cursor := page.next_cursor) is None:
                raise errors.NotFoundError(f"rollout {rollout_id!r} has no span {span_id!r}")

    async def group_members(group_id: str) -> tuple[list[Rollout], dict[str, list[Span]]]:
        members = (await store.query_rollouts(group_id=group_id, order_by="created_at", limit=1000)).items
        if not members:
            raise errors.NotFoundError(f"no rollout has group_id {group_id!r}")
        pages = await asyncio.gather(
            *(
                store.query_spans(rollout_id=r.rollout_id, attempt_id="latest", limit=MAX_SPANS)
                for r in members
            )
        )
        return members, {r.rollout_id: p.items for r, p in zip(members, pages, strict=True)}

    async def group(request: Request) -> dict[str, Any]:
        group_id = request.path_params["group_id"]
        members, spans = await group_members(group_id)
        analysis = await asyncio.to_thread(training.analyse_group, members, spans, _settings(request))
        first = members[0]
        version = None
        if first.resources_id:
            with contextlib.suppress(errors.NotFoundError):
                version = await store.get_resources(first.resources_id)
        return {
            "group_id": group_id,
            "input": views.redact(first.input),
            "mode": first.mode,
            "step": first.metadata.get("step"),
            "resources_id": first.resources_id,
            "resources_version": version.version if version else None,
            "model_version": views.model_version(version) if version else None,
            **analysis,
        }

    async def groups(request: Request) -> dict[str, Any]:
        """The GRPO groups of a step (rollout metadata ``step``) or of a resources version, with their
        rewards and whether GRPO skips them for zero variance."""
        step = request.query_params.get("step")
        resources_id = request.query_params.get("resources_id") or None
        if step is None and resources_id is None:
            raise BadRequest("step", "give step (a training step) or resources_id")
        if step is not None:
            try:
                wanted_step: int | None = int(step)
            except ValueError:
                raise BadRequest("step", f"step must be an integer, got {step!r}") from None
        else:
            wanted_step = None
        found = [
            r
            for r in await snapshot(None, None, None)
            if r.group_id
            and (wanted_step is None or r.metadata.get("step") == wanted_step)
            and (resources_id is None or r.resources_id == resources_id)
        ]
        rewards = dict(zip((r.rollout_id for r in found), await cache.rewards(found), strict=True))
        by_group: dict[str, list[Rollout]] = {}
        for r in reversed(found):  # oldest first
            by_group.setdefault(r.group_id or "", []).append(r)
        # the package imports torch: seconds, once, and not on the event loop
        grpo = await asyncio.to_thread(importlib.import_module, "agl.algorithm.grpo")
        zero_variance_groups = grpo.zero_variance_groups

        out = []
        for group_id, members in by_group.items():
            done = [rewards[r.rollout_id] for r in members if r.status == RolloutStatus.SUCCEEDED]
            values = [w or 0.0 for w in done]
            out.append(
                {
                    "group_id": group_id,
                    "input": views.redact(members[0].input),
                    "mode": members[0].mode,
                    "resources_id": members[0].resources_id,
                    "step": members[0].metadata.get("step"),
                    "rollouts": len(members),
                    "rewards": [rewards[r.rollout_id] for r in members],
                    "mean": sum(values) / len(values) if values else None,
                    "zero_variance": bool(values) and bool(zero_variance_groups(values, ["g"] * len(values))),
                    "finished": all(r.status.is_terminal for r in members),
                }
            )
        return {"items": out}

    async def rollout_training(request: Request) -> dict[str, Any]:
        rollout_id = request.path_params["rollout_id"]
        found = await store.get_rollout(rollout_id)
        if found.group_id:
            members, spans = await group_members(found.group_id)
        else:
            page = await store.query_spans(rollout_id=rollout_id, attempt_id="latest", limit=MAX_SPANS)
            members, spans = [found], {rollout_id: page.items}
        tokenizer = None
        if found.resources_id and request.query_params.get("tokens") != "ids":
            with contextlib.suppress(errors.NotFoundError):
                uri = training.weights_uri(await store.get_resources(found.resources_id))
                if uri is not None:
                    tokenizer = await asyncio.to_thread(training.load_tokenizer, uri)
        mine = next((r for r in members if r.rollout_id == rollout_id), found)
        return await asyncio.to_thread(
            training.analyse_rollout, mine, members, spans, _settings(request), tokenizer
        )

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
        previous = _previous(versions)
        for version in reversed(versions):  # newest first
            view = views.version_view(version)
            view["diff_parent_id"] = views.diff_parent(version, previous.get(version.resources_id))
            row = scores.get(version.resources_id, {})
            view["val_reward"], view["train_reward"] = row.get("val_mean"), row.get("train_mean")
            out.append(view)
        return {"items": out}

    async def resources_diff(request: Request) -> dict[str, Any]:
        version = await store.get_resources(request.path_params["resources_id"])
        earlier = None
        if version.version > 1:
            page = await store.query_resources(limit=1000)  # the version numbered just before, if listed
            earlier = _previous(page.items).get(version.resources_id)
        against = request.query_params.get("against") or views.diff_parent(version, earlier)
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
        Route("/api/rollouts/{rollout_id}/training", api(rollout_training)),
        Route("/api/rollouts/{rollout_id}/spans/{span_id}", api(span)),
        Route("/api/groups", api(groups)),
        Route("/api/groups/{group_id}", api(group)),
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
