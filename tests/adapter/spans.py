"""Hand-built spans for adapter and GRPO tests: model calls with token ids, and rewards."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agl import semconv as sc
from agl.schemas import Span


class SpanMaker:
    """Spans of one rollout with increasing sequence ids, as the store would assign them."""

    def __init__(self, rollout_id: str = "ro-1", attempt_id: str = "at-1") -> None:
        self.rollout_id, self.attempt_id, self.seq = rollout_id, attempt_id, 0

    def span(self, name: str, attributes: dict[str, Any], parent: Span | None = None) -> Span:
        self.seq += 1
        return Span.new(
            self.rollout_id,
            self.attempt_id,
            name,
            attributes,
            parent_id=None if parent is None else parent.span_id,
            sequence_id=self.seq,
        )

    def call(
        self,
        prompt: list[int],
        response: list[int],
        logprobs: list[float] | None = None,
        *,
        response_id: str | None = None,
        source: str = "gateway",
        parent: Span | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> Span:
        """A model call span; ``attrs`` adds or overrides attributes (semconv keys are dotted, so not keywords)."""
        attributes: dict[str, Any] = {
            sc.LLM_API: "chat.completions",
            sc.LLM_PROMPT_TOKEN_IDS: prompt,
            sc.LLM_COMPLETION_TOKEN_IDS: response,
            sc.LLM_LOGPROBS: logprobs if logprobs is not None else [-0.5] * len(response),
            sc.LLM_RESPONSE_ID: response_id or f"resp-{self.seq + 1}",
            sc.LLM_SOURCE: source,
            **(attrs or {}),
        }
        return self.span(sc.SPAN_LLM_CALL, attributes, parent)

    def reward(self, value: float, response_id: str | None = None) -> Span:
        attrs: dict[str, Any] = {sc.REWARD_VALUE: value}
        if response_id is not None:
            attrs[sc.REWARD_RESPONSE_ID] = response_id
        return self.span(sc.SPAN_REWARD, attrs)
