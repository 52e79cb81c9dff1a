"""``agl.Trainer``: wires store, gateway, engine, runners and an algorithm. Wiring only; no training logic here."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from agl.agent.base import LitAgent
from agl.runner.runner import AttemptOutcome
from agl.schemas import Resource
from agl.store.base import LightningStore


class Trainer:
    """Runs an agent against an algorithm.

    Args:
        algorithm: what improves the agent (GRPO, APO, SFT or your own ``agl.Algorithm``).
        store: the LightningStore; defaults to an in-memory one for ``dev`` and SQLite for ``fit``.
        n_runners: concurrent rollouts the in-process runners execute.
    """

    def __init__(
        self, *, algorithm: Any = None, store: LightningStore | None = None, n_runners: int = 4
    ) -> None:
        self.algorithm = algorithm
        self.store = store
        self.n_runners = n_runners

    def dev(
        self, agent: LitAgent, tasks: Sequence[Any], resources: dict[str, Resource] | None = None
    ) -> list[AttemptOutcome]:
        """Run ``agent`` on ``tasks`` with ``resources`` and print rollouts, rewards and spans readably."""
        from agl.trainer.dev import run_dev

        return asyncio.run(run_dev(agent, tasks, resources, self.store, max_concurrency=self.n_runners))
