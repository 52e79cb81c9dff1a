"""GRPO on production traffic: rewarded ``online`` rollouts read from a store, not queued by a trainer.

Online rollouts come one per conversation, not in groups of one task, so advantages use the batch
baseline (``GRPOConfig(baseline="batch")``: each reward against the mean of the batch's others). The
importance weights come from the logprobs the engine recorded with each call (the samples'
``old_logprobs``), as in async GRPO. A rollout recorded under a policy version more than
``max_version_lag`` versions behind the current one is skipped and counted, as is one recorded under a
version newer than the current one (a version rolled back since).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from agl import semconv as sc
from agl.adapter import final_reward, llm_calls
from agl.algorithm.base import rollout_spans
from agl.algorithm.grpo.advantages import std_scale
from agl.algorithm.grpo.batch import StepBatch, build_batch
from agl.algorithm.grpo.config import GRPOConfig
from agl.errors import ConfigError
from agl.schemas import Rollout, RolloutStatus, Span
from agl.store.base import LightningStore

ONLINE_MODE = sc.ROLLOUT_MODE_ONLINE  # the mode the gateway records production traffic under
PAGE = 500
_VERSION = re.compile(r"^v(\d+)$")


def version_number(version: str | None) -> int | None:
    """``"v12"`` -> 12: the engine's weights versions count publications; None for any other name."""
    match = _VERSION.match(version or "")
    return int(match.group(1)) if match else None


def finished_at(rollout: Rollout) -> float:
    """When a rollout finished (an online one: when its final reward arrived)."""
    return rollout.ended_at if rollout.ended_at is not None else rollout.updated_at


@dataclass
class OnlineBatch:
    """One round's data: the batch built from the fresh rewarded rollouts, what was skipped and why
    (``counts``), and the newest finish time read (the next round reads only after it)."""

    batch: StepBatch
    rollouts: list[Rollout]
    counts: dict[str, float] = field(default_factory=dict)
    watermark: float | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # rollout id -> why it was not trained on


async def _rollouts(
    store: LightningStore, mode: str, status: Sequence[RolloutStatus] | None
) -> list[Rollout]:
    out: list[Rollout] = []
    cursor = None
    while True:
        page = await store.query_rollouts(status=status, mode=mode, limit=PAGE, cursor=cursor)
        out += page.items
        cursor = page.next_cursor
        if cursor is None:
            return out


async def rewarded_since(
    store: LightningStore, after: float | None, mode: str = ONLINE_MODE
) -> list[Rollout]:
    """The ``mode`` rollouts a final reward finished after ``after`` (all of them when None), oldest first."""
    done = await _rollouts(store, mode, [RolloutStatus.SUCCEEDED])
    fresh = [r for r in done if after is None or finished_at(r) > after]
    return sorted(fresh, key=finished_at)


def batch_baseline(config: GRPOConfig) -> GRPOConfig:
    """``config`` with the batch baseline; a group std scale becomes the batch's (there are no groups)."""
    scale = "batch" if std_scale(config.scale_by_std) == "group" else config.scale_by_std
    return dataclasses.replace(config, baseline="batch", scale_by_std=scale)


def recorded_version(spans: Sequence[Span]) -> str | None:
    """The oldest weights version any of the rollout's calls ran on (None when no call recorded one)."""
    versions = [c.model_version for c in llm_calls(list(spans)) if c.model_version]
    numbered = [v for v in versions if version_number(v) is not None]
    if numbered:
        return min(numbered, key=lambda v: version_number(v) or 0)
    return versions[0] if versions else None


def staleness(recorded: str | None, current: str, max_version_lag: int | None) -> str | None:
    """Why a rollout recorded under ``recorded`` must not train the ``current`` policy; None when it may."""
    if max_version_lag is None:
        return None
    have, now = version_number(recorded), version_number(current)
    if have is None or now is None:
        return f"stale: version {recorded!r} cannot be ordered against the current {current!r}"
    if have > now:
        return f"stale: recorded under {recorded}, newer than the current {current} (rolled back)"
    if now - have > max_version_lag:
        return f"stale: recorded under {recorded}, {now - have} versions behind {current} (max {max_version_lag})"
    return None


async def read_online(
    store: LightningStore,
    config: GRPOConfig,
    *,
    current_version: str,
    after: float | None = None,
    max_version_lag: int | None = None,
    mode: str = ONLINE_MODE,
) -> OnlineBatch:
    """The rewarded ``mode`` rollouts finished after ``after`` as a GRPO batch for ``current_version``.

    Rollouts without a final reward yet are not read (counted as ``unrewarded``); stale ones (see
    :func:`staleness`) are counted and left out. The batch is :func:`build_batch`'s with
    ``baseline="batch"`` whatever ``config`` says (:func:`batch_baseline`), since these rollouts share no task.
    """
    if max_version_lag is not None and max_version_lag < 0:
        raise ConfigError(f"max_version_lag must be >= 0 (or None: no limit), got {max_version_lag}")
    rewarded = await rewarded_since(store, after, mode)
    every = await _rollouts(store, mode, None)
    spans: dict[str, list[Span]] = {}
    fresh: list[Rollout] = []
    skipped: dict[str, str] = {}
    for rollout in rewarded:
        rid = rollout.rollout_id
        spans[rid] = await rollout_spans(store, rid)
        if final_reward(spans[rid]) is None:  # succeeded without a reward span: nothing to learn from
            skipped[rid] = "no final reward"
            continue
        why = staleness(recorded_version(spans[rid]), current_version, max_version_lag)
        if why is not None:
            skipped[rid] = why
            continue
        fresh.append(rollout)
    batch = build_batch(fresh, spans, batch_baseline(config))
    counts = {
        "online_rollouts": float(len(every)),
        "unrewarded": float(sum(not r.status.is_terminal for r in every)),
        "rewarded_new": float(len(rewarded)),
        "stale": float(sum(why.startswith("stale") for why in skipped.values())),
        "trained_rollouts": float(len({s.rollout_id for s in batch.samples})),
        "samples": float(len(batch.samples)),
    }
    watermark = max((finished_at(r) for r in rewarded), default=after)
    return OnlineBatch(batch, fresh, counts, watermark, {**skipped, **batch.reasons})


__all__ = [
    "ONLINE_MODE",
    "OnlineBatch",
    "batch_baseline",
    "read_online",
    "recorded_version",
    "rewarded_since",
    "staleness",
    "version_number",
]
