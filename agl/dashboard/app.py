"""The dashboard as an ASGI app: a static page under ``/ui`` and its JSON API under ``/ui/api``.

It reads everything through the async store API and its read model (``StoreWithReadModel``), so it
serves a local backend (inside ``agl store serve``) or a remote one (``agl dashboard --store URL``,
through ``LightningStoreClient``) alike. With a token, every ``/ui/api`` call needs ``Authorization: Bearer <token>``; the page and its
scripts hold no data and load without it (the page takes the token from ``?token=`` once and keeps it
in the tab's sessionStorage).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import importlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
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
from agl.dashboard import changes, export, inputs, replay, training, views
from agl.dashboard.inputs import BadGateway, BadRequest
from agl.schemas import ResourcesVersion, Rollout, RolloutStatus, Span
from agl.store.read_model import AttemptDigest, ListedRollout, RolloutSearch, StoreWithReadModel
from agl.store.sqlite import SqliteLightningStore

STATIC = Path(__file__).parent / "static"
PREFIX = "/ui"
#: finished rollouts the reward charts look back over (newest first)
CURVE_ROLLOUTS = 5000
#: how long one computation of the curves serves every poll (several tabs, the resources page)
CURVES_TTL_S = 1.5
#: spans of one attempt shown on its page (the first ones by sequence id)
MAX_SPANS = 10_000
#: rollouts one search call of the groups view reads
GROUP_READ = 10_000
#: how long one scan of the error types serves every poll, and the most digest pages (10,000 each) it reads
ERRORS_TTL_S, ERROR_SCAN_PAGES = 5.0, 20
#: first-attempt start times kept (about 100 bytes each)
KNOWN_STARTS = 200_000
FINISHED = [RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED]
Handler = Callable[[Request], Awaitable[Any]]


def _error(status: int, type_name: str, message: str, field: str | None = None) -> JSONResponse:
    body = {"type": type_name, "message": message, **({"field": field} if field else {})}
    return JSONResponse({"error": body}, status_code=status)


def _json(body: Any) -> Response:
    """``body`` as JSON, encoded by orjson (a 1,000-row page is milliseconds, not tens of them)."""
    try:
        return Response(orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), media_type="application/json")
    except TypeError:  # something orjson refuses (an integer past 64 bits): the standard encoder
        return JSONResponse(body)


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


def _offset(raw: str | None) -> int:
    """A search page's cursor: ``@<offset>`` into the sorted matches."""
    if not raw:
        return 0
    if not (raw.startswith("@") and raw[1:].isascii() and raw[1:].isdigit() and len(raw) <= 13):
        raise BadRequest("cursor", f"a search cursor looks like '@50', got {raw!r}")
    return int(raw[1:])


def _settings(request: Request) -> training.Settings | None:
    """The settings the page asks the training views for (a what-if), or None: the run's recorded
    settings, or GRPOConfig's defaults for a store without a training record."""
    q = request.query_params
    if not any(q.get(name) for name in ("level", "scale_by_std", "max_sample_tokens", "agents")):
        return None
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
        agents=tuple(a for a in (q.get("agents") or "").split(",") if a),
    )


def _previous(versions: list[ResourcesVersion]) -> dict[str, str]:
    """Each version's predecessor by version number (what a version without a parent is diffed against)."""
    ordered = sorted(versions, key=lambda v: v.version)
    return {b.resources_id: a.resources_id for a, b in zip(ordered, ordered[1:], strict=False)}


@dataclass
class _Context:
    """What every route group reads: the store, the metrics directory and the curves computed last."""

    store: StoreWithReadModel
    metrics_path: Path | None
    last_curves: list[Any] = field(default_factory=lambda: [0.0, None])  # (monotonic time, answer)
    tokenizers: training.Tokenizers = field(default_factory=training.Tokenizers)
    last_errors: list[Any] = field(default_factory=lambda: [0.0, None])  # (monotonic time, answer)
    starts: OrderedDict[str, float] = field(
        default_factory=OrderedDict
    )  # rollout id -> first attempt's start
    versions: changes.Versions = field(init=False)  # resources versions read (they never change)

    def __post_init__(self) -> None:
        self.versions = changes.Versions(self.store)

    async def digests(self, rollouts: list[Rollout]) -> list[AttemptDigest | None]:
        """The digest of each rollout's latest attempt (None: nothing recorded yet), from the store."""
        page = await self.store.query_digests(rollout_ids=[r.rollout_id for r in rollouts])
        found = {d.rollout_id: d for d in page.items}
        return [found.get(r.rollout_id) for r in rollouts]

    async def first_starts(self, rollouts: list[Rollout]) -> dict[str, float]:
        """When each ended rollout's first attempt started (what its run time counts from).

        A first attempt's start never changes, so each is read once: a polled page costs no reads.
        """
        known = self.starts
        wanted = [r.rollout_id for r in rollouts if r.ended_at is not None and r.rollout_id not in known]
        pages = await asyncio.gather(*(self.store.query_attempts(rollout_id=i, limit=1) for i in wanted))
        for rollout_id, page in zip(wanted, pages, strict=True):
            if page.items:
                known[rollout_id] = page.items[0].started_at
        while len(known) > KNOWN_STARTS:
            known.popitem(last=False)
        return {r.rollout_id: known[r.rollout_id] for r in rollouts if r.rollout_id in known}

    async def version(self, resources_id: str | None) -> ResourcesVersion | None:
        """The resources version ``resources_id`` names, or None (none named, or not stored)."""
        if resources_id:
            with contextlib.suppress(errors.NotFoundError):
                return await self.store.get_resources(resources_id)
        return None

    def served_file(self) -> Path | None:
        """The SQLite file of the served store, when it is one (a remote store's file is not known)."""
        if isinstance(self.store, SqliteLightningStore) and self.store.path != ":memory:":
            return Path(self.store.path).resolve()
        return None

    def elsewhere(self, run: str) -> str | None:
        """The store file of metrics run ``run`` when it is not the served store: its groups are there."""
        if self.metrics_path is None:
            raise BadRequest("run", "this dashboard charts no metrics runs (no --metrics-dir)")
        base = self.metrics_path.resolve()
        folder = (base / run).resolve() if run != base.name else base
        if not folder.is_relative_to(base) or not (folder / "metrics.csv").is_file():
            raise BadRequest("run", f"no metrics run named {run!r} under the metrics directory")
        store = folder / "store.db"
        served = self.served_file()
        return str(store) if store.is_file() and served is not None and served != store else None

    async def group_members(self, group_id: str) -> tuple[list[Rollout], dict[str, list[Span]]]:
        """A group's rollouts (oldest first) and the spans of each one's latest attempt."""
        store = self.store
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


def _api(handler: Handler, expected: bytes | None) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` behind the bearer token, its answer as JSON and its errors as status codes."""

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
            answer = await handler(request)
            return answer if isinstance(answer, Response) else _json(answer)
        except BadRequest as exc:
            return _error(422, "ValidationError", exc.message, exc.field)
        except BadGateway as exc:
            return _error(502, "BadGateway", exc.message)
        except errors.NotFoundError as exc:
            return _error(404, type(exc).__name__, exc.message)
        except errors.StoreUnavailableError as exc:
            return _error(503, type(exc).__name__, exc.message)
        except errors.AglError as exc:
            return _error(400, type(exc).__name__, exc.message, getattr(exc, "param", None))
        except ImportError as exc:  # the GRPO views need torch (agl[train]); the rest does not
            return _error(501, "MissingDependency", f"this view needs agl[train] installed: {exc}")

    return endpoint


def _summary_routes(ctx: _Context) -> dict[str, Handler]:
    """The store's counts and the error types its rollouts ended with (the error filter's list)."""
    store = ctx.store

    async def summary(request: Request) -> dict[str, Any]:
        stats = await store.statistics()
        latest = await store.get_latest_resources()
        return {
            "statistics": stats.model_dump(mode="json"),
            "latest_resources_id": latest.resources_id if latest else None,
            "metrics": ctx.metrics_path is not None,
        }

    async def error_types(request: Request) -> dict[str, Any]:
        """The error types the rollouts' latest attempts ended with, most frequent first (the filter's list)."""
        last = ctx.last_errors
        if last[1] is None or time.monotonic() - last[0] > ERRORS_TTL_S:
            last[:] = [time.monotonic(), await _error_types(store)]
        return last[1]  # type: ignore[no-any-return]

    return {"/api/summary": summary, "/api/error_types": error_types}


def _rollout_routes(ctx: _Context) -> dict[str, Handler]:
    """The rollout list (paged, searched, sorted), one rollout, one span in full."""
    store = ctx.store

    async def rollouts(request: Request) -> dict[str, Any]:
        limit = _int(request, "limit", 50, 1, 1000)
        q = request.query_params
        search = export.rollout_search(request, limit=limit, offset=0)
        plain = RolloutSearch(status=search.status, mode=search.mode, group_id=search.group_id, limit=limit)
        if search == plain:  # no search, sort or flag: the store pages, fast on any size
            page = await store.query_rollouts(
                status=search.status,
                mode=search.mode,
                group_id=search.group_id,
                order_by="created_at",
                descending=True,
                limit=limit,
                cursor=q.get("cursor") or None,
            )
            known, starts = await asyncio.gather(ctx.digests(page.items), ctx.first_starts(page.items))
            return {
                "items": [
                    views.listed_view(r, d, starts.get(r.rollout_id))
                    for r, d in zip(page.items, known, strict=True)
                ],
                "next_cursor": page.next_cursor,
            }
        offset = _offset(q.get("cursor"))
        found = await store.search_rollouts(search.model_copy(update={"offset": offset}))
        starts = await ctx.first_starts([x.rollout for x in found.items])
        return {
            "items": [
                views.listed_view(x.rollout, x.digest, starts.get(x.rollout.rollout_id)) for x in found.items
            ],
            "next_cursor": f"@{offset + limit}" if offset + limit < found.total else None,
            "total": found.total,
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
        agent = views.reward_facts([s for s in spans if s.name == sc.SPAN_REWARD])[1]
        view = views.rollout_view(
            found, final_reward(spans), agent, attempts[0].started_at if attempts else None
        )
        version = await ctx.version(found.resources_id)
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
        found = await replay.find_span(store, rollout_id, span_id, MAX_SPANS)
        return {"span": views.redact(found.model_dump(mode="json"))}

    return {
        "/api/rollouts": rollouts,
        "/api/rollouts/{rollout_id}": rollout,
        "/api/rollouts/{rollout_id}/spans/{span_id}": span,
    }


async def _error_types(store: StoreWithReadModel) -> dict[str, Any]:
    counts: dict[str, int] = {}
    after, partial = 0, False
    for _ in range(ERROR_SCAN_PAGES):
        page = await store.query_digests(after=after, limit=10_000)
        for digest in page.items:
            if digest.error_type:
                counts[digest.error_type] = counts.get(digest.error_type, 0) + 1
        if page.next_cursor is None:
            break
        after = int(page.next_cursor)
    else:
        partial = True
    ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return {"items": [{"error_type": k, "rollouts": n} for k, n in ordered], "partial": partial}


def _training_routes(ctx: _Context) -> dict[str, Handler]:
    """GRPO's view of the store: the groups of a step, one group, what one rollout trains on."""
    store = ctx.store

    async def group(request: Request) -> dict[str, Any]:
        group_id = request.path_params["group_id"]
        members, spans = await ctx.group_members(group_id)
        analysis = await asyncio.to_thread(training.analyse_group, members, spans, _settings(request))
        first = members[0]
        version = await ctx.version(first.resources_id)
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
        run = request.query_params.get("run") or None
        if run is not None and (other := ctx.elsewhere(run)) is not None:
            return {"items": [], "run": run, "elsewhere": other}  # another run's step: not in this store
        rows: list[ListedRollout] = []
        while True:  # newest first
            page = await store.search_rollouts(
                RolloutSearch(
                    metadata=None if wanted_step is None else {"step": wanted_step},
                    resources_id=resources_id,
                    limit=GROUP_READ,
                    offset=len(rows),
                )
            )
            rows += page.items
            if not page.items or len(rows) >= page.total:
                break
        # the package imports torch: seconds, once, and not on the event loop
        grpo = await asyncio.to_thread(importlib.import_module, "agl.algorithm.grpo")
        return {"items": _group_rows(rows, grpo.zero_variance_groups), "run": run, "elsewhere": None}

    async def rollout_training(request: Request) -> dict[str, Any]:
        rollout_id = request.path_params["rollout_id"]
        found = await store.get_rollout(rollout_id)
        if found.group_id:
            members, spans = await ctx.group_members(found.group_id)
        else:
            page = await store.query_spans(rollout_id=rollout_id, attempt_id="latest", limit=MAX_SPANS)
            members, spans = [found], {rollout_id: page.items}
        tokenizer, loading = None, False
        if request.query_params.get("tokens") != "ids":
            uri = training.weights_uri(await ctx.version(found.resources_id))
            if uri is not None:  # loading one takes seconds: the tokens come as ids until it is ready
                tokenizer, loading = ctx.tokenizers.get(uri)
        mine = next((r for r in members if r.rollout_id == rollout_id), found)
        settings = _settings(request)
        return await asyncio.to_thread(
            training.analyse_rollout, mine, members, spans, settings, tokenizer, loading
        )

    return {
        "/api/rollouts/{rollout_id}/training": rollout_training,
        "/api/groups": groups,
        "/api/groups/{group_id}": group,
    }


def _group_rows(rows: list[ListedRollout], zero_variance_groups: Callable[..., Any]) -> list[dict[str, Any]]:
    """One row per GRPO group among ``rows`` (newest first): its rewards, mean and zero variance."""
    found = [x.rollout for x in rows if x.rollout.group_id]
    rewards = {x.rollout.rollout_id: x.digest.reward if x.digest else None for x in rows}
    by_group: dict[str, list[Rollout]] = {}
    for r in reversed(found):  # oldest first
        by_group.setdefault(r.group_id or "", []).append(r)
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
    return out


def _changes_routes(ctx: _Context) -> dict[str, Handler]:
    """What the agent learned: the tasks whose reward changed between two versions, one task across all."""

    async def changed(request: Request) -> dict[str, Any]:
        q = request.query_params
        mode = q.get("mode") or "val"
        before, after = q.get("before") or None, q.get("after") or None
        return await changes.changes(ctx.store, mode, before, after, ctx.versions)

    async def task(request: Request) -> dict[str, Any]:
        mode = request.query_params.get("mode") or None
        return await changes.task_history(ctx.store, request.path_params["rollout_id"], mode, ctx.versions)

    return {"/api/changes": changed, "/api/rollouts/{rollout_id}/task": task}


def _action_routes(ctx: _Context) -> tuple[dict[str, Handler], dict[str, Handler]]:
    """What a person does from the page (GET routes, POST routes): flag rollouts, export them as a data
    set, replay a model call."""
    store = ctx.store

    async def flag(request: Request) -> dict[str, Any]:
        body = await inputs.json_body(request)
        return await export.set_flag(store, request.path_params["rollout_id"], body)

    async def download(request: Request) -> Response:
        return await export.export(store, request, MAX_SPANS)

    async def replay_call(request: Request) -> dict[str, Any]:
        return await replay.replay(store, await inputs.json_body(request), MAX_SPANS)

    return {"/api/export": download}, {"/api/rollouts/{rollout_id}/flag": flag, "/api/replay": replay_call}


def _resources_routes(ctx: _Context) -> dict[str, Handler]:
    """Resources versions and their diffs, the reward curves, and the metrics.csv runs."""
    store = ctx.store

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

    async def curves(request: Request) -> dict[str, Any]:
        last = ctx.last_curves
        if last[1] is None or time.monotonic() - last[0] > CURVES_TTL_S:
            last[:] = [time.monotonic(), await _compute_curves(ctx)]
        return last[1]  # type: ignore[no-any-return]

    async def metrics(request: Request) -> dict[str, Any]:
        if ctx.metrics_path is None:
            return {"runs": [], "configured": False}
        runs = await asyncio.to_thread(views.read_metrics, ctx.metrics_path)
        served = ctx.served_file()
        for run in runs:  # whether a click on its step can show that step's groups (None: not known)
            store = run["store"]
            run["this_store"] = None if served is None or store is None else Path(store).resolve() == served
        return {"runs": runs, "configured": True}

    return {
        "/api/resources": resources,
        "/api/resources/{resources_id}/diff": resources_diff,
        "/api/curves": curves,
        "/api/metrics": metrics,
    }


#: the per-version mean a rollout's mode counts in: a teacher's rollouts on train tasks and its held-out
#: ones (modes of ``agl.algorithm.teacher``) count as its own resources version's train and val
MEAN_COLUMN = {"train": "train", "val": "val", "teacher": "train", "teacher_val": "val"}


async def _compute_curves(ctx: _Context) -> dict[str, Any]:
    """Reward of recently finished rollouts, over time and as a mean per resources version and mode."""
    found: list[Rollout] = []
    cursor = None
    while len(found) < CURVE_ROLLOUTS:
        page = await ctx.store.query_rollouts(
            status=FINISHED, order_by="updated_at", descending=True, limit=1000, cursor=cursor
        )
        found.extend(page.items)
        if (cursor := page.next_cursor) is None:
            break
    found = found[:CURVE_ROLLOUTS][::-1]
    rewards = [d.reward if d else None for d in await ctx.digests(found)]
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
        if (column := MEAN_COLUMN.get(p["mode"])) is not None:
            sums.setdefault((p["resources_id"], column), []).append(p["reward"])
    order: dict[str | None, int] = {}
    for p in points:
        order.setdefault(p["resources_id"], len(order))
    versions = {}
    for rid in order:
        if rid is not None and (version := await ctx.version(rid)) is not None:
            versions[rid] = version.version
    by_version = []
    for rid in sorted(order, key=lambda r: (versions.get(r, -1) if r else -1, order[r])):
        row: dict[str, Any] = {"resources_id": rid, "version": versions.get(rid) if rid else None}
        for mode in ("train", "val"):
            values = sums.get((rid, mode), [])
            row[f"{mode}_mean"] = sum(values) / len(values) if values else None
            row[f"{mode}_count"] = len(values)
        by_version.append(row)
    return {"points": points, "by_version": by_version}


def create_dashboard(
    store: StoreWithReadModel, *, token: str | None = None, metrics_dir: str | Path | None = None
) -> Starlette:
    """The dashboard over ``store``: the page at ``/ui/``, the JSON API at ``/ui/api/...``.

    ``metrics_dir`` is a training output directory; its ``metrics.csv`` files become charts.
    """
    expected = f"Bearer {token}".encode() if token else None
    ctx = _Context(store, Path(metrics_dir) if metrics_dir is not None else None)

    async def index(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})

    async def to_index(request: Request) -> Response:
        query = f"?{request.url.query}" if request.url.query else ""
        return RedirectResponse(f"{PREFIX}/{query}", status_code=307)

    async def unknown_api(request: Request) -> Response:
        return _error(404, "NotFoundError", f"no dashboard API at {request.method} {request.url.path}")

    gets, posts = _action_routes(ctx)
    handlers = {
        **gets,
        **_summary_routes(ctx),
        **_rollout_routes(ctx),
        **_training_routes(ctx),
        **_resources_routes(ctx),
        **_changes_routes(ctx),
    }
    routes = [
        Route("/", index),
        *(Route(path, _api(handler, expected)) for path, handler in handlers.items()),
        *(Route(path, _api(handler, expected), methods=["POST"]) for path, handler in posts.items()),
        Route("/api/{rest:path}", unknown_api, methods=["GET", "POST", "PUT", "PATCH", "DELETE"]),
        Mount("/static", app=StaticFiles(directory=STATIC), name="static"),
    ]
    return Starlette(routes=[Route(PREFIX, to_index), Mount(PREFIX, routes=routes)])


def mount_dashboard(
    app: Any, store: StoreWithReadModel, *, token: str | None = None, metrics_dir: str | Path | None = None
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
    store: StoreWithReadModel, *, token: str | None = None, metrics_dir: str | Path | None = None
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
