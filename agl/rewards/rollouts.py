"""Judge rewards for stored rollouts: each rollout's trajectory read from its spans, one judge call per
group, and the verdict written back to the store as spans.

Each judged rollout gets an ``agl.judge`` span (the judge's model, the group shown, every raw reply, its
score and reason; the prompt on the first rollout's span) and, under it, an ordinary ``agl.reward`` span
tagged ``judge`` with the reason: the dashboard, metrics and adapters read it like any reward. The
``agl.judge`` span is never a model call of the agent's (:meth:`agl.schemas.LLMCall.from_span`), so
it is never trained on. A group the judge fails on gets its ``agl.judge`` span with the error, no reward.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agl import semconv as sc
from agl.adapter import final_reward, llm_calls, to_messages
from agl.adapter.calls import call_agents
from agl.errors import JudgeError
from agl.rewards.judge import Judge, Verdict
from agl.schemas import LLMCall, Rollout, RolloutStatus, Span, SpanStatus, StatusCode

if TYPE_CHECKING:
    from agl.store import LightningStore

log = logging.getLogger(__name__)


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def render_messages(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line (or paragraph) per message: ``role: text``, tool calls as ``name(arguments)``."""
    lines = []
    for m in messages:
        role = str(m.get("role", "?"))
        text = _text(m.get("content"))
        if role == "tool":
            role = f"tool {m.get('name') or m.get('tool_call_id') or ''}".strip()
        if text:
            lines.append(f"{role}: {text}")
        for call in m.get("tool_calls") or []:
            fn = (call.get("function") or {}) if isinstance(call, Mapping) else {}
            lines.append(f"{role} calls {fn.get('name', '?')}({fn.get('arguments', '')})")
    return lines


def trajectory_text(spans: Sequence[Span]) -> str:
    """What a rollout did, for the judge: each agent's conversation (messages and tool calls, as
    :func:`agl.adapter.to_messages` reads them) and the final answer, its last assistant text."""
    calls = llm_calls(spans)
    if not calls:
        return "(no model calls recorded)\nFinal answer: (none)"
    agents = call_agents(calls, spans)
    by_agent: dict[str | None, list[LLMCall]] = {}
    for call, agent in zip(calls, agents, strict=True):
        by_agent.setdefault(agent, []).append(call)
    lines: list[str] = []
    finals: dict[str | None, str] = {}
    for agent, own in by_agent.items():
        messages = to_messages(own)
        if len(by_agent) > 1:
            lines.append(f"[agent {agent or 'unnamed'}]")
        lines += render_messages(messages)
        said = [_text(m.get("content")) for m in messages if m.get("role") == "assistant"]
        finals[agent] = next((t for t in reversed(said) if t), "")
    final = finals[agents[-1]]  # the last assistant text of the agent that made the last call
    return "\n".join([*lines, f"Final answer: {final or '(none)'}"])


@dataclass
class Judged:
    """What judging a step's rollouts did: the spans with the judge's added, and the groups it failed on."""

    spans: dict[str, list[Span]]
    groups: int = 0
    failures: int = 0
    dropped: set[str] = field(default_factory=set)  # rollout ids of the groups the judge failed on
    errors: dict[str, str] = field(default_factory=dict)  # each dropped rollout's judge error


def unrewarded(rollouts: Sequence[Rollout], spans: Mapping[str, Sequence[Span]]) -> list[Rollout]:
    """The succeeded rollouts without a reward: the ones a judge scores."""
    return [
        r
        for r in rollouts
        if r.status == RolloutStatus.SUCCEEDED and final_reward(spans.get(r.rollout_id, ())) is None
    ]


async def judge_rollouts(
    store: LightningStore,
    judge: Judge,
    rollouts: Sequence[Rollout],
    spans: Mapping[str, Sequence[Span]],
    *,
    alone: bool = False,
) -> Judged:
    """Score the succeeded rollouts without a reward, one judge call per group (``alone``: per rollout),
    and store the verdicts. Rollouts that have a reward keep it; failed rollouts are not shown."""
    groups: dict[str, list[Rollout]] = {}
    for r in unrewarded(rollouts, spans):
        groups.setdefault(r.rollout_id if alone else (r.group_id or r.rollout_id), []).append(r)
    out = Judged({rid: list(s) for rid, s in spans.items()}, groups=len(groups))
    if not groups:
        return out
    gate = asyncio.Semaphore(judge.concurrency)
    client = judge.client()

    async def one(key: str, members: list[Rollout]) -> tuple[list[Span], JudgeError | None]:
        texts = [trajectory_text(out.spans.get(r.rollout_id, [])) for r in members]
        async with gate:
            started = time.time_ns()
            try:
                verdict: Verdict | JudgeError = await judge.score(
                    members[0].input, texts, client=client, group_id=key
                )
            except JudgeError as exc:
                verdict = exc
        made = await _verdict_spans(store, judge, key, members, out.spans, verdict, started)
        return made, verdict if isinstance(verdict, JudgeError) else None

    try:
        made = await asyncio.gather(*(one(k, m) for k, m in groups.items()))
    finally:
        await client.close()
    for members, (group, error) in zip(groups.values(), made, strict=True):
        if not any(s.name == sc.SPAN_REWARD for s in group):
            out.failures += 1
            out.dropped.update(r.rollout_id for r in members)
            out.errors.update((r.rollout_id, f"JudgeError: {error or 'no score'}") for r in members)
    for stored in await store.add_spans([s for group, _ in made for s in group]):
        out.spans.setdefault(stored.rollout_id, []).append(stored)
    return out


async def _attempt_of(store: LightningStore, rollout: Rollout, spans: Sequence[Span]) -> tuple[str, str]:
    """(attempt id, trace id) to record under: the latest attempt's, as its spans or the store say."""
    if spans:
        return spans[-1].attempt_id, spans[-1].trace_id
    attempts = (await store.query_attempts(rollout_id=rollout.rollout_id)).items
    latest = max(attempts, key=lambda a: a.attempt_number)
    return latest.attempt_id, secrets.token_hex(16)


async def _verdict_spans(
    store: LightningStore,
    judge: Judge,
    key: str,
    members: list[Rollout],
    spans: Mapping[str, Sequence[Span]],
    verdict: Verdict | JudgeError,
    started_ns: int,
) -> list[Span]:
    """Each member's ``agl.judge`` span, and its reward span under it when the judge gave scores."""
    ended = time.time_ns()
    if isinstance(verdict, JudgeError):
        log.warning("the judge gave no rewards for group %s (%d rollouts): %s", key, len(members), verdict)
    made: list[Span] = []
    for i, r in enumerate(members):
        attempt_id, trace_id = await _attempt_of(store, r, spans.get(r.rollout_id, []))
        attrs: dict[str, Any] = {
            sc.JUDGE_MODEL: judge.model,
            sc.JUDGE_GROUP_ID: key,
            sc.JUDGE_ROLLOUT_IDS: [m.rollout_id for m in members],
            sc.JUDGE_INDEX: i + 1,
            sc.JUDGE_REPLIES: verdict.replies,
            sc.TAGS: [sc.JUDGE_TAG],
        }
        if i == 0 and isinstance(verdict, Verdict):
            attrs[sc.JUDGE_REQUEST_MESSAGES] = verdict.messages
        if isinstance(verdict, Verdict):
            attrs.update(
                {sc.JUDGE_SCORE: verdict.scores[i].score, sc.REWARD_REASON: verdict.scores[i].reason}
            )
        else:
            attrs[sc.JUDGE_ERROR] = verdict.message
        judge_span = Span(
            rollout_id=r.rollout_id,
            attempt_id=attempt_id,
            trace_id=trace_id,
            span_id=secrets.token_hex(8),
            name=sc.SPAN_JUDGE,
            start_time_ns=started_ns,
            end_time_ns=ended,
            attributes=attrs,
            status=SpanStatus(code=StatusCode.OK)
            if isinstance(verdict, Verdict)
            else SpanStatus(code=StatusCode.ERROR, description=verdict.message),
        )
        made.append(judge_span)
        if isinstance(verdict, Verdict):
            score = verdict.scores[i]
            made.append(
                Span(
                    rollout_id=r.rollout_id,
                    attempt_id=attempt_id,
                    trace_id=trace_id,
                    span_id=secrets.token_hex(8),
                    parent_id=judge_span.span_id,
                    name=sc.SPAN_REWARD,
                    start_time_ns=ended,
                    end_time_ns=ended,
                    attributes={
                        sc.REWARD_VALUE: score.score,
                        sc.REWARD_VALUES: {"judge": score.score},
                        sc.REWARD_PRIMARY_KEY: "judge",
                        sc.REWARD_REASON: score.reason,
                        sc.TAGS: [sc.JUDGE_TAG],
                    },
                    status=SpanStatus(code=StatusCode.OK),
                )
            )
    return made


__all__ = ["Judged", "judge_rollouts", "render_messages", "trajectory_text", "unrewarded"]
