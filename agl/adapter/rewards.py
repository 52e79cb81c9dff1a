"""Rewards out of spans: the rollout's final reward, and rewards linked to single model calls."""

from __future__ import annotations

from collections.abc import Iterable

from agl import semconv as sc
from agl.schemas import Span


def final_reward(spans: Iterable[Span]) -> float | None:
    """The primary value of the last reward span (the returned reward is emitted last), if any."""
    rewards = sorted((s for s in spans if s.name == sc.SPAN_REWARD), key=lambda s: s.sequence_id or 0)
    unlinked = [s for s in rewards if sc.REWARD_RESPONSE_ID not in s.attributes] or rewards
    return float(unlinked[-1].attributes[sc.REWARD_VALUE]) if unlinked else None


def call_rewards(spans: Iterable[Span]) -> dict[str, float]:
    """Response id -> reward, for rewards emitted with ``response_id`` (the last one per response wins)."""
    out: dict[str, float] = {}
    for span in sorted(spans, key=lambda s: s.sequence_id or 0):
        if span.name == sc.SPAN_REWARD and sc.REWARD_RESPONSE_ID in span.attributes:
            out[str(span.attributes[sc.REWARD_RESPONSE_ID])] = float(span.attributes[sc.REWARD_VALUE])
    return out
