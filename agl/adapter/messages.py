"""The messages adapter: a rollout's conversation in OpenAI chat format, for SFT and APO."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agl.schemas import LLMCall


def to_messages(calls: Sequence[LLMCall]) -> list[dict[str, Any]]:
    """The last call's request messages plus its reply: the whole conversation of a multi-turn agent.

    A reply with tool calls keeps them (``tool_calls``), so tool-use traces survive the round trip.
    """
    if not calls:
        return []
    last = calls[-1]
    messages = [dict(m) for m in (last.request_messages or [])]
    if last.response_message is not None:
        reply = {k: v for k, v in last.response_message.items() if v is not None}
        reply.setdefault("role", "assistant")
        messages.append(reply)
    return messages
