"""What the agent learned, or hacked: the same task across policy versions, and the tasks that changed.

A task is its input (canonical JSON); its rollouts at each resources version are compared by mean
reward, and their replies (from the store's digests) are shown side by side. ``changes`` lists the
tasks whose reward moved between two versions (held-out ones by default: mode ``val``), largest move
first; ``task_history`` is one task at every version, with its calls and tool use.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from agl.adapter.behaviour import rollout_behaviour
from agl.dashboard import views
from agl.errors import NotFoundError
from agl.schemas import ResourcesVersion
from agl.store.read_model import ListedRollout, RolloutSearch, StoreWithReadModel

#: rollouts read for one comparison (a validation set times its versions)
MAX_READ = 20_000
#: a reward move smaller than this is no change (float noise of a mean)
EPS = 1e-9
#: resources versions a dashboard keeps read
KNOWN_VERSIONS = 10_000


def task_key(given: Any) -> str:
    """A short stable id of a task input: its canonical JSON's hash (the same input, the same key)."""
    raw = orjson.dumps(given, option=orjson.OPT_SORT_KEYS, default=repr)
    return hashlib.sha1(raw).hexdigest()[:12]


@dataclass(slots=True)
class _Cell:
    """One task at one version: its rollouts' rewards and the first reply."""

    rewards: list[float] = field(default_factory=list)
    rollout_ids: list[str] = field(default_factory=list)
    reply: str | None = None

    @property
    def mean(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    def view(self) -> dict[str, Any]:
        return {
            "reward": self.mean,
            "n": len(self.rollout_ids),
            "rollout_id": self.rollout_ids[0],
            "reply": self.reply,
        }


async def _listed(
    store: StoreWithReadModel, mode: str | None, text: str | None = None
) -> list[ListedRollout]:
    rows: list[ListedRollout] = []
    while len(rows) < MAX_READ:
        page = await store.search_rollouts(
            RolloutSearch(
                mode=mode, text=text, sort="created", descending=False, limit=1000, offset=len(rows)
            )
        )
        rows += page.items
        if not page.items or len(rows) >= page.total:
            break
    return rows


class Versions:
    """Resources versions by id, each read from the store once (a version never changes once added), so
    a polled comparison costs one store call: the search."""

    def __init__(self, store: StoreWithReadModel) -> None:
        self.store = store
        self.known: OrderedDict[str, ResourcesVersion] = OrderedDict()  # oldest read first

    async def get(self, ids: set[str]) -> dict[str, ResourcesVersion]:
        """The versions ``ids`` name that the store holds."""
        found = {rid: v for rid in ids if (v := self.known.get(rid)) is not None}
        for v in await asyncio.gather(*(self._read(rid) for rid in sorted(ids - found.keys()))):
            if v is not None:
                found[v.resources_id] = self.known[v.resources_id] = v
        while len(self.known) > KNOWN_VERSIONS:
            self.known.popitem(last=False)
        return found

    async def _read(self, resources_id: str) -> ResourcesVersion | None:
        try:
            return await self.store.get_resources(resources_id)
        except NotFoundError:
            return None  # not kept: it may be added later


def _table(rows: Sequence[ListedRollout]) -> tuple[dict[str, dict[str, _Cell]], dict[str, Any]]:
    """``{resources_id: {task key: cell}}`` and each task key's input."""
    cells: dict[str, dict[str, _Cell]] = {}
    inputs: dict[str, Any] = {}
    for row in rows:
        r = row.rollout
        if r.resources_id is None:
            continue
        key = task_key(r.input)
        if key not in inputs:
            inputs[key] = r.input
        tasks = cells.get(r.resources_id)
        if tasks is None:
            tasks = cells[r.resources_id] = {}
        cell = tasks.get(key)
        if cell is None:
            cell = tasks[key] = _Cell()
        cell.rollout_ids.append(r.rollout_id)
        digest = row.digest
        if digest is not None:
            if digest.reward is not None:
                cell.rewards.append(digest.reward)
            if cell.reply is None:
                cell.reply = digest.reply
    return cells, inputs


def _version_view(v: ResourcesVersion, cells: dict[str, _Cell]) -> dict[str, Any]:
    means = [m for c in cells.values() if (m := c.mean) is not None]
    return {
        "resources_id": v.resources_id,
        "version": v.version,
        "model_version": views.model_version(v),
        "label": views.version_label(v),
        "tasks": len(cells),
        "mean": sum(means) / len(means) if means else None,
    }


async def changes(
    store: StoreWithReadModel,
    mode: str = "val",
    before: str | None = None,
    after: str | None = None,
    known: Versions | None = None,
) -> dict[str, Any]:
    """The tasks of ``mode`` whose mean reward moved from version ``before`` to ``after`` (by default
    the first and the last version that ran them), with both replies; and every such version (read
    through ``known``, a dashboard's, where given)."""
    cells, inputs = _table(await _listed(store, mode))
    versions = await (known or Versions(store)).get(set(cells))
    ordered = sorted(versions.values(), key=lambda v: v.version)
    listed = [_version_view(v, cells[v.resources_id]) for v in ordered]
    for name, given in (("before", before), ("after", after)):
        if given is not None and given not in cells:
            raise NotFoundError(f"{name}: no {mode} rollout ran at resources version {given!r}")
    if len(ordered) < 2 and (before is None or after is None):
        return {
            "mode": mode,
            "versions": listed,
            "before": None,
            "after": None,
            "changed": [],
            "same": 0,
            "steps": [],
        }
    a = before or ordered[0].resources_id
    b = after or ordered[-1].resources_id
    changed, same = _compare(cells[a], cells[b])
    steps = []  # each version against the one before it: where the changes happened
    for was, now in zip(ordered, ordered[1:], strict=False):
        moved, _ = _compare(cells[was.resources_id], cells[now.resources_id])
        up = sum(1 for _, delta, _ in moved if delta > 0)
        steps.append(
            {"before": was.resources_id, "after": now.resources_id, "up": up, "down": len(moved) - up}
        )
    return {
        "mode": mode,
        "versions": listed,
        "before": a,
        "after": b,
        "changed": [
            {
                "task": key,
                "input": views.redact(inputs[key]),
                "delta": delta,
                "before": x.view(),
                "after": y.view(),
            }
            for key, delta, (x, y) in changed
        ],
        "same": same,
        "only_before": len(set(cells[a]) - set(cells[b])),
        "only_after": len(set(cells[b]) - set(cells[a])),
        "steps": steps,
    }


Moved = tuple[str, float, tuple[_Cell, _Cell]]


def _compare(was: dict[str, _Cell], now: dict[str, _Cell]) -> tuple[list[Moved], int]:
    """The tasks both versions ran whose mean reward moved (largest move first), and how many did not."""
    changed: list[Moved] = []
    same = 0
    for key in sorted(set(was) & set(now)):
        x, y = was[key], now[key]
        if x.mean is None or y.mean is None:
            continue
        delta = y.mean - x.mean
        if abs(delta) <= EPS:
            same += 1
        else:
            changed.append((key, delta, (x, y)))
    changed.sort(key=lambda row: (-abs(row[1]), row[0]))
    return changed, same


async def task_history(
    store: StoreWithReadModel, rollout_id: str, mode: str | None = None, known: Versions | None = None
) -> dict[str, Any]:
    """The task of ``rollout_id`` at every version that ran it (of ``mode``, or any): reward, reply,
    calls and tool use. The store's text search narrows the rollouts to those whose input contains this
    one's; the task key keeps the exact matches."""
    given = (await store.get_rollout(rollout_id)).input
    key = task_key(given)
    text = given if isinstance(given, str) else orjson.dumps(given).decode()
    rows = [row for row in await _listed(store, mode, text) if task_key(row.rollout.input) == key]
    versions = await (known or Versions(store)).get(
        {r.rollout.resources_id for r in rows if r.rollout.resources_id}
    )
    spans = await asyncio.gather(
        *(store.query_spans(rollout_id=r.rollout.rollout_id, attempt_id="latest", limit=10_000) for r in rows)
    )
    out = []
    for row, page in zip(rows, spans, strict=True):
        r = row.rollout
        version = versions.get(r.resources_id or "")
        did = rollout_behaviour(page.items)
        out.append(
            {
                "rollout_id": r.rollout_id,
                "mode": r.mode,
                "status": r.status.value,
                "resources_id": r.resources_id,
                "version": version.version if version else None,
                "model_version": views.model_version(version) if version else None,
                "label": views.version_label(version) if version else None,
                "reward": row.digest.reward if row.digest else None,
                "reply": row.digest.reply if row.digest else None,
                "calls": int(did["calls"]),
                "tool_calls": int(did["tool_calls"]),
            }
        )
    out.sort(key=lambda x: (x["version"] is None, x["version"] or 0, x["mode"], x["rollout_id"]))
    return {"task": key, "input": views.redact(given), "rollouts": out}


__all__ = ["changes", "task_history", "task_key"]
