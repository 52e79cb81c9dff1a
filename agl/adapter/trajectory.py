"""Model calls to token-level training samples, merged per rollout when the tokens allow it.

Trajectory level (the default): a call whose prompt ids begin exactly with the previous call's prompt
plus response ids extends that sample; the inserted tokens (tool results, user turns, template
tokens) get loss mask 0, the model's own tokens mask 1. Anything else starts a new sample, and the
report says why. Transition level: one sample per call. Token ids are only ever the engine's.
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
    skipped_no_token_ids: int = 0
    mismatches: Counter[str] = field(default_factory=Counter)

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
        self.skipped_no_token_ids += other.skipped_no_token_ids
        self.mismatches.update(other.mismatches)


def _prompt(call: LLMCall) -> list[int]:
    return list(call.prompt_token_ids or [])


def _response(call: LLMCall) -> list[int]:
    return list(call.completion_token_ids or [])


def classify_mismatch(previous: LLMCall, prompt_ids: Sequence[int]) -> str:
    """Why a call does not extend the previous one: the earlier prompt changed, or only its reply did."""
    old_prompt = _prompt(previous)
    if list(prompt_ids[: len(old_prompt)]) != old_prompt:
        return "template_change"
    if previous.reasoning or "</think>" in str((previous.response_message or {}).get("content") or ""):
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


def _start(call: LLMCall) -> _Building:
    prompt, response = _prompt(call), _response(call)
    logprobs = None if call.logprobs is None else [0.0] * len(prompt) + list(call.logprobs)
    ids = list(prompt) + list(response)
    return _Building(
        ids, [0] * len(prompt) + [1] * len(response), logprobs, [call], [(len(prompt), len(ids))]
    )


def _extend(building: _Building, call: LLMCall) -> None:
    inserted = _prompt(call)[len(building.ids) :]
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
        if call.has_token_ids and (call.logprobs is None or len(call.logprobs) == len(_response(call))):
            usable.append(call)
        else:
            report.skipped_no_token_ids += 1
    built: list[_Building] = []
    for call in usable:
        current = built[-1] if built else None
        prompt = _prompt(call)
        if level == "trajectory" and current is not None and prompt[: len(current.ids)] == current.ids:
            _extend(current, call)
            report.merged_calls += 1
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
            )
        )
    report.samples = len(samples)
    return samples, report
