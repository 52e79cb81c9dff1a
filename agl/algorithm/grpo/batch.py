"""A GRPO step's batch: rollouts and their spans to samples with group-relative advantages.

Groups are (task group, agent): with several agents in one rollout, each agent's calls are compared
with the same agent's calls in the other rollouts of the task (``GRPOConfig.agents`` keeps only the named
agents' calls; with several, each sample carries its agent, whose LoRA adapter alone it trains). Credit is either the rollout's final
reward (every token of a rollout's agent shares one advantage) or per call: each call's return is
the final reward plus ``call_reward_weight`` times the reward emitted for that call, normalised over
the calls of its group, and the tokens of each call's completion carry that call's advantage.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agl.adapter import MergeReport, Sample, call_rewards, final_reward, llm_calls, to_samples
from agl.adapter.calls import call_agents, calls_by_agent
from agl.adapter.thinking import mask_thinking
from agl.algorithm.grpo.advantages import group_advantages
from agl.errors import ConfigError
from agl.schemas import LLMCall, Rollout, RolloutStatus, Span

if TYPE_CHECKING:
    from agl.algorithm.grpo.config import GRPOConfig


@dataclass
class StepBatch:
    samples: list[Sample]
    advantages: list[float]
    rollout_index: list[int]
    metrics: dict[str, float]
    #: why a rollout trained nothing (rollout id -> reason), for the training record
    reasons: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the advantage of a rollout that trained nothing but had one (an overlong sample's), by rollout id
    would: dict[str, float] = dataclasses.field(default_factory=dict)
    #: each sample's agent (None: unnamed), aligned with ``samples``; with several ``GRPOConfig.agents``
    #: a sample trains that agent's adapter only
    agents: list[str | None] = dataclasses.field(default_factory=list)
    #: of ``GRPOConfig.agents``, those that made no call in the batch's succeeded rollouts, and then the
    #: agents those rollouts' calls came from ("" for calls no agent name reaches)
    unseen_agents: tuple[str, ...] = ()
    called_agents: tuple[str, ...] = ()


@dataclass
class _Unit:
    """One agent's samples in one rollout; advantages are computed among units of one key: (task group,
    agent), or ("", agent) under a batch baseline, where an agent's units in the whole batch compare."""

    rollout: int
    key: tuple[str, str | None]
    samples: list[Sample]
    reward: float


def _agent_units(
    rid: str, n: int, group: str, reward: float, spans: list[Span], config: GRPOConfig, report: MergeReport
) -> tuple[list[_Unit], dict[str | None, list[LLMCall]], int]:
    """The rollout's units, every named agent's calls, and how many of those no adapter of theirs answered
    (with several agents only a call its agent's adapter answered trains: see ``calls_by_agent``)."""
    calls = llm_calls(spans)
    called = calls_by_agent(calls, spans, config.agents)
    by_agent = dict(called)
    if len(config.agents) > 1:
        by_agent = calls_by_agent(calls, spans, config.agents, own_model=True)
    off = sum(map(len, called.values())) - sum(map(len, by_agent.values()))
    if not by_agent and not config.agents:
        by_agent[None] = []  # a rollout without calls still counts in its group's statistics
    units = []
    per_call = call_rewards(spans)
    scope = group if config.baseline == "group" else ""
    for agent, own in by_agent.items():
        made, rep = to_samples(own, reward, level=config.level, call_rewards=per_call, group_id=group)
        report.add(rep)
        units.append(_Unit(n, (scope, agent), made, reward))
    return units, called, off


def _mask_thinking(units: list[_Unit], config: GRPOConfig) -> int:
    """With ``train_thinking=False``, every sample's thinking out of its loss mask; the tokens masked."""
    if config.train_thinking:
        return 0
    if config.think_token_ids is None:
        raise ConfigError(
            "GRPOConfig(train_thinking=False) needs the ids of <think> and </think>: GRPO reads them from the "
            "policy's tokenizer when it loads; when building batches yourself set GRPOConfig.think_token_ids"
        )
    open_id, close_id = config.think_token_ids
    total = 0
    for unit in units:
        for i, sample in enumerate(unit.samples):
            unit.samples[i], masked = mask_thinking(sample, open_id, close_id)
            total += masked
    return total


def _advantages(values: list[float], keys: list[str], config: GRPOConfig) -> list[float]:
    """Group-relative, or leave-one-out over the batch (the keys then span it) under a batch baseline."""
    loo = config.baseline == "batch"
    return group_advantages(values, keys, scale_by_std=config.scale_by_std, leave_one_out=loo)


def _final_credit(units: list[_Unit], config: GRPOConfig) -> tuple[list[float], set[tuple[str, str | None]]]:
    """One advantage per unit from the final rewards; the (group, agent) keys without signal."""
    keys = [repr(u.key) for u in units]
    advs = _advantages([u.reward for u in units], keys, config)
    seen: dict[tuple[str, str | None], set[float]] = defaultdict(set)
    for u in units:
        seen[u.key].add(round(u.reward, 9))
    return advs, {k for k, v in seen.items() if len(v) == 1}


def _per_call_credit(
    units: list[_Unit], rewards_by_rollout: dict[int, dict[str, float]], config: GRPOConfig
) -> set[tuple[str, str | None]]:
    """Per-token advantages on each sample (each call's completion span gets its call's advantage),
    normalised over all calls of the same (group, agent); returns the keys without signal."""
    returns: list[float] = []
    keys: list[str] = []
    where: list[tuple[int, int, int]] = []  # (unit, sample, call) of each return
    seen: dict[tuple[str, str | None], set[float]] = defaultdict(set)
    for u_i, u in enumerate(units):
        own = rewards_by_rollout[u.rollout]
        for s_i, sample in enumerate(u.samples):
            for c_i, rid in enumerate(sample.call_response_ids):
                value = u.reward + config.call_reward_weight * own.get(rid or "", 0.0)
                returns.append(value)
                keys.append(repr(u.key))
                where.append((u_i, s_i, c_i))
                seen[u.key].add(round(value, 9))
    advs = _advantages(returns, keys, config)
    per_sample: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for (u_i, s_i, c_i), adv in zip(where, advs, strict=True):
        per_sample[(u_i, s_i)][c_i] = adv
    for (u_i, s_i), by_call in per_sample.items():
        sample = units[u_i].samples[s_i]
        token_adv = [0.0] * len(sample.input_ids)
        for c_i, (start, end) in enumerate(sample.call_spans):
            token_adv[start:end] = [by_call[c_i]] * (end - start)
        units[u_i].samples[s_i] = dataclasses.replace(sample, token_advantages=tuple(token_adv))
    return {k for k, v in seen.items() if len(v) == 1}


def _sample_advantage(sample: Sample) -> float:
    """A merged sample's advantage as one number: the mean over its model tokens (for metrics)."""
    if sample.token_advantages is None:
        return 0.0
    picked = [a for a, m in zip(sample.token_advantages, sample.loss_mask, strict=True) if m]
    return sum(picked) / len(picked) if picked else 0.0


def build_batch(
    rollouts: Sequence[Rollout],
    spans: dict[str, list[Span]],
    config: GRPOConfig,
    zeroed: Collection[str] = (),
) -> StepBatch:
    """Pure: rollouts and their spans to samples with advantages, and the filter counts.

    Failed rollouts are left out, except those in ``zeroed`` (``on_failure="zero"``): their model
    calls train with reward 0. Groups whose rewards tie are left out too, unless a teacher distills
    (``GRPOConfig.teacher``): their samples then train with the teacher's per-token advantage alone.
    """
    ok = [r for r in rollouts if r.status == RolloutStatus.SUCCEEDED or r.rollout_id in zeroed]
    rewards = {
        r.rollout_id: 0.0 if r.rollout_id in zeroed else final_reward(spans[r.rollout_id]) or 0.0 for r in ok
    }
    report = MergeReport()
    units: list[_Unit] = []
    per_call: dict[int, dict[str, float]] = {}
    seen: set[str | None] = set()
    off_adapter = 0
    for n, r in enumerate(ok):
        rid = r.rollout_id
        per_call[n] = call_rewards(spans[rid])
        made, called, off = _agent_units(rid, n, r.group_id or rid, rewards[rid], spans[rid], config, report)
        units += made
        seen.update(called)
        off_adapter += off
    thinking_masked = _mask_thinking(units, config)
    if config.credit == "per_call":
        flat = _per_call_credit(units, per_call, config)
        unit_adv = [0.0] * len(units)
    else:
        unit_adv, flat = _final_credit(units, config)
    samples: list[Sample] = []
    advs: list[float] = []
    index: list[int] = []
    agents: list[str | None] = []
    too_long = 0
    kept = {r.rollout_id for r in ok}
    reasons: dict[str, str] = {
        r.rollout_id: f"rollout {r.status.value}: only succeeded rollouts train"
        for r in rollouts
        if r.rollout_id not in kept
    }
    with_units = {u.rollout for u in units}
    for n, r in enumerate(ok):
        if n not in with_units:  # an agent filter found none of its calls here
            served = " that its adapter answered" if len(config.agents) > 1 else ""
            reasons[r.rollout_id] = f"no call of agent {' or '.join(map(repr, config.agents))}{served}"
    would: dict[str, float] = {}
    for u, adv in zip(units, unit_adv, strict=True):
        rid = ok[u.rollout].rollout_id
        if u.key in flat and config.teacher is None:  # distilling, the teacher's advantage still trains it
            reasons.setdefault(rid, "zero-variance group: every rollout got the same reward")
            continue
        if not u.samples:
            reasons.setdefault(rid, _no_sample_reason(spans[rid]))
        for s in u.samples:
            if len(s.input_ids) > config.max_sample_tokens:
                too_long += 1
                reasons.setdefault(
                    rid, f"overlong: {len(s.input_ids)} tokens > max_sample_tokens {config.max_sample_tokens}"
                )
                would.setdefault(rid, adv if s.token_advantages is None else _sample_advantage(s))
                continue
            samples.append(s)
            advs.append(adv if s.token_advantages is None else _sample_advantage(s))
            index.append(u.rollout)
            agents.append(u.key[1])
    reward_values = list(rewards.values())
    mean = sum(reward_values) / len(reward_values) if reward_values else 0.0
    std = (sum((r - mean) ** 2 for r in reward_values) / len(reward_values)) ** 0.5 if reward_values else 0.0
    metrics = {
        "reward_mean": mean,
        "reward_std": std,
        "reward_min": min(reward_values, default=0.0),
        "reward_max": max(reward_values, default=0.0),
        "rollouts": float(len(rollouts)),
        "failed_rollouts": float(len(rollouts) - len(ok)),
        "groups": float(
            len({u.key for u in units})
        ),  # (task group, agent) pairs, or agents over a batch baseline
        "zero_variance_groups": float(len(flat)),
        "overlong_samples": float(too_long),
        "samples": float(len(samples)),
        "samples_per_rollout": report.samples / len(ok) if ok else 0.0,
        "merged_fraction": report.merged_fraction,
        # model calls left out, each counted once (a gateway record and a tracer record of one call are
        # one call), by why: failed, not_through_gateway, no_token_ids, logprobs_mismatch
        "untrainable_calls": float(report.skipped_no_token_ids),
        **{f"untrainable_{k}": float(v) for k, v in report.untrainable.items()},
        **{f"mismatch_{k}": float(v) for k, v in report.mismatches.items()},
        # merged after all: the prompt re-rendered the previous reply (a parsed tool call templated anew)
        "mismatch_reconciled": float(report.reconciled_calls),
    }
    if not config.train_thinking:
        metrics["thinking_tokens_masked"] = float(thinking_masked)
    for agent in config.agents if len(config.agents) > 1 else ():
        metrics[f"samples_{agent}"] = float(sum(a == agent for a in agents))
    if len(config.agents) > 1:  # calls the base model answered: tagged after they ran (agl.agent_scope)
        metrics["calls_off_adapter"] = float(off_adapter)
    trained = {s.rollout_id for s in samples}
    reasons = {rid: why for rid, why in reasons.items() if rid not in trained}
    unseen = tuple(a for a in config.agents if a not in seen)
    names: set[str] = set()
    for r in ok if unseen else ():
        calls = llm_calls(spans[r.rollout_id])
        names.update(name or "" for name in call_agents(calls, spans[r.rollout_id]))
    return StepBatch(samples, advs, index, metrics, reasons, would, agents, unseen, tuple(sorted(names)))


def _no_sample_reason(spans: list[Span]) -> str:
    calls = llm_calls(spans)
    if not calls:
        return "no model calls"
    if not any(c.has_token_ids for c in calls):
        return "no token ids: the backend returned none"
    return "logprobs do not match the completion tokens"


__all__ = ["StepBatch", "build_batch"]
