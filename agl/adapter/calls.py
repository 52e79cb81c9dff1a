"""Model calls out of a rollout's spans, in sequence order, optionally for some agents only."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from agl.schemas import LLMCall, Span


def llm_calls(spans: Iterable[Span]) -> list[LLMCall]:
    """Every model call the spans record (gateway or tracer), ordered by ``sequence_id``.

    When the gateway and client-side tracing both recorded the same response, the gateway's
    record (which carries the engine's token ids) wins.
    """
    calls = sorted(
        (c for c in (LLMCall.from_span(s) for s in spans) if c is not None), key=lambda c: c.sequence_id
    )
    gateway_ids = {c.response_id for c in calls if c.source == "gateway" and c.response_id}
    return [c for c in calls if c.source == "gateway" or c.response_id not in gateway_ids]


def filter_calls(
    calls: Sequence[LLMCall], agent: str | re.Pattern[str] | None, spans: Iterable[Span] = ()
) -> list[LLMCall]:
    """Only the calls of ``agent``: tagged with ``agl.agent.name``, or under a span named so (given ``spans``).

    A string must match exactly; a compiled regex is searched.
    """
    if agent is None:
        return list(calls)

    def matches(name: str | None) -> bool:
        if name is None:
            return False
        return name == agent if isinstance(agent, str) else agent.search(name) is not None

    by_id = {s.span_id: s for s in spans}

    def under_agent(span_id: str) -> bool:
        seen: set[str] = set()
        parent = by_id[span_id].parent_id if span_id in by_id else None
        while parent is not None and parent in by_id and parent not in seen:
            seen.add(parent)
            if matches(by_id[parent].name):
                return True
            parent = by_id[parent].parent_id
        return False

    return [c for c in calls if matches(c.agent_name) or under_agent(c.span_id)]
