"""The dashboard's in-memory rollout index: rewards, agent names and search texts per rollout, kept
between polls so that sorting and searching a 10k-rollout store takes a pass over a list, not the store.

What the index knows of a rollout beyond the rollout itself comes from the store's attempt digests
(``LightningStore.query_digests``: last reply, exception type, reward, agent), which the store keeps
as spans arrive: building the index reads one small row per rollout, never the spans.
"""

from __future__ import annotations

import asyncio
import operator
import time
from dataclasses import dataclass
from typing import Any

import orjson

from agl import semconv as sc
from agl.adapter.rewards import final_reward
from agl.dashboard import views
from agl.schemas import Rollout, RolloutStatus, Span
from agl.store.base import AttemptDigest, LightningStore

#: spans of one attempt shown on its page (the first ones by sequence id)
MAX_SPANS = 10_000
#: rollout ids asked for in one digest query
IDS_PER_QUERY = 500
#: rollouts (and digests) read per store call while the index is built: a page's own store calls wait
#: for one such read at most
READ_CHUNK = 250
#: rollouts search, filters and non-default sorts look through (newest first)
SCAN_ROLLOUTS = 100_000
#: how long one read of the rollout index serves searches (every poll of every tab)
INDEX_TTL_S = 0.5
SORTS = frozenset({"created", "reward", "duration"})
FINISHED = [RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED]


def haystack(rollout: Rollout, output: str | None) -> str:
    """What search looks through, lower-cased: the rollout id, its input (as JSON text), its last reply."""
    given = rollout.input if isinstance(rollout.input, str) else orjson.dumps(rollout.input).decode()
    return "\n".join((rollout.rollout_id, given, output or "")).lower()


def reward_facts(reward_spans: list[Span]) -> tuple[float | None, str | None]:
    """(final reward, agent name) of an attempt's reward spans, as its digest has them."""
    agent = next(
        (str(s.attributes[sc.AGENT_NAME]) for s in reward_spans if sc.AGENT_NAME in s.attributes), None
    )
    return final_reward(reward_spans), agent


class Digests:
    """Digests of given rollouts. A store that keeps them answers a query per ``IDS_PER_QUERY`` ids;
    for one that does not (a remote store), digests are read from the spans and kept once finished."""

    def __init__(self, store: LightningStore, max_entries: int = 200_000) -> None:
        self.store, self.max_entries = store, max_entries
        self._done: dict[str, AttemptDigest | None] = {}

    async def of(self, rollouts: list[Rollout]) -> list[AttemptDigest | None]:
        """The digest of each rollout's latest attempt (None: nothing recorded yet)."""
        keeps = self.store.keeps_digests
        todo = [r.rollout_id for r in rollouts if keeps or r.rollout_id not in self._done]
        found: dict[str, AttemptDigest] = {}
        step = IDS_PER_QUERY if keeps else max(len(todo), 1)  # the slow path scans once for all
        for n in range(0, len(todo), step):
            if n:
                await asyncio.sleep(0)  # let a page's own store calls in between
            page = await self.store.query_digests(rollout_ids=todo[n : n + step])
            found.update((d.rollout_id, d) for d in page.items)
        if not keeps:
            if len(self._done) + len(todo) >= self.max_entries:
                self._done.clear()
            self._done.update(
                (r.rollout_id, found.get(r.rollout_id)) for r in rollouts if r.status.is_terminal
            )
            return [
                found[r.rollout_id] if r.rollout_id in found else self._done.get(r.rollout_id)
                for r in rollouts
            ]
        return [found.get(r.rollout_id) for r in rollouts]

    async def facts(self, rollouts: list[Rollout]) -> list[tuple[float | None, str | None]]:
        """(reward, agent name) of each rollout."""
        return [(d.reward, d.agent) if d else (None, None) for d in await self.of(rollouts)]


@dataclass(slots=True)
class IndexRow:
    """One rollout as the list's filters and sorts read it: the rollout, its digest, and its list view
    and search text once built (plain fields: a query is one pass over 10k of them)."""

    rollout: Rollout
    digest: AttemptDigest | None
    reward: float | None = None
    agent: str | None = None
    error: str | None = None
    rollout_id: str = ""
    status: str = ""
    terminal: bool = False
    mode: str | None = None
    group_id: str | None = None
    resources_id: str | None = None
    _said: str | None = None
    _view: dict[str, Any] | None = None

    def __post_init__(self) -> None:  # copied out: reading a field of the pydantic model costs 1 µs
        r, d = self.rollout, self.digest
        self.rollout_id, self.status, self.terminal = r.rollout_id, r.status.value, r.status.is_terminal
        self.mode, self.group_id, self.resources_id = r.mode, r.group_id, r.resources_id
        self.reward, self.agent, self.error = (d.reward, d.agent, d.error_type) if d else (None, None, None)
        self._said = self._view = None

    def update(self, rollout: Rollout | None = None, digest: AttemptDigest | None | bool = False) -> bool:
        """Take the rollout's new state and/or digest (``False``: unchanged); whether anything changed."""
        new_rollout = self.rollout if rollout is None else rollout
        new_digest = self.digest if digest is False else digest
        assert not isinstance(new_digest, bool)
        if new_rollout == self.rollout and new_digest == self.digest:
            return False
        self.rollout, self.digest = new_rollout, new_digest
        self.__post_init__()
        return True

    @property
    def said(self) -> str:
        """What search looks through (see :func:`haystack`)."""
        if self._said is None:
            self._said = haystack(self.rollout, self.digest.reply if self.digest else None)
        return self._said

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
    """Every rollout (up to ``SCAN_ROLLOUTS``), newest first, with its digest, kept current by reading
    only the rollouts updated since the last read and the digests stamped since then (a store without
    stamped digests: those of unfinished rollouts): a search or sort over 10k rollouts must not reread
    them all on each poll. Each sort order is computed once per change of the index, so a query is one
    filtering pass over a presorted list. Reads go in chunks of ``READ_CHUNK`` with the event loop
    yielded between them, so building it in the background slows the page's other calls little."""

    #: a full reread this often catches an update stamped before the newest one seen but committed after it
    FULL_EVERY_S = 60.0

    def __init__(self, store: LightningStore, digests: Digests) -> None:
        self.store, self.digests = store, digests
        self._by_id: dict[str, IndexRow] = {}
        self._order: list[IndexRow] | None = None
        self._sorted: dict[tuple[str, bool], list[IndexRow]] = {}
        #: bumped whenever a row changes (a query's answer may then change)
        self.version = 0
        #: whether some rollout is unfinished
        self.running = False
        self._seen_until = float("-inf")
        self._stamp = 0
        self._read_at = float("-inf")
        self._full_at = float("-inf")
        self._lock = asyncio.Lock()

    async def rows(self) -> list[IndexRow]:
        """Every row, newest first (at most ``INDEX_TTL_S`` old)."""
        async with self._lock:
            if self._order is not None and time.monotonic() - self._read_at <= INDEX_TTL_S:
                return self._order
            keeps = self.store.keeps_digests
            first = self._order is None
            changed = await self._changed()
            # stamped digests first: one read past the rollouts' could miss a digest of a new attempt
            stamped = await self._stamped() if keeps else {}
            if first and keeps:  # ``_stamped`` read every digest: the rest have none yet
                fresh = {r.rollout_id: (r, stamped.pop(r.rollout_id, None)) for r in changed}
            else:
                again = (
                    changed
                    if keeps
                    else [*changed, *(x.rollout for x in self._by_id.values() if not x.terminal)]
                )
                again = list({r.rollout_id: r for r in again}.values())  # a changed one replaces its old self
                found = await self.digests.of(again)
                fresh = {r.rollout_id: (r, d) for r, d in zip(again, found, strict=True)}
            moved = False
            for n, (rollout_id, (rollout, digest)) in enumerate(fresh.items()):
                stamped.pop(rollout_id, None)  # read together with its rollout: as new
                row = self._by_id.get(rollout_id)
                if row is None:
                    self._by_id[rollout_id] = IndexRow(rollout, digest)
                    moved = True
                elif row.update(rollout, digest):
                    moved = True
                if n % 1000 == 999:
                    await asyncio.sleep(0)
            for rollout_id, digest in stamped.items():  # digests of rollouts that did not change
                row = self._by_id.get(rollout_id)
                if row is not None and row.update(digest=digest):
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

    async def _stamped(self) -> dict[str, AttemptDigest]:
        """Digests of latest attempts stamped since the last read (every one the first time)."""
        found: dict[str, AttemptDigest] = {}
        while True:
            page = await self.store.query_digests(after=self._stamp, limit=4 * READ_CHUNK)
            found.update((d.rollout_id, d) for d in page.items)
            if page.items:
                self._stamp = page.items[-1].stamp
            if page.next_cursor is None:
                return found
            await asyncio.sleep(0)

    async def _changed(self) -> list[Rollout]:
        """Rollouts updated since the last read (all of them the first time), newest update first."""
        found: list[Rollout] = []
        cursor = None
        if time.monotonic() - self._full_at > self.FULL_EVERY_S:
            self._seen_until, self._full_at = float("-inf"), time.monotonic()
        limit = 50 if self._seen_until > float("-inf") else READ_CHUNK
        while len(found) < SCAN_ROLLOUTS:
            page = await self.store.query_rollouts(
                order_by="updated_at", descending=True, limit=limit, cursor=cursor
            )
            found.extend(page.items)
            if (cursor := page.next_cursor) is None or page.items[-1].updated_at < self._seen_until:
                break
            limit = READ_CHUNK
            await asyncio.sleep(0)
        if found:
            self._seen_until = max(self._seen_until, found[0].updated_at)
        return [
            r
            for r in found
            if (known := self._by_id.get(r.rollout_id)) is None or known.rollout.updated_at != r.updated_at
        ]
