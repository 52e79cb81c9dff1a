"""The collectives a data-parallel policy step needs: shard samples by tokens, sum gradients and metrics.

Kept apart from :mod:`agl.algorithm.policy.distributed` (which starts and drives the ranks) so that the
policy can use them without importing the rank machinery that imports the policy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

#: metrics that are sums of per-rank parts (each part already weighted by its global share)
SUMMED_METRICS = ("loss", "kl", "clip_fraction", "entropy", "ratio_mean", "distill_kl")


def shard(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Sample indices per rank, balanced by tokens (longest first to the lightest rank); deterministic."""
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(i)
        loads[rank] += lengths[i]
    return [sorted(s) for s in shards]


def active() -> bool:
    """Whether a process group of more than one rank is up (the policy then trains its shard only)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_grads(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum ``.grad`` over ranks in one flat buffer per dtype; a rank without a grad contributes zeros."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group if p.grad is not None])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for p in group:
            assert p.grad is not None
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n


def all_reduce_metrics(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    keys = [k for k in SUMMED_METRICS if k in metrics]
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return {**metrics, **dict(zip(keys, values.tolist(), strict=True))}


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"
