"""Model calls to token-level training samples, merged per rollout when the tokens allow it.

Trajectory level (the default): a call whose prompt ids begin exactly with the previous call's prompt
plus response ids extends that sample; the inserted tokens (tool results, user turns, template
tokens) get loss mask 0, the model's own tokens mask 1. A call whose prompt begins with the previous
prompt but re-renders the previous reply (a tool call parsed and templated again) extends it too, with
the model's own reply kept in place of the re-rendering (see :func:`reply_end`). Anything else starts a
new sample, and the report says why. Transition level: one sample per call. Token ids are only ever
the engine's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from agl.schemas import LLMCall

Level = Literal["trajectory", "transition"]


@dataclass(frozen=True, slots=True)
class Sample:
    """One token sequence to train on; ``old_logprobs`` align with ``input_ids`` (0 where masked)."""

    rollout_id: str
    group_id: str | None
    input_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    old_logprobs: tuple[float, ...] | None
    reward: float
    num_calls: int = 1
    model_version: str | None = None
    #: ``[start, end)`` of each call's completion tokens in ``input_ids``, and each call's response id
    call_spans: tuple[tuple[int, int], ...] = ()
    call_response_ids: tuple[str | None, ...] = ()
    #: per-token advantages aligned with ``input_ids`` (per-call credit); None: one advantage per sample
    token_advantages: tuple[float, ...] | None = None
    #: calls merged in after their prompt re-rendered the previous reply (see :func:`reply_end`)
    reconciled_calls: int = 0
    #: a distillation teacher's log-probs of ``input_ids`` (0 where masked), scored by an endpoint teacher
    teacher_logprobs: tuple[float, ...] | None = None

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)


@dataclass
class MergeReport:
    """What the adapter did with a batch of rollouts, for the step's metrics."""

    rollouts: int = 0
    calls: int = 0
    samples: int = 0
    merged_calls: int = 0
    #: of ``merged_calls``, those whose prompt re-rendered the previous reply (see :func:`reply_end`)
    reconciled_calls: int = 0
    #: calls left out, by the reason :func:`untrainable_reason` gives
    untrainable: Counter[str] = field(default_factory=Counter)
    mismatches: Counter[str] = field(default_factory=Counter)

    @property
    def skipped_no_token_ids(self) -> int:
        """Calls left out for any reason: without the engine's token ids (or with unusable ones)."""
        return sum(self.untrainable.values())

    @property
    def merged_fraction(self) -> float:
        """Share of follow-up calls (all but each rollout's first) merged into the previous sample."""
        follow_ups = self.calls - self.skipped_no_token_ids - self.rollouts
        return self.merged_calls / follow_ups if follow_ups > 0 else 1.0

    @property
    def samples_per_rollout(self) -> float:
        return self.samples / self.rollouts if self.rollouts else 0.0

    def add(self, other: MergeReport) -> None:
        self.rollouts += other.rollouts
        self.calls += other.calls
        self.samples += other.samples
        self.merged_calls += other.merged_calls
        self.reconciled_calls += other.reconciled_calls
        self.untrainable.update(other.untrainable)
        self.mismatches.update(other.mismatches)


#: why a model call cannot be trained, by the key :func:`untrainable_reason` returns
UNTRAINABLE = {
    "failed": "the call failed: no reply to train on",
    "not_through_gateway": "recorded only client-side: the call did not go through the gateway (an "
    "external endpoint, or a client not pointed at it), so there are no engine token ids",
    "no_token_ids": "no token ids: the backend returned none (an external API, or one not asked for them)",
    "logprobs_mismatch": "logprobs do not match the completion tokens",
}


def untrainable_reason(call: LLMCall) -> str | None:
    """Why ``call`` cannot be trained (a key of :data:`UNTRAINABLE`), or None if it can."""
    if call.has_token_ids:
        if call.logprobs is not None and len(call.logprobs) != len(call.completion_token_ids or []):
            return "logprobs_mismatch"
        return None
    if call.error is not None:
        return "failed"
    return "no_token_ids" if call.source == "gateway" else "not_through_gateway"


def _prompt(call: LLMCall) -> list[int]:
    return list(call.prompt_token_ids or [])


def _response(call: LLMCall) -> list[int]:
    return list(call.completion_token_ids or [])


#: the most tokens a chat template's generation prompt (``<|im_start|>assistant\n`` and the like) may take
MAX_GENERATION_PROMPT = 16


def _thought(call: LLMCall) -> bool:
    """Whether the reply held a thinking block (recorded apart, or left in the content)."""
    return bool(call.reasoning) or "</think>" in str((call.response_message or {}).get("content") or "")


def reply_end(previous: LLMCall, prompt_ids: Sequence[int]) -> int | None:
    """Where the re-rendering of ``previous``'s reply ends in ``prompt_ids``, or None if not found reliably.

    Applies when ``prompt_ids`` begin with the previous prompt P but not with P plus the reply R (the
    client sent the parsed tool calls back and the template rendered them anew). Without a tokenizer:
    R must end with the token that closes the turns of P (it occurs in P, followed only by a generation
    prompt of at most MAX_GENERATION_PROMPT tokens), and not by length; the re-rendered turn ends at the
    first such token after P, and the token after it must be the one that follows it in P. A reply that
    held a thinking block is never reconciled: a template that drops it (Qwen3's) gave the next call a
    context shorter by the whole block, so each call trains alone (``thinking_stripped``).
    """
    prompt, reply = _prompt(previous), _response(previous)
    n = len(prompt)
    if not reply or previous.finish_reason == "length" or list(prompt_ids[:n]) != prompt:
        return None
    if _thought(previous):  # the template dropped its <think> block: the next call saw a shorter context
        return None
    closer = reply[-1]
    last = next((i for i in range(n - 1, -1, -1) if prompt[i] == closer), None)
    if last is None or last == n - 1 or n - 1 - last > MAX_GENERATION_PROMPT:
        return None
    end = next((i + 1 for i in range(n, len(prompt_ids)) if prompt_ids[i] == closer), None)
    if end is None or end >= len(prompt_ids) or prompt_ids[end] != prompt[last + 1]:
        return None
    return end


def classify_mismatch(previous: LLMCall, prompt_ids: Sequence[int]) -> str:
    """Why a call does not extend the previous one: the earlier prompt changed, or only its reply did
    (and :func:`reply_end` could not find where the re-rendered reply ends)."""
    old_prompt = _prompt(previous)
    if list(prompt_ids[: len(old_prompt)]) != old_prompt:
        return "template_change"
    if _thought(previous):
        return "thinking_stripped"  # the template re-rendered that reply without its <think> block (Qwen3)
    if len(prompt_ids) >= len(old_prompt) + len(_response(previous)):
        return "retokenization"
    return "other"


@dataclass
class _Building:
    ids: list[int]
    mask: list[int]
    logprobs: list[float] | None
    calls: list[LLMCall]
    spans: list[tuple[int, int]]
    reconciled: int = 0


def _start(call: LLMCall) -> _Building:
    prompt, response = _prompt(call), _response(call)
    logprobs = None if call.logprobs is None else [0.0] * len(prompt) + list(call.logprobs)
    ids = list(prompt) + list(response)
    return _Building(
        ids, [0] * len(prompt) + [1] * len(response), logprobs, [call], [(len(prompt), len(ids))]
    )


def _follows(building: _Building, call: LLMCall) -> tuple[int, bool] | None:
    """Where ``call``'s new prompt tokens start if it continues ``building``, and whether it re-rendered
    the previous reply; None if it does not continue it.

    The engine's previous prompt P and reply R are compared, not the sample built so far, which holds
    R where the engine's later prompts hold its re-rendering."""
    previous = building.calls[-1]
    prompt, seen = _prompt(call), _prompt(previous) + _response(previous)
    if prompt[: len(seen)] == seen:
        return len(seen), False
    end = reply_end(previous, prompt)
    return None if end is None else (end, True)


def _extend(building: _Building, call: LLMCall, start: int) -> None:
    # After a re-rendered reply, this call's engine logprobs were computed with the re-rendering (R')
    # in context while the sample holds the model's own reply R there; the loss treats that as one more
    # engine/trainer gap, which its ratio clip and truncated-IS cap (LossConfig.tis_cap) already bound.
    inserted = _prompt(call)[start:]
    response = _response(call)
    building.ids += inserted
    building.spans.append((len(building.ids), len(building.ids) + len(response)))
    building.ids += response
    building.mask += [0] * len(inserted) + [1] * len(response)
    if building.logprobs is not None and call.logprobs is not None:
        building.logprobs += [0.0] * len(inserted) + list(call.logprobs)
    else:
        building.logprobs = None
    building.calls.append(call)


def to_samples(
    calls: Sequence[LLMCall],
    reward: float,
    *,
    level: Level = "trajectory",
    call_rewards: Mapping[str, float] | None = None,
    group_id: str | None = None,
) -> tuple[list[Sample], MergeReport]:
    """The samples of one rollout's calls (in order); ``reward`` goes to every sample unless a
    per-call reward (``call_rewards``, by response id) covers the sample's last call."""
    report = MergeReport(rollouts=1, calls=len(calls))
    usable = []
    for call in calls:
        reason = untrainable_reason(call)
        if reason is None:
            usable.append(call)
        else:
            report.untrainable[reason] += 1
    built: list[_Building] = []
    for call in usable:
        current = built[-1] if built else None
        prompt = _prompt(call)
        follows = _follows(current, call) if level == "trajectory" and current is not None else None
        if current is not None and follows is not None:
            start, reconciled = follows
            _extend(current, call, start)
            current.reconciled += reconciled
            report.merged_calls += 1
            report.reconciled_calls += reconciled
            continue
        if current is not None and level == "trajectory":
            report.mismatches[classify_mismatch(current.calls[-1], prompt)] += 1
        built.append(_start(call))
    samples = []
    for b in built:
        last = b.calls[-1]
        own = (call_rewards or {}).get(last.response_id or "")
        samples.append(
            Sample(
                rollout_id=last.rollout_id,
                group_id=group_id,
                input_ids=tuple(b.ids),
                loss_mask=tuple(b.mask),
                old_logprobs=None if b.logprobs is None else tuple(b.logprobs),
                reward=reward if own is None else own,
                num_calls=len(b.calls),
                model_version=last.model_version,
                call_spans=tuple(b.spans),
                call_response_ids=tuple(c.response_id for c in b.calls),
                reconciled_calls=b.reconciled,
            )
        )
    report.samples = len(samples)
    return samples, report
