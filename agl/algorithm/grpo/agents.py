"""GRPO over ``GRPOConfig.agents``: a step per agent on its own LoRA adapter, and agents that never call.

With several agents the policy holds one LoRA adapter per agent on one base model; each agent's samples
step only its adapter (its own optimizer state), so an agent learns from its own calls alone. The step's
row merges the per-agent rows (tokens summed, loss-like values weighted by trained tokens, the gradient
norm over all adapters) and keeps each agent's loss and gradient norm.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

from agl.algorithm.grpo.batch import StepBatch
from agl.errors import ConfigError

log = logging.getLogger(__name__)

_SUMMED = ("trained_tokens", "processed_tokens", "computed_tokens", "update_time_s", "memory_backoffs")
_WEIGHTED = ("loss", "kl", "clip_fraction", "entropy", "ratio_mean", "distill_kl")


def step_agents(policy: Any, batch: StepBatch, agents: Sequence[str]) -> dict[str, float]:
    """Blocking: one optimizer step per agent that has samples in ``batch``, on that agent's adapter."""
    rows: dict[str, dict[str, float]] = {}
    for agent in agents:
        mine = [i for i, a in enumerate(batch.agents) if a == agent]
        if not mine:
            continue  # its adapter and optimizer state stay as they are
        policy.use_adapter(agent)
        rows[agent] = policy.step(
            [batch.samples[i] for i in mine],
            [batch.advantages[i] for i in mine],
            [batch.rollout_index[i] for i in mine],
        )
    return merge_rows(rows)


def merge_rows(rows: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """One step row from per-agent rows, plus ``loss_<agent>`` and ``grad_norm_<agent>`` of each."""
    out: dict[str, float] = {}
    tokens = {agent: max(row.get("trained_tokens", 0.0), 1.0) for agent, row in rows.items()}
    total = sum(tokens.values())
    for key in {k for row in rows.values() for k in row}:
        values = {agent: row[key] for agent, row in rows.items() if key in row}
        if key in _SUMMED:
            out[key] = sum(values.values())
        elif key in _WEIGHTED:
            out[key] = sum(v * tokens[a] for a, v in values.items()) / total
        elif key == "grad_norm":  # the norm over every adapter's parameters together
            out[key] = math.sqrt(sum(v * v for v in values.values()))
        else:  # memory peaks and limits
            out[key] = max(values.values())
    if "update_time_s" in out and out["update_time_s"] > 0:
        out["train_tokens_per_s"] = out.get("processed_tokens", 0.0) / out["update_time_s"]
    for agent, row in rows.items():
        out[f"loss_{agent}"], out[f"grad_norm_{agent}"] = row.get("loss", 0.0), row.get("grad_norm", 0.0)
    return out


def check_agents_called(batch: StepBatch, agents: Sequence[str], step: int) -> None:
    """At the first step: none of ``agents`` made a call while the rollouts made some is a ConfigError
    (a misnamed agent trains nothing); some of them silent, or calls their adapter never saw, a warning."""
    off = batch.metrics.get("calls_off_adapter", 0.0)
    if off:
        log.warning(
            "%d calls of GRPOConfig.agents %s in step %d reached the base model, not their agent's adapter "
            "(agl.agent_scope or a span's name tags a call only after it ran): they do not train; send "
            "each agent's calls through llm.endpoint_for(name) or with the x-agl-agent header",
            int(off),
            ", ".join(map(repr, agents)),
            step,
        )
    if not batch.unseen_agents or not batch.called_agents:
        return
    seen = ", ".join(repr(a) if a else "(no agent name)" for a in batch.called_agents)
    unseen = ", ".join(map(repr, batch.unseen_agents))
    where = (
        f"made no model call in step {step}'s succeeded rollouts, whose calls came from {seen} "
        "(an agent is named by agl.agent_scope, llm.endpoint_for(name), the x-agl-agent header, or an "
        "enclosing span's name)"
    )
    if len(batch.unseen_agents) == len(agents):
        raise ConfigError(f"GRPOConfig.agents names {unseen}, which {where}: correct GRPOConfig.agents")
    log.warning("GRPOConfig.agents names %s, which %s; its adapter trains only once it calls", unseen, where)


__all__ = ["check_agents_called", "merge_rows", "step_agents"]
