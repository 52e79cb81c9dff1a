"""Full trajectories out of the store, as a critic reads them: messages, tool calls, rewards, feedback, errors."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agl import semconv as sc
from agl.algorithm.base import rollout_spans
from agl.schemas import LLMCall, RolloutStatus, Span
from agl.store.base import LightningStore


@dataclass(frozen=True, slots=True)
class Trajectory:
    rollout_id: str
    task: Any
    status: str
    reward: float
    messages: list[dict[str, Any]] = field(default_factory=list)
    feedback: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def trajectory_from_spans(rollout_id: str, task: Any, status: str, spans: Sequence[Span]) -> Trajectory:
    """Pure: the last model call's conversation, the final reward, feedback messages and errors."""
    ordered = sorted(spans, key=lambda s: s.sequence_id or 0)
    calls = [c for c in (LLMCall.from_span(s) for s in ordered) if c is not None]
    messages: list[dict[str, Any]] = []
    if calls:
        last = calls[-1]
        messages = list(last.request_messages or [])
        if last.response_message:
            messages.append(last.response_message)
    rewards = [float(s.attributes[sc.REWARD_VALUE]) for s in ordered if s.name == sc.SPAN_REWARD]
    feedback = [str(s.attributes.get(sc.MESSAGE_TEXT, "")) for s in ordered if s.name == sc.SPAN_MESSAGE]
    errors = [
        f"{s.attributes.get(sc.EXCEPTION_TYPE)}: {s.attributes.get(sc.EXCEPTION_MESSAGE)}"
        for s in ordered
        if s.name == sc.SPAN_EXCEPTION
    ]
    reward = rewards[-1] if rewards and status == RolloutStatus.SUCCEEDED.value else 0.0
    return Trajectory(rollout_id, task, status, reward, messages, feedback, errors)


async def load_trajectories(store: LightningStore, rollout_ids: Sequence[str]) -> list[Trajectory]:
    out = []
    for rollout_id in rollout_ids:
        rollout = await store.get_rollout(rollout_id)
        spans = await rollout_spans(store, rollout_id)
        out.append(trajectory_from_spans(rollout_id, rollout.input, rollout.status.value, spans))
    return out


def _content(message: dict[str, Any]) -> str:
    text = str(message.get("content") or "")
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        text += f" [tool call {fn.get('name')}({fn.get('arguments')})]"
    return text.strip()


def render_trajectories(trajectories: Sequence[Trajectory], max_chars: int = 1500) -> str:
    """Plain text a critic LLM can read; each trajectory cut to ``max_chars``."""
    if not trajectories:
        return "(none)"
    blocks = []
    for n, t in enumerate(trajectories, 1):
        lines = [f"--- trajectory {n}: reward {t.reward:.2f}, status {t.status}"]
        task = t.task.get("question", t.task) if isinstance(t.task, dict) else t.task
        lines.append(f"task: {json.dumps(task) if not isinstance(task, str) else task}")
        for m in t.messages:
            if m.get("role") != "system":
                lines.append(f"{m.get('role')}: {_content(m)}")
        lines += [f"feedback: {f}" for f in t.feedback]
        lines += [f"error: {e}" for e in t.errors]
        blocks.append("\n".join(lines)[:max_chars])
    return "\n".join(blocks)
