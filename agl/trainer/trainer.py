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
        output_dir: metrics, checkpoints and (by default) the SQLite store go here.
        sampling: sampling parameters of the LLM resource agents get (the policy's own).
        engine_options: passed to the built-in engine serving the algorithm's model.
    """

    def __init__(
        self,
        *,
        algorithm: Any = None,
        store: LightningStore | None = None,
        n_runners: int = 4,
        output_dir: str = "results",
        sampling: dict[str, Any] | None = None,
        engine_options: dict[str, Any] | None = None,
    ) -> None:
        self.algorithm = algorithm
        self.store = store
        self.n_runners = n_runners
        self.output_dir = output_dir
        self.sampling = dict(sampling or {"temperature": 1.0})
        self.engine_options = dict(engine_options or {})

    def dev(
        self, agent: LitAgent, tasks: Sequence[Any], resources: dict[str, Resource] | None = None
    ) -> list[AttemptOutcome]:
        """Run ``agent`` on ``tasks`` with ``resources`` and print rollouts, rewards and spans readably."""
        from agl.trainer.dev import run_dev

        return asyncio.run(run_dev(agent, tasks, resources, self.store, max_concurrency=self.n_runners))

    def fit(self, agent: LitAgent, train_dataset: Sequence[Any], val_dataset: Sequence[Any] = ()) -> Any:
        """Train ``agent`` with the algorithm; returns what the algorithm's ``run`` returns.

        Ctrl-C stops the runners, the gateway and the engine cleanly.
        """
        from agl.trainer.fit import run_fit

        if self.algorithm is None:
            from agl.errors import ConfigError

            raise ConfigError("Trainer.fit needs an algorithm, e.g. Trainer(algorithm=agl.GRPO(...))")
        return asyncio.run(run_fit(self, agent, list(train_dataset), list(val_dataset)))
