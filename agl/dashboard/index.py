"""The dashboard's in-memory rollout index: rewards, agent names and search texts per rollout, kept
between polls so that sorting and searching a 10k-rollout store takes a pass over a list, not the store."""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from agl import semconv as sc
from agl.adapter.rewards import final_reward
from agl.dashboard import training, views
from agl.schemas import Rollout, RolloutStatus, Span
from agl.store.base import LightningStore

#: spans of one attempt shown on its page (the first ones by sequence id)
MAX_SPANS = 10_000
#: uncached rollouts beyond which rewards are read by one scan of the store's reward spans
BULK_AFTER = 64
#: rollouts search, filters and non-default sorts look through (newest first)
SCAN_ROLLOUTS = 100_000
#: how long one read of the rollout index serves searches (every poll of every tab)
INDEX_TTL_S = 0.5
SORTS = frozenset({"created", "reward", "duration"})
FINISHED = [RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED]


def haystack(rollout: Rollout, output: str) -> str:
    """What search looks through, lower-cased: the rollout id, its input (as JSON text), its last reply."""
    given = rollout.input if isinstance(rollout.input, str) else orjson.dumps(rollout.input).decode()
    return "\n".join((rollout.rollout_id, given, output)).lower()


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
        found = reward_facts(page.items)
        if rollout.status.is_terminal:
            if len(self._done) >= self.max_entries:
                self._done.clear()
            self._done[rollout.rollout_id] = found
        return found

    async def facts(self, rollouts: list[Rollout]) -> list[tuple[float | None, str | None]]:
        """(reward, agent name) of each rollout."""
        missing = [r for r in rollouts if r.rollout_id not in self._done and r.status.is_terminal]
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
            self._done[rollout_id] = reward_facts(found.get(rollout_id, []))


def reward_facts(reward_spans: list[Span]) -> tuple[float | None, str | None]:
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
            # seconds of parsing for a large store: off the event loop, so other requests are served
            done = await asyncio.to_thread(lambda: {rid: self._of(found.get(rid, [])) for rid in wanted})
            if len(self._done) + len(wanted) >= self.max_entries:
                self._done.clear()
            self._done.update(done)
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


@dataclass(slots=True)
class IndexRow:
    """One rollout as the list's filters and sorts read it: the rollout, its reward and agent name, and
    its list view once built (plain fields: a query is one pass over 10k of them)."""

    rollout: Rollout
    reward: float | None
    agent: str | None
    rollout_id: str = ""
    status: str = ""
    terminal: bool = False
    mode: str | None = None
    group_id: str | None = None
    resources_id: str | None = None
    #: a finished rollout's (search text, error type), once read
    said: tuple[str, str | None] | None = None
    _view: dict[str, Any] | None = None

    def __post_init__(self) -> None:  # copied out: reading a field of the pydantic model costs 1 µs
        r = self.rollout
        self.rollout_id, self.status, self.terminal = r.rollout_id, r.status.value, r.status.is_terminal
        self.mode, self.group_id, self.resources_id = r.mode, r.group_id, r.resources_id

    def update(self, rollout: Rollout, reward: float | None, agent: str | None) -> bool:
        """Take the rollout's new state; whether anything changed."""
        if (self.rollout, self.reward, self.agent) == (rollout, reward, agent):
            return False
        self.rollout, self.reward, self.agent, self._view = rollout, reward, agent, None
        self.__post_init__()
        return True

    def view(self) -> dict[str, Any]:
        if self._view is None:
            self._view = views.rollout_view(self.rollout, self.reward, self.agent)
        return self._view


def _ordered(rows: list[IndexRow], sort: str, descending: bool) -> list[IndexRow]:
    """``rows`` (newest first) by reward, duration or creation; rows without a value (running, no
    reward) go last, newest first. Stable, so sorting everything once and filtering afterwards gives
    the same order as filtering first."""
    if sort == "created":
        return sorted(rows, key=lambda x: x.rollout.created_at, reverse=descending)
    values = [x.reward for x in rows] if sort == "reward" else [views.duration_s(x.rollout) for x in rows]
    known = [(v, n) for n, v in enumerate(values) if v is not None]
    known.sort(key=operator.itemgetter(0), reverse=descending)  # stable: ties stay newest first
    return [rows[n] for _, n in known] + [x for x, v in zip(rows, values, strict=True) if v is None]


class RolloutIndex:
    """Every rollout (up to ``SCAN_ROLLOUTS``), newest first, with its reward and agent name, kept current
    by reading only the rollouts updated since the last read (and the facts of unfinished ones): a search
    or sort over 10k rollouts must not reread them all on each poll. Each sort order is computed once per
    change of the index, so a query is one filtering pass over a presorted list."""

    #: a full reread this often catches an update stamped before the newest one seen but committed after it
    FULL_EVERY_S = 60.0

    def __init__(self, store: LightningStore, cache: RewardCache) -> None:
        self.store, self.cache = store, cache
        self._by_id: dict[str, IndexRow] = {}
        self._order: list[IndexRow] | None = None
        self._sorted: dict[tuple[str, bool], list[IndexRow]] = {}
        #: bumped whenever a row changes (a query's answer may then change)
        self.version = 0
        #: whether some rollout is unfinished (its search text may then change at any time)
        self.running = False
        self._seen_until = float("-inf")
        self._read_at = float("-inf")
        self._full_at = float("-inf")
        self._lock = asyncio.Lock()

    async def rows(self) -> list[IndexRow]:
        """Every row, newest first (at most ``INDEX_TTL_S`` old)."""
        async with self._lock:
            if self._order is not None and time.monotonic() - self._read_at <= INDEX_TTL_S:
                return self._order
            changed = await self._changed()
            running = [x.rollout for x in self._by_id.values() if not x.terminal]
            fresh = {r.rollout_id: r for r in (*running, *changed)}  # a changed one replaces its old self
            facts = await self.cache.facts(list(fresh.values()))
            moved = bool(changed)
            for rollout, (reward, agent) in zip(fresh.values(), facts, strict=True):
                row = self._by_id.get(rollout.rollout_id)
                if row is None:
                    self._by_id[rollout.rollout_id] = IndexRow(rollout, reward, agent)
                elif row.update(rollout, reward, agent):
                    moved = True
            if moved or self._order is None:
                order = sorted(self._by_id.values(), key=lambda x: x.rollout.created_at, reverse=True)
                self._order = order[:SCAN_ROLLOUTS]
                self._sorted = {}
                self.version += 1
                self.running = any(not x.terminal for x in self._order)
            self._read_at = time.monotonic()
            return self._order

    async def ordered(self, sort: str, descending: bool) -> list[IndexRow]:
        """Every row in the order of ``sort``, computed once per change of the index."""
        rows = await self.rows()
        if sort == "created" and descending:
            return rows
        key = (sort, descending)
        if key not in self._sorted:
            self._sorted[key] = _ordered(rows, sort, descending)
        return self._sorted[key]

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
            if (known := self._by_id.get(r.rollout_id)) is None or known.rollout.updated_at != r.updated_at
        ]
