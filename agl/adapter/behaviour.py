"""What agents did, as numbers per step: calls, tool use, reply length, cut-off replies, emitted values.

A reward curve says whether an agent got better; these say how (it learned to call the tool) or what
it hacked (replies shrank to nothing). Any number or flag an agent records with ``agl.emit_object``
(a dict's top-level numbers and booleans, or a bare number) becomes a curve of its own, with no
configuration: ``emit_object({"recursion_limit_hit": True})`` charts as ``emitted_recursion_limit_hit``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from agl import semconv as sc
from agl.adapter.calls import llm_calls
from agl.schemas import LLMCall, Span

#: distinct emitted names charted per step; more would bury the curves people look for
MAX_EMITTED = 20
_NAME = re.compile(r"[^A-Za-z0-9_]+")


def emitted_numbers(spans: Iterable[Span]) -> dict[str, float]:
    """The numbers and flags a rollout emitted with ``emit_object``, the last value of each name."""
    out: dict[str, float] = {}
    for span in spans:
        if span.name != sc.SPAN_OBJECT:
            continue
        value = span.attributes.get(sc.OBJECT_VALUE)
        items = value.items() if isinstance(value, Mapping) else [("value", value)]
        for key, v in items:
            if isinstance(v, bool | int | float):
                out[_NAME.sub("_", str(key)).strip("_") or "value"] = float(v)
    return out


def rollout_behaviour(spans: Sequence[Span]) -> dict[str, float]:
    """One rollout's counts: model calls, calls with a tool call, completion tokens, replies cut off."""
    calls = llm_calls(spans)
    return {
        "calls": float(len(calls)),
        "tool_calls": float(sum(1 for c in calls if c.tool_calls)),
        "completion_tokens": float(sum(_completion_tokens(c) for c in calls)),
        "cut_off": float(sum(1 for c in calls if c.finish_reason == "length")),
    }


def _completion_tokens(call: LLMCall) -> int:
    """The engine's count when it returned token ids, else the usage the backend reported."""
    if call.completion_token_ids is not None:
        return len(call.completion_token_ids)
    reported = (call.usage or {}).get("completion_tokens")
    return reported if isinstance(reported, int) else 0


def step_behaviour(spans_by_rollout: Mapping[str, Sequence[Span]]) -> dict[str, float]:
    """A step's behaviour metrics over its rollouts: calls per rollout, the share of calls that call a
    tool and of replies cut off at the token limit, completion tokens per call, and each emitted
    name's mean over the rollouts that emitted it."""
    if not spans_by_rollout:
        return {}
    totals: dict[str, float] = defaultdict(float)
    emitted: dict[str, list[float]] = defaultdict(list)
    for spans in spans_by_rollout.values():
        for key, value in rollout_behaviour(spans).items():
            totals[key] += value
        for name, value in emitted_numbers(spans).items():
            if name in emitted or len(emitted) < MAX_EMITTED:
                emitted[name].append(value)
    calls = totals["calls"]
    out = {
        "behaviour_calls_per_rollout": calls / len(spans_by_rollout),
        "behaviour_tool_call_rate": totals["tool_calls"] / calls if calls else 0.0,
        "behaviour_completion_tokens": totals["completion_tokens"] / calls if calls else 0.0,
        "behaviour_cut_off_rate": totals["cut_off"] / calls if calls else 0.0,
    }
    out.update({f"emitted_{name}": sum(v) / len(v) for name, v in sorted(emitted.items())})
    return out


__all__ = ["MAX_EMITTED", "emitted_numbers", "rollout_behaviour", "step_behaviour"]
