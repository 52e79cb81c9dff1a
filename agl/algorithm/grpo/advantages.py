"""Advantages: each rollout's reward against a baseline (its group's mean, or the rest of the batch),
divided by the reward std of its group, of the whole batch, or nothing."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Literal, cast

from agl.errors import ConfigError

StdScale = Literal["group", "batch", "none"]
STD_SCALES = ("group", "batch", "none")
Baseline = Literal["group", "batch"]
BASELINES = ("group", "batch")


def std_scale(value: bool | str) -> StdScale:
    """``scale_by_std`` as a scope: True is ``"group"`` (GRPO), False is ``"none"`` (Dr. GRPO)."""
    if value is True or value is False:
        return "group" if value else "none"
    if value not in STD_SCALES:
        raise ConfigError(
            f"scale_by_std must be True ('group'), False ('none'), 'group', 'batch' or 'none', got {value!r}"
        )
    return cast(StdScale, value)


def _std(values: Sequence[float]) -> float:
    mean = sum(values) / len(values)
    return float((sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5)


def group_advantages(
    rewards: Sequence[float],
    groups: Sequence[str],
    *,
    scale_by_std: bool | StdScale = True,
    leave_one_out: bool = False,
    eps: float = 1e-6,
) -> list[float]:
    """``(r - baseline) / std`` per rollout. The baseline is the mean of the rollout's group, or with
    ``leave_one_out`` the mean of the group's *other* rewards (RLOO; one group for the whole batch makes
    it a batch baseline, and a group of one gets 0). The std is its group's (``True``/"group"), the one
    of all ``rewards`` ("batch": group mean, batch std) or none (``False``/"none": Dr. GRPO). Computed
    per *rollout*, so a rollout split into several samples counts once."""
    scale = std_scale(scale_by_std)
    by_group: dict[str, list[float]] = defaultdict(list)
    for r, g in zip(rewards, groups, strict=True):
        by_group[g].append(r)
    stats = {g: (sum(rs), len(rs), _std(rs)) for g, rs in by_group.items()}
    batch_std = _std(rewards) if rewards else 0.0
    out = []
    for r, g in zip(rewards, groups, strict=True):
        total, n, group_std = stats[g]
        # leave-one-out: the mean of the others; a rollout alone has no baseline and no signal
        baseline = ((total - r) / (n - 1) if n > 1 else r) if leave_one_out else total / n
        centered = r - baseline
        std = {"group": group_std, "batch": batch_std, "none": None}[scale]
        out.append(centered if std is None else centered / (std + eps))
    return out


def zero_variance_groups(rewards: Sequence[float], groups: Sequence[str]) -> set[str]:
    """Groups whose rollouts all got the same reward: they carry no learning signal."""
    seen: dict[str, set[float]] = defaultdict(set)
    for r, g in zip(rewards, groups, strict=True):
        seen[g].add(round(r, 9))
    return {g for g, values in seen.items() if len(values) == 1}
