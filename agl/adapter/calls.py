"""Model calls out of a rollout's spans, in sequence order, optionally for some agents only.

A call's agent is, in order: its own ``agl.agent.name`` tag (the gateway sets it from an agent
endpoint or header; the tracer from ``agl.agent_scope``), that of a client-side tracer record of the
same call (:func:`duplicates`), or that of the nearest enclosing span that carries one.
``filter_calls`` also accepts a call under a span *named* like the agent (``agl.operation("writer")``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from agl import semconv as sc
from agl.schemas import LLMCall, Span


def _reply(call: LLMCall) -> tuple[str, tuple[tuple[str, Any], ...]] | None:
    """What a call answered (text, and each tool call's name and parsed arguments), to recognise the
    same call in two records; None when the record holds no reply."""
    message = call.response_message
    if not isinstance(message, dict):
        return None
    calls = []
    for tool_call in call.tool_calls:
        fn = tool_call.get("function", {}) if isinstance(tool_call, dict) else {}
        args = fn.get("arguments") if isinstance(fn, dict) else None
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = args
        calls.append(
            (str(fn.get("name")) if isinstance(fn, dict) else "", json.dumps(parsed, sort_keys=True))
        )
    return str(message.get("content") or "").strip(), tuple(calls)


def duplicates(calls: Sequence[LLMCall]) -> dict[str, str]:
    """Each record that repeats another record's call (by span id), mapped to the record kept for it.

    One call may be recorded by the gateway and by client-side tracers (openai's and LangChain's
    instrumentors both, when both are on). The gateway's record is kept, else the first traced one.
    Records with one response id are one call; a traced record without one (LangChain's streamed calls
    carry none) is the same call as the first kept record with the same reply (gateway's first) that no
    other such record took. A traced record with an id no gateway record has went past the gateway.
    """
    ordered = sorted(calls, key=lambda c: c.sequence_id)
    gateway = [c for c in ordered if c.source == "gateway"]
    kept = {c.response_id: c.span_id for c in gateway if c.response_id}
    out: dict[str, str] = {}
    anonymous: list[LLMCall] = []
    traced_kept: list[LLMCall] = []
    for c in ordered:
        if c.source == "gateway":
            continue
        if not c.response_id:
            anonymous.append(c)
        elif c.response_id in kept:
            out[c.span_id] = kept[c.response_id]
        else:
            kept[c.response_id] = c.span_id
            traced_kept.append(c)
    replies = {c.span_id: _reply(c) for c in [*gateway, *traced_kept]}
    claimed: set[str] = set()
    for c in anonymous:
        reply = _reply(c)
        match = next(
            (k for k, r in replies.items() if k not in claimed and reply is not None and r == reply), None
        )
        if match is not None:
            claimed.add(match)
            out[c.span_id] = match
    return out


def llm_calls(spans: Iterable[Span]) -> list[LLMCall]:
    """Every model call the spans record (gateway or tracer), ordered by ``sequence_id``, each once.

    When the gateway and client-side tracing both recorded the same call (see :func:`duplicates`),
    the gateway's record (which carries the engine's token ids) wins, and takes a tracer record's agent
    name if it has none.
    """
    calls = sorted(
        (c for c in (LLMCall.from_span(s) for s in spans) if c is not None), key=lambda c: c.sequence_id
    )
    twins = duplicates(calls)
    names: dict[str, str] = {}
    for c in calls:
        if c.span_id in twins and c.agent_name is not None:
            names.setdefault(twins[c.span_id], c.agent_name)
    out = []
    for c in calls:
        if c.span_id in twins:
            continue
        if c.agent_name is None and c.span_id in names:
            c = dataclasses.replace(c, agent_name=names[c.span_id])
        out.append(c)
    return out


class _Tree:
    """Parent links of a rollout's spans, and the other records (tracer twins) of each kept call record."""

    def __init__(self, spans: Iterable[Span]) -> None:
        self.by_id = {s.span_id: s for s in spans}
        calls = [c for c in (LLMCall.from_span(s) for s in self.by_id.values()) if c is not None]
        self.twins: dict[str, list[str]] = {}
        for tracer, gateway in duplicates(calls).items():
            self.twins.setdefault(gateway, []).append(tracer)

    def ancestors(self, call: LLMCall) -> Iterator[Span]:
        """Enclosing spans of the call, then of its tracer twin (nearest first)."""
        starts = [call.span_id, *self.twins.get(call.span_id, [])]
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


def answered_by(call: LLMCall, model: str) -> bool:
    """Whether ``model`` answered ``call``: the recorded model is ``model``, or vLLM's ``model@version``."""
    answered = call.model or ""
    return answered == model or answered.startswith(f"{model}@")


def calls_by_agent(
    calls: Sequence[LLMCall], spans: Iterable[Span], agents: Sequence[str] = (), *, own_model: bool = False
) -> dict[str | None, list[LLMCall]]:
    """A rollout's calls by agent, in call order: every call under its own agent (None: unnamed) when
    ``agents`` is empty, else only the calls of the named agents (as :func:`filter_calls` finds them;
    a call both name-tagged and under a span named for another agent goes to its tag's agent).

    ``own_model``: only the calls each agent's own model (named like the agent: its LoRA adapter)
    answered; a call tagged after it ran (``agl.agent_scope``, a span's name) reached another model.
    """
    spans = list(spans)
    names = call_agents(calls, spans)
    out: dict[str | None, list[LLMCall]] = {}
    if not agents:
        for call, name in zip(calls, names, strict=True):
            out.setdefault(name, []).append(call)
        return out
    tree = _Tree(spans)
    for call, name in zip(calls, names, strict=True):
        owner = name if name in agents else None
        if owner is None:
            owner = next((p.name for p in tree.ancestors(call) if p.name in agents), None)
        if owner is not None and (not own_model or answered_by(call, owner)):
            out.setdefault(owner, []).append(call)
    return {agent: out[agent] for agent in agents if agent in out}
