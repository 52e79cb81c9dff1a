"""The training record: what each step trained on, written into each rollout's metadata.

The dashboard's group and trained-token views read it instead of re-running the batch code with
default settings, which showed wrong advantages for runs with other settings. One entry per rollout
the step drew (``metadata["agl.training"]``): the step, the settings that decide samples and credit,
whether it trained and why not, and each trained sample's calls, token spans, advantage and loss weight.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from agl import semconv as sc
from agl.algorithm.policy.loss import token_weights
from agl.schemas import Rollout

if TYPE_CHECKING:
    from agl.algorithm.grpo.batch import StepBatch
    from agl.algorithm.grpo.config import GRPOConfig
    from agl.store import LightningStore

#: the GRPOConfig fields that decide a step's samples and advantages (the dashboard rebuilds with them)
SETTINGS = (
    "level",
    "scale_by_std",
    "baseline",
    "credit",
    "call_reward_weight",
    "max_sample_tokens",
    "agents",
)


def record_settings(config: GRPOConfig) -> dict[str, Any]:
    """The step's sample-and-credit settings, plus the loss's objective and aggregation, as JSON values."""
    out: dict[str, Any] = {name: getattr(config, name) for name in SETTINGS}
    out.update(objective=config.loss.objective, aggregation=config.loss.aggregation)
    return out


def loss_weights(batch: StepBatch, aggregation: str) -> list[float]:
    """Each sample's share of the step's loss under ``aggregation`` (they sum to 1 over the batch).

    The aggregations weigh tokens linearly in the mask, so one column holding each sample's count of
    model tokens gives each sample's total weight from the policy's own ``token_weights``.
    """
    if not batch.samples:
        return []
    counts = torch.tensor([[float(s.num_model_tokens)] for s in batch.samples])  # (B, 1)
    groups = torch.tensor(batch.rollout_index, dtype=torch.long)
    return [float(w) for w in token_weights(counts, aggregation, groups)[:, 0]]


def step_records(
    step: int, rollouts: Sequence[Rollout], batch: StepBatch, config: GRPOConfig
) -> dict[str, dict[str, Any]]:
    """``{rollout_id: record}`` for every rollout of the step (see the module docstring)."""
    settings = record_settings(config)
    weights = loss_weights(batch, config.loss.aggregation)
    samples: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for sample, advantage, weight in zip(batch.samples, batch.advantages, weights, strict=True):
        samples[sample.rollout_id].append(
            {
                "calls": list(sample.call_response_ids),
                "spans": [list(span) for span in sample.call_spans],
                "tokens": len(sample.input_ids),
                "model_tokens": sample.num_model_tokens,
                "advantage": advantage,
                "loss_weight": weight,
            }
        )
    records = {}
    for r in rollouts:
        mine = samples.get(r.rollout_id, [])
        reason = None if mine else batch.reasons.get(r.rollout_id, "no trainable sample")
        records[r.rollout_id] = {
            "step": step,
            "settings": settings,
            "trained": bool(mine),
            "reason": reason,
            "advantage": (sum(s["advantage"] for s in mine) / len(mine))
            if mine
            else batch.would.get(r.rollout_id),
            "samples": mine,
        }
    return records


async def write_records(store: LightningStore, records: Mapping[str, dict[str, Any]]) -> None:
    """Merge each record into its rollout's metadata (concurrently: one small write per rollout)."""
    await asyncio.gather(
        *(store.update_rollout(rid, metadata={sc.TRAINING_RECORD: rec}) for rid, rec in records.items())
    )


__all__ = ["SETTINGS", "loss_weights", "record_settings", "step_records", "write_records"]
