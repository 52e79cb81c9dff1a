"""``agl.Trainer``: wires store, gateway, engine, runners and an algorithm. Wiring only; no training logic here."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agl.agent.base import LitAgent
from agl.errors import ConfigError
from agl.runner.runner import AttemptOutcome
from agl.schemas import Resource
from agl.store.base import LightningStore

if TYPE_CHECKING:
    from agl.engines.launch import EngineSpec


class Trainer:
    """Runs an agent against an algorithm.

    Args:
        algorithm: what improves the agent (GRPO, APO, SFT or your own ``agl.Algorithm``).
        store: a LightningStore, or a store URL (``http://host:4747`` of ``agl store serve``,
            ``sqlite:///...``); defaults to an in-memory one for ``dev`` and SQLite for ``fit``.
        n_runners: concurrent rollouts the in-process runners execute; 0 starts none, for runners
            attached elsewhere (``agl runner --store URL``) to the same store.
        output_dir: metrics, checkpoints and (by default) the SQLite store go here.
        sampling: sampling parameters of the LLM resource agents get (the policy's own).
        engine_options: passed to the built-in engine serving the algorithm's model.
        engine: which engine serves the algorithm's model: ``agl.engines.BuiltinEngine(...)`` (the
            default) or ``agl.engines.VllmEngine(replicas=..., ...)`` (vLLM replicas behind the gateway).
        initial_resources: published before the algorithm starts (APO reads its prompt and the
            task LLM from the latest resources).
        gateway_host, gateway_port: where the LLM gateway binds (``0.0.0.0`` for runners on other
            machines; port 0: a free one).
        public_host: the host name remote runners use to reach the gateway; defaults to
            ``gateway_host``, or this machine's name when that is a wildcard address.
    """

    def __init__(
        self,
        *,
        algorithm: Any = None,
        store: LightningStore | str | None = None,
        n_runners: int = 4,
        output_dir: str = "results",
        sampling: dict[str, Any] | None = None,
        engine_options: dict[str, Any] | None = None,
        initial_resources: dict[str, Resource] | None = None,
        gateway_host: str = "127.0.0.1",
        gateway_port: int = 0,
        public_host: str | None = None,
        engine: EngineSpec | None = None,
    ) -> None:
        if n_runners < 0:
            raise ConfigError(f"n_runners must be >= 0 (0: only external runners), got {n_runners}")
        self.algorithm = algorithm
        self.store = store
        self.n_runners = n_runners
        self.output_dir = output_dir
        self.sampling = dict(sampling or {"temperature": 1.0})
        self.engine_options = dict(engine_options or {})
        self.initial_resources = dict(initial_resources or {})
        self.gateway_host = gateway_host
        self.gateway_port = gateway_port
        self.public_host = public_host
        self.engine = engine

    def dev(
        self, agent: LitAgent, tasks: Sequence[Any], resources: dict[str, Resource] | None = None
    ) -> list[AttemptOutcome]:
        """Run ``agent`` on ``tasks`` with ``resources`` and print rollouts, rewards and spans readably."""
        from agl.trainer.dev import run_dev

        if isinstance(self.store, str):
            raise ConfigError("Trainer.dev runs in-process: pass a LightningStore (or none), not a URL")
        return asyncio.run(
            run_dev(
                agent,
                tasks,
                resources if resources is not None else self.initial_resources or None,
                self.store,
                max_concurrency=max(self.n_runners, 1),
            )
        )

    def fit(self, agent: LitAgent, train_dataset: Sequence[Any], val_dataset: Sequence[Any] = ()) -> Any:
        """Train ``agent`` with the algorithm; returns what the algorithm's ``run`` returns.

        Ctrl-C, or an exception of the algorithm, stops the runners, the gateway and the engine cleanly;
        the exception propagates.
        """
        from agl.trainer.fit import algorithm_entry, run_fit

        if self.algorithm is None:
            raise ConfigError("Trainer.fit needs an algorithm, e.g. Trainer(algorithm=agl.GRPO(...))")
        algorithm_entry(self.algorithm)  # a wrong object fails here, before anything starts
        if self.n_runners == 0 and self.store is None:
            raise ConfigError(
                "Trainer(n_runners=0) starts no runner, so it needs a store external runners reach: "
                "pass store='http://host:4747' (agl store serve) and attach agl runner --store to it"
            )
        return asyncio.run(run_fit(self, agent, list(train_dataset), list(val_dataset)))
