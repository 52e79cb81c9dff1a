"""Reproducible seeds: one run seed fans out into per-step, per-rollout and per-model-call seeds.

A rollout's seed is kept in its metadata (:data:`ROLLOUT_SEED`); the gateway turns it into one OpenAI
``seed`` per model call of an attempt, so the engine samples each call from its own generator and the same
call draws the same tokens whatever else is decoded beside it and whenever it arrives. A call's index is
its place in its attempt's arrival order: sequential agents number their calls the same way every run,
calls an agent makes concurrently within one rollout may swap seeds between runs.
"""

from __future__ import annotations

import hashlib
import random

#: rollout metadata key holding the seed its model calls' sampling seeds derive from
ROLLOUT_SEED = "sampling_seed"

_SEED_BITS = 62  # an engine adds a choice index to a request's seed; stay well inside a signed 64-bit int


def derive_seed(*parts: int | str) -> int:
    """A stable non-negative seed from ``parts`` (the same parts give the same seed in every process,
    unlike ``hash``, which Python salts per process)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - _SEED_BITS)


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's global generators."""
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional here: nothing of it to seed
        pass
    else:
        np.random.seed(seed % 2**32)
    import torch

    torch.manual_seed(seed)


__all__ = ["ROLLOUT_SEED", "derive_seed", "seed_everything"]
