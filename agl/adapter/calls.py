"""Model calls out of a rollout's spans, in sequence order, optionally for some agents only.

A call's agent is, in order: its own ``agl.agent.name`` tag (the gateway sets it from an agent
endpoint or header; the tracer from ``agl.agent_scope``), that of the client-side tracer record of
the same response, or that of the nearest enclosing span that carries one. ``filter_calls`` also
accepts a call under a span *named* like the agent (``agl.operation("writer")``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Sequence

from agl import semconv as sc
from agl.schemas import LLMCall, Span


def llm_calls(spans: Iterable[Span]) -> list[LLMCall]:
    """Every model call the spans record (gateway or tracer), ordered by ``sequence_id``.

    When the gateway and client-side tracing both recorded the same response, the gateway's
    record (which carries the engine's token ids) wins, and takes the tracer's agent name if it has none.
    """
    calls = sorted(
        (c for c in (LLMCall.from_span(s) for s in spans) if c is not None), key=lambda c: c.sequence_id
    )
    gateway_ids = {c.response_id for c in calls if c.source == "gateway" and c.response_id}
    traced = {
        c.response_id: c
        for c in calls
        if c.source != "gateway" and c.response_id and c.response_id in gateway_ids
    }
    out = []
    for c in calls:
        if c.source != "gateway" and c.response_id in gateway_ids:
            continue
        twin = traced.get(c.response_id) if c.source == "gateway" and c.response_id else None
        if twin is not None and c.agent_name is None and twin.agent_name is not None:
            c = dataclasses.replace(c, agent_name=twin.agent_name)
        out.append(c)
    return out


class _Tree:
    """Parent links of a rollout's spans, and the tracer twin (same response id) of each gateway call."""

    def __init__(self, spans: Iterable[Span]) -> None:
        self.by_id = {s.span_id: s for s in spans}
        self.twins: dict[str, str] = {}
        for s in self.by_id.values():
            rid = s.attributes.get(sc.LLM_RESPONSE_ID)
            if rid and s.attributes.get(sc.LLM_SOURCE, "gateway") != "gateway":
                self.twins.setdefault(str(rid), s.span_id)

    def ancestors(self, call: LLMCall) -> Iterator[Span]:
        """Enclosing spans of the call, then of its tracer twin (nearest first)."""
        starts = [call.span_id]
        if call.response_id and call.response_id in self.twins:
            starts.append(self.twins[call.response_id])
        seen: set[str] = set()
        for start in starts:
            parent = self.by_id[start].parent_id if start in self.by_id else None
            while parent is not None and parent in self.by_id and parent not in seen:
                seen.add(parent)
                yield self.by_id[parent]
                parent = self.by_id[parent].parent_id


def call_agents(calls: Sequence[LLMCall], spans: Iterable[Span] = ()) -> list[str | None]:
    """The agent name of each call (see the module docstring), None when nothing names one."""
    tree = _Tree(spans)
    out: list[str | None] = []
    for c in calls:
        name = c.agent_name
        if name is None:
            name = next(
                (
                    str(p.attributes[sc.AGENT_NAME])
                    for p in tree.ancestors(c)
                    if sc.AGENT_NAME in p.attributes
                ),
                None,
            )
        out.append(name)
    return out


def filter_calls(
    calls: Sequence[LLMCall], agent: str | re.Pattern[str] | None, spans: Iterable[Span] = ()
) -> list[LLMCall]:
    """Only the calls of ``agent``: by agent name (see :func:`call_agents`) or under a span named so.

    A string must match exactly; a compiled regex is searched.
    """
    if agent is None:
        return list(calls)
    spans = list(spans)
    tree = _Tree(spans)

    def matches(name: str | None) -> bool:
        if name is None:
            return False
        return name == agent if isinstance(agent, str) else agent.search(name) is not None

    return [
        c
        for c, name in zip(calls, call_agents(calls, spans), strict=True)
        if matches(name) or any(matches(p.name) for p in tree.ancestors(c))
    ]
