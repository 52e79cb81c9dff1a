"""The algorithm seam: ``Algorithm.run(ctx, train, val)`` with a ``TrainingContext`` to reach the loop.

An algorithm reaches runners only through the store: it enqueues rollouts, waits for them, reads
their spans through adapters, and publishes new resources (or weights through ``ctx.sync_weights``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.schemas import LLM
from agl.store.base import LightningStore


async def _no_flush() -> None:
    return None


@dataclass
class TrainingContext:
    """What the trainer hands an algorithm.

    Args:
        store: the LightningStore the runners serve.
        llm: the LLM resource agents should call (the gateway's rollout-scoped endpoint).
        flush: makes every recorded model call visible in the store (the gateway batches its writes).
        sync_weights: pushes a state dict to the engine and returns the new model version; None when the
            trainer serves no local engine (APO against a hosted model).
        output_dir: where checkpoints, metrics and plots go.
    """

    store: LightningStore
    llm: LLM | None = None
    flush: Callable[[], Awaitable[None]] = _no_flush
    sync_weights: Callable[[dict[str, Any]], Awaitable[str]] | None = None
    output_dir: str = "results"
    extra: dict[str, Any] = field(default_factory=dict)


class Algorithm:
    """Subclass and implement :meth:`run`; ``Trainer.fit`` calls it once with the wired context."""

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} must implement run(ctx, train, val)")


class FunctionAlgorithm(Algorithm):
    def __init__(self, fn: Callable[[TrainingContext, Sequence[Any], Sequence[Any]], Awaitable[Any]]) -> None:
        self.fn = fn

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        return await self.fn(ctx, train, val)


def algorithm(fn: Callable[[TrainingContext, Sequence[Any], Sequence[Any]], Awaitable[Any]]) -> Algorithm:
    """Make an ``async def fn(ctx, train, val)`` an Algorithm (the function form)."""
    return FunctionAlgorithm(fn)
