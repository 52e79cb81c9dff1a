"""The LLM call view: one model call, whoever recorded it, as adapters and dashboards read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agl import semconv as sc
from agl.schemas.span import Span


@dataclass(frozen=True, slots=True)
class LLMCall:
    """A model call read from a span's canonical ``agl.llm.*`` attributes.

    ``prompt_token_ids`` / ``completion_token_ids`` / ``logprobs`` are the engine's own values,
    or None when the backend returned none; nothing re-tokenizes to fill them in.
    """

    rollout_id: str
    attempt_id: str
    span_id: str
    sequence_id: int
    api: str
    model: str | None
    request_messages: list[dict[str, Any]] | None
    prompt: str | None
    response_message: dict[str, Any] | None
    tool_calls: list[dict[str, Any]]
    response_id: str | None
    finish_reason: str | None
    usage: dict[str, Any]
    prompt_token_ids: list[int] | None
    completion_token_ids: list[int] | None
    logprobs: list[float] | None
    model_version: str | None
    agent_name: str | None
    source: str
    error: str | None = None
    #: the thinking the engine split off the completion (``reasoning_content``); its tokens stay in
    #: ``completion_token_ids``
    reasoning: str | None = None
    attributes: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def has_token_ids(self) -> bool:
        return self.prompt_token_ids is not None and self.completion_token_ids is not None

    @classmethod
    def from_span(cls, span: Span) -> LLMCall | None:
        """The call a span records, or None if it is not an LLM call span."""
        a = span.attributes
        if sc.LLM_API not in a and span.name != sc.SPAN_LLM_CALL:
            return None
        if span.name in (sc.SPAN_EMBEDDINGS, sc.SPAN_JUDGE):  # no generation of the agent's: nothing to
            return (
                None  # train on or replay as a turn (a reward judge's call is the trainer's, not the agent's)
            )
        return cls(
            rollout_id=span.rollout_id,
            attempt_id=span.attempt_id,
            span_id=span.span_id,
            sequence_id=span.sequence_id or 0,
            api=str(a.get(sc.LLM_API, "chat.completions")),
            model=a.get(sc.LLM_MODEL),
            request_messages=a.get(sc.LLM_REQUEST_MESSAGES),
            prompt=a.get(sc.LLM_PROMPT),
            response_message=a.get(sc.LLM_RESPONSE_MESSAGE),
            tool_calls=list(a.get(sc.LLM_TOOL_CALLS) or []),
            response_id=a.get(sc.LLM_RESPONSE_ID),
            finish_reason=a.get(sc.LLM_FINISH_REASON),
            usage=dict(a.get(sc.LLM_USAGE) or {}),
            prompt_token_ids=a.get(sc.LLM_PROMPT_TOKEN_IDS),
            completion_token_ids=a.get(sc.LLM_COMPLETION_TOKEN_IDS),
            logprobs=a.get(sc.LLM_LOGPROBS),
            model_version=a.get(sc.LLM_MODEL_VERSION),
            agent_name=a.get(sc.AGENT_NAME),
            source=str(a.get(sc.LLM_SOURCE, "gateway")),
            error=a.get(sc.LLM_ERROR),
            reasoning=a.get(sc.LLM_REASONING),
            attributes=a,
        )
