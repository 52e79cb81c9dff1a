"""Group-relative advantages: each rollout's reward against the other rollouts of its task."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence


def group_advantages(
    rewards: Sequence[float], groups: Sequence[str], *, scale_by_std: bool = True, eps: float = 1e-6
) -> list[float]:
    """``(r - mean_group) / std_group`` per rollout; without std division when ``scale_by_std`` is
    False (Dr. GRPO). Computed per *rollout*, so a rollout split into several samples counts once."""
    by_group: dict[str, list[float]] = defaultdict(list)
    for r, g in zip(rewards, groups, strict=True):
        by_group[g].append(r)
    stats = {}
    for g, rs in by_group.items():
        mean = sum(rs) / len(rs)
        std = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
        stats[g] = (mean, std)
    out = []
    for r, g in zip(rewards, groups, strict=True):
        mean, std = stats[g]
        out.append((r - mean) / (std + eps) if scale_by_std else r - mean)
    return out


def zero_variance_groups(rewards: Sequence[float], groups: Sequence[str]) -> set[str]:
    """Groups whose rollouts all got the same reward: they carry no learning signal."""
    seen: dict[str, set[float]] = defaultdict(set)
    for r, g in zip(rewards, groups, strict=True):
        seen[g].add(round(r, 9))
    return {g for g, values in seen.items() if len(values) == 1}
