"""The store's read model: what the dashboard and analysis read beside the lifecycle core.

Runners, the trainer and algorithms need only :class:`~agl.store.base.LightningStore`. The dashboard
and analysis tools also read attempt digests (kept as spans arrive), rollout searches, statistics and
workers: :class:`StoreReadModel`. Every backend is both (:class:`StoreWithReadModel`): the SQL ones
answer in SQL (``_sql_read``), the in-memory one with :class:`InProcessReadModel` over its objects.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol

import orjson
from pydantic import BaseModel, Field, field_validator

from agl import semconv as sc
from agl.schemas import (
    Attempt,
    ResourcesVersion,
    Rollout,
    RolloutStatus,
    WireModel,
    Worker,
    WorkerStatus,
)
from agl.store.base import LightningStore, Page, check_limit


class StoreStatistics(BaseModel):
    """Counts by status and span volume; cheap enough to call every second."""

    rollouts_by_status: dict[str, int] = Field(default_factory=dict)
    attempts_by_status: dict[str, int] = Field(default_factory=dict)
    spans: int = 0
    span_bytes: int = 0
    resources: int = 0
    workers: int = 0


class AttemptDigest(BaseModel):
    """What a list of rollouts shows of an attempt without reading its spans, kept by the store as the
    spans arrive: its last model reply (text and tool-call names), the type of its last exception,
    its final reward (as ``agl.adapter.final_reward``), the agent named on its first reward span, and
    its model calls, the tool calls their replies asked for and their completion tokens.

    One call is often recorded twice, by the gateway and by a client-side tracer: the counts are kept
    per source, and ``calls`` is the larger source's count, with that source's tool calls and
    completion tokens (the gateway's when both counted as many calls)."""

    rollout_id: str
    attempt_id: str
    reply: str | None = None
    error_type: str | None = None
    reward: float | None = None
    agent: str | None = None
    calls: int = 0
    tool_calls: int = 0
    completion_tokens: int = 0
    #: increases with every change the store makes to a digest (0 where the store keeps none)
    stamp: int = 0


#: slot -> (value fields, whether its earliest span wins; else its latest). ``gw``/``tr``: the last
#: model call the gateway / a client-side tracer recorded (response id, reply); ``err``: exception
#: type; ``rw``/``rl``: reward without / with a response id; ``ag``: agent named on a reward span
DIGEST_SLOTS: dict[str, tuple[tuple[str, ...], bool]] = {
    "gw": (("gw_id", "gw_text"), False),
    "tr": (("tr_id", "tr_text"), False),
    "err": (("err_type",), False),
    "rw": (("rw_value",), False),
    "rl": (("rl_value",), False),
    "ag": (("ag_name",), True),
}
#: count slot -> its columns: the model calls, their replies' tool calls and their completion tokens
#: that the gateway (``gwn``) / a client-side tracer (``trn``) recorded; summed as spans arrive (so
#: concurrent writers add up), never replaced
DIGEST_COUNTS: dict[str, tuple[str, ...]] = {
    "gwn": ("gw_calls", "gw_tool_calls", "gw_tokens"),
    "trn": ("tr_calls", "tr_tool_calls", "tr_tokens"),
}
#: a digest's raw state: slot -> (sequence id, *values); count slot -> its counts
DigestState = dict[str, tuple[Any, ...]]


def span_digest(name: str, attributes: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """The digest slots one span fills (slot -> values), read from its name and attributes only (a
    stored span's JSON need not become a :class:`Span`)."""
    out: dict[str, tuple[Any, ...]] = {}
    if (sc.LLM_API in attributes or name == sc.SPAN_LLM_CALL) and name != sc.SPAN_EMBEDDINGS:
        message = attributes.get(sc.LLM_RESPONSE_MESSAGE)
        message = message if isinstance(message, dict) else {}
        content = message.get("content")
        text = content if isinstance(content, str) else ""
        names = [  # as the dashboard's ``output_text`` writes a reply
            str((c.get("function") or {}).get("name", c.get("name", "?")))
            for c in attributes.get(sc.LLM_TOOL_CALLS) or message.get("tool_calls") or []
            if isinstance(c, dict)
        ]
        text += "".join(f" [tool call {n}]" for n in names)
        response_id = attributes.get(sc.LLM_RESPONSE_ID)
        slot = "gw" if str(attributes.get(sc.LLM_SOURCE, "gateway")) == "gateway" else "tr"
        out[slot] = (str(response_id) if response_id else None, text)
        out[f"{slot}n"] = (1, len(names), completion_tokens(attributes))
    elif name == sc.SPAN_EXCEPTION:
        out["err"] = (str(attributes.get(sc.EXCEPTION_TYPE)),)
    elif name == sc.SPAN_REWARD:
        try:
            value = float(attributes[sc.REWARD_VALUE])
        except (KeyError, TypeError, ValueError):
            value = None
        if value is not None:
            out["rl" if sc.REWARD_RESPONSE_ID in attributes else "rw"] = (value,)
        if sc.AGENT_NAME in attributes:
            out["ag"] = (str(attributes[sc.AGENT_NAME]),)
    return out


def completion_tokens(attributes: Mapping[str, Any]) -> int:
    """A model call's completion tokens: the engine's token ids where recorded, else the reported usage
    (as ``agl.adapter.behaviour`` counts them)."""
    ids = attributes.get(sc.LLM_COMPLETION_TOKEN_IDS)
    if isinstance(ids, list):
        return len(ids)
    usage = attributes.get(sc.LLM_USAGE)
    reported = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return reported if isinstance(reported, int) and not isinstance(reported, bool) else 0


def merge_digest(state: DigestState, sequence_id: int, slots: Mapping[str, tuple[Any, ...]]) -> None:
    """Fold one span's slots into ``state``: the latest span wins a slot (the earliest for ``ag``);
    counts add up."""
    for slot, values in slots.items():
        known = state.get(slot)
        if slot in DIGEST_COUNTS:
            state[slot] = (
                values if known is None else tuple(a + b for a, b in zip(known, values, strict=True))
            )
            continue
        first = DIGEST_SLOTS[slot][1]
        if known is None or (sequence_id < known[0] if first else sequence_id > known[0]):
            state[slot] = (sequence_id, *values)


def merge_states(state: DigestState, other: DigestState) -> None:
    """Fold another state into ``state``, as if its spans had been merged after this one's."""
    for slot, values in other.items():
        if slot in DIGEST_COUNTS:
            merge_digest(state, 0, {slot: values})
        else:
            merge_digest(state, values[0], {slot: tuple(values[1:])})


def resolve_digest(rollout_id: str, attempt_id: str, stamp: int, state: DigestState) -> AttemptDigest:
    """The digest a state stands for."""
    return AttemptDigest(rollout_id=rollout_id, attempt_id=attempt_id, stamp=stamp, **digest_values(state))


def digest_values(state: DigestState) -> dict[str, Any]:
    """A digest state's reply, error type, reward, agent and counts. A tracer's record of the gateway's
    last response is that response (the gateway's record wins, as in ``agl.adapter.llm_calls``); the
    counts are the source's with more calls (see :class:`AttemptDigest`)."""
    gw, tr = state.get("gw"), state.get("tr")
    reply = None
    if tr is not None and (gw is None or (tr[0] > gw[0] and not (tr[1] and tr[1] == gw[1]))):
        reply = tr[2]
    elif gw is not None:
        reply = gw[2]
    reward = state.get("rw") or state.get("rl")
    return {
        "reply": reply,
        "error_type": state["err"][1] if "err" in state else None,
        "reward": reward[1] if reward else None,
        "agent": state["ag"][1] if "ag" in state else None,
        **counts_of(state.get("gwn"), state.get("trn")),
    }


def counts_of(gateway: Sequence[int] | None, tracer: Sequence[int] | None) -> dict[str, int]:
    """The digest's counts from each source's (calls, tool calls, completion tokens): the source with
    more calls, the gateway when tied."""
    chosen = tracer if tracer and (not gateway or tracer[0] > gateway[0]) else gateway
    calls, tools, tokens = chosen or (0, 0, 0)
    return {"calls": int(calls), "tool_calls": int(tools), "completion_tokens": int(tokens)}


RolloutSort = Literal["created", "reward", "duration", "calls"]


class RolloutSearch(WireModel):
    """What :meth:`LightningStore.search_rollouts` looks for: every given filter must hold.

    ``text`` is a case-insensitive substring of the rollout id, its input (a string as itself, anything
    else as compact JSON) or its latest attempt's last reply; ``agent``, ``error_type`` and the reward
    sort, and the calls bounds and sort (a rollout without a digest made none) read that attempt's digest;
    ``metadata`` keys must equal the given values. Sorts put rollouts without a value (no reward, not
    ended) last; ties go newest first.
    """

    text: str | None = None
    status: list[RolloutStatus] | None = None
    mode: str | None = None
    group_id: str | None = None
    resources_id: str | None = None
    agent: str | None = None
    error_type: str | None = None
    metadata: dict[str, str | int | float] | None = None
    #: the latest attempt's final reward within these bounds (inclusive); a rollout without one never matches
    reward_min: float | None = None
    reward_max: float | None = None
    #: the latest attempt's model calls (``AttemptDigest.calls``) within these bounds (inclusive)
    calls_min: int | None = Field(None, ge=0, le=10**15)
    calls_max: int | None = Field(None, ge=0, le=10**15)
    sort: RolloutSort = "created"
    descending: bool = True
    limit: int = Field(50, ge=1, le=10_000)
    offset: int = Field(0, ge=0, le=10**15)

    @field_validator("metadata")
    @classmethod
    def _plain_keys(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value and any('"' in key for key in value):
            raise ValueError("metadata keys to filter on cannot hold a double quote")  # SQLite's JSON paths
        return value


class ListedRollout(BaseModel):
    """A rollout and the digest of its latest attempt (None: nothing recorded yet)."""

    rollout: Rollout
    digest: AttemptDigest | None = None


class RolloutMatches(BaseModel):
    """One page of a search, and how many rollouts match in all."""

    items: list[ListedRollout]
    total: int


def search_text(rollout: Rollout) -> str:
    """What ``text`` is looked for in besides the reply, lower-cased: the rollout id and its input."""
    given = rollout.input if isinstance(rollout.input, str) else orjson.dumps(rollout.input).decode()
    return f"{rollout.rollout_id}\n{given}".lower()


def duration_s(rollout: Rollout) -> float | None:
    """Seconds from the first start to the end, or None while the rollout has not ended."""
    if rollout.ended_at is None:
        return None
    return rollout.ended_at - (rollout.started_at or rollout.created_at)


class StoreReadModel(ABC):
    """What the dashboard and analysis read: digests, search, statistics and workers."""

    @abstractmethod
    async def query_digests(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        after: int = 0,
        limit: int = 10_000,
    ) -> Page[AttemptDigest]:
        """Digests of each rollout's latest attempt (none for one without model calls, exceptions or
        rewards), by increasing ``stamp``, only those stamped after ``after``; ``next_cursor`` is the
        last stamp (pass it as ``after``) when more remain."""

    @abstractmethod
    async def search_rollouts(self, query: RolloutSearch) -> RolloutMatches:
        """Rollouts matching ``query`` (text, filters, digest facts), sorted and paged by the store."""

    @abstractmethod
    async def statistics(self) -> StoreStatistics: ...

    @abstractmethod
    async def get_worker(self, worker_id: str) -> Worker:
        """Raises NotFoundError for a worker that never called the store."""

    @abstractmethod
    async def query_workers(
        self, *, status: Sequence[WorkerStatus] | None = None, limit: int = 100, cursor: str | None = None
    ) -> Page[Worker]: ...


class StoreWithReadModel(LightningStore, StoreReadModel):
    """A backend: the lifecycle core and the read model over the same data (what ``open_store`` returns)."""


_ABSENT = object()  # a metadata key a rollout does not have


class InProcessRows(Protocol):
    """The objects an in-process backend holds, as :class:`InProcessReadModel` reads them."""

    rollouts: dict[str, Rollout]  # in insertion order
    search_texts: dict[str, str]  # rollout id -> ``search_text``
    rollout_attempts: dict[str, list[str]]  # rollout id -> its attempt ids, oldest first
    attempts: dict[str, Attempt]
    #: (rollout id, attempt id) -> (stamp, digest state), kept as spans arrive
    digests: dict[tuple[str, str], tuple[int, DigestState]]
    span_keys: set[tuple[str, str, str]]
    span_bytes: int
    versions: dict[str, ResourcesVersion]
    workers: dict[str, Worker]


class InProcessReadModel(StoreReadModel):
    """The read model over objects in this process (``_t``, read under ``_lock``), written once in Python;
    workers come from the lifecycle's own queries."""

    _lock: threading.Lock
    _t: InProcessRows

    async def query_digests(
        self,
        *,
        rollout_ids: Sequence[str] | None = None,
        after: int = 0,
        limit: int = 10_000,
    ) -> Page[AttemptDigest]:
        check_limit(limit)
        with self._lock:
            items = latest_digests(
                self._t, None if rollout_ids is None else list(dict.fromkeys(rollout_ids)), after
            )
        more = len(items) > limit
        return Page(items=items[:limit], next_cursor=str(items[limit - 1].stamp) if more else None)

    async def search_rollouts(self, query: RolloutSearch) -> RolloutMatches:
        with self._lock:
            return search(self._t, query)

    async def statistics(self) -> StoreStatistics:
        with self._lock:
            rollouts: dict[str, int] = {}
            for r in self._t.rollouts.values():
                rollouts[r.status.value] = rollouts.get(r.status.value, 0) + 1
            attempts: dict[str, int] = {}
            for a in self._t.attempts.values():
                attempts[a.status.value] = attempts.get(a.status.value, 0) + 1
            return StoreStatistics(
                rollouts_by_status=rollouts,
                attempts_by_status=attempts,
                spans=len(self._t.span_keys),
                span_bytes=self._t.span_bytes,
                resources=len(self._t.versions),
                workers=len(self._t.workers),
            )


def _within(value: float | None, low: float | None, high: float | None) -> bool:
    return value is not None and (low is None or value >= low) and (high is None or value <= high)


def latest_digests(rows: InProcessRows, rollout_ids: Sequence[str] | None, after: int) -> list[AttemptDigest]:
    """Digests of latest attempts stamped after ``after``, by stamp."""
    ids = rows.rollout_attempts.keys() if rollout_ids is None else rollout_ids
    out = []
    for rid in ids:
        attempts = rows.rollout_attempts.get(rid)
        if not attempts:
            continue
        found = rows.digests.get((rid, attempts[-1]))
        if found is not None and found[0] > after:
            out.append(resolve_digest(rid, attempts[-1], found[0], found[1]))
    return sorted(out, key=lambda d: d.stamp)


def search(rows: InProcessRows, q: RolloutSearch) -> RolloutMatches:
    """One pass over every rollout (oldest first) for those matching ``q``, then sorted and cut; a
    digest is resolved only where a filter, the sort or the text needs it."""
    needle = q.text.lower() if q.text else None
    equal = [(k, v) for k, v in (("mode", q.mode), ("group_id", q.group_id)) if v is not None]
    if q.resources_id is not None:
        equal.append(("resources_id", q.resources_id))
    equal_facts = [(k, v) for k, v in (("agent", q.agent), ("error_type", q.error_type)) if v is not None]
    bounded = q.reward_min is not None or q.reward_max is not None
    counted = q.calls_min is not None or q.calls_max is not None
    found: list[tuple[int, Any, Rollout, tuple[str, str] | None]] = []
    for pos, (rid, rollout) in enumerate(rows.rollouts.items()):
        if (
            (q.status is not None and rollout.status not in q.status)
            or (equal and any(getattr(rollout, k) != v for k, v in equal))
            or (q.metadata and any(rollout.metadata.get(k, _ABSENT) != v for k, v in q.metadata.items()))
        ):
            continue
        attempts = rows.rollout_attempts.get(rid)
        key = (rid, attempts[-1]) if attempts else None
        kept = rows.digests.get(key) if key else None
        unmatched = needle is not None and needle not in rows.search_texts[rid]
        wanted = equal_facts or unmatched or bounded or counted or q.sort in ("reward", "calls")
        facts = digest_values(kept[1]) if kept and wanted else {}
        if (
            (equal_facts and any(facts.get(k) != v for k, v in equal_facts))
            or (unmatched and needle not in (facts.get("reply") or "").lower())
            or (bounded and not _within(facts.get("reward"), q.reward_min, q.reward_max))
            or (counted and not _within(facts.get("calls", 0), q.calls_min, q.calls_max))
        ):
            continue
        value: Any = pos
        if q.sort == "duration":
            value = duration_s(rollout)
        elif q.sort != "created":  # a digest's reward (None: none) or calls (0: no digest)
            value = facts.get(q.sort, 0 if q.sort == "calls" else None)
        found.append((pos, value, rollout, key if kept else None))
    found.reverse()  # newest first, and a stable sort keeps ties so
    known = sorted((x for x in found if x[1] is not None), key=lambda x: x[1], reverse=q.descending)
    ordered = known + [x for x in found if x[1] is None]
    items = []
    for _, _, rollout, key in ordered[q.offset : q.offset + q.limit]:
        digest = None
        if key is not None:
            stamp, state = rows.digests[key]
            digest = resolve_digest(*key, stamp, state)
        items.append(ListedRollout(rollout=rollout.model_copy(), digest=digest))
    return RolloutMatches(items=items, total=len(ordered))
