"""``agl.Trainer``: wires store, gateway, engine, runners and an algorithm. Wiring only; no training logic here.

``agl.Serving`` groups how the model is served (engine, gateway, sampling).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.agent.base import LitAgent
from agl.errors import ConfigError
from agl.runner.runner import AttemptOutcome
from agl.schemas import LLM, Resource
from agl.store.base import LightningStore
from agl.trackers import check_names, use_trackers
from agl.trainer.serving import Serving

if TYPE_CHECKING:
    from agl.algorithm.base import Algorithm, AlgorithmFn

#: where ``fit`` writes when ``output_dir`` is not given: ``results/<run name>-<timestamp>``
RESULTS_ROOT = "results"


class Trainer:
    """Runs an agent against an algorithm.

    Args:
        algorithm: what improves the agent (GRPO, APO, SFT, your own ``agl.Algorithm``, or an
            ``async def fn(ctx, train, val)``); ``dev`` needs none.
        store: a LightningStore, or a store URL (``http://host:4747`` of ``agl store serve``,
            ``sqlite:///...``); defaults to an in-memory one for ``dev`` and SQLite for ``fit``.
        n_runners: concurrent rollouts the in-process runners execute; 0 starts none, for runners
            attached elsewhere (``agl runner --store URL``) to the same store.
        output_dir: metrics, checkpoints and (by default) the SQLite store go here; by default a new
            ``results/<algorithm>-<timestamp>`` per ``fit`` (``run_dir`` names it), so runs never mix.
        serving: how the algorithm's model is served to the agents (:class:`Serving`: engine, gateway
            host/port/public host/tokens, sampling); the defaults serve it on loopback with the built-in engine.
        initial_resources: published before the algorithm starts (APO reads its prompt and the
            task LLM from the latest resources).
        trackers: experiment trackers the algorithm's metrics go to (``"tensorboard"``, ``"wandb"``,
            ``"mlflow"``; see :mod:`agl.trackers`); None: TensorBoard, and wandb when its env is set.
    """

    def __init__(
        self,
        algorithm: Algorithm | AlgorithmFn | None = None,
        *,
        store: LightningStore | str | None = None,
        n_runners: int = 4,
        output_dir: str | None = None,
        serving: Serving | None = None,
        initial_resources: dict[str, Resource] | None = None,
        trackers: Sequence[str] | None = None,
    ) -> None:
        if n_runners < 0:
            raise ConfigError(f"n_runners must be >= 0 (0: only external runners), got {n_runners}")
        if serving is not None and not isinstance(serving, Serving):
            raise ConfigError(
                f"Trainer(serving=...) takes an agl.Serving(...), got a {type(serving).__name__}"
            )
        self.algorithm = algorithm
        self.store = store
        self.n_runners = n_runners
        self.output_dir = output_dir
        self.serving = serving or Serving()
        self.initial_resources = dict(initial_resources or {})
        self.trackers = None if trackers is None else check_names(trackers)
        #: the output folder of the latest ``fit`` (``output_dir``, or the per-run default)
        self.run_dir: Path | None = None

    def new_run_dir(self) -> Path:
        """This fit's output folder: ``output_dir`` as given, else a new ``results/<algorithm>-<timestamp>``.

        With the default and ``resume=True`` in the algorithm's config, the newest earlier run of the same
        algorithm is continued instead.
        """
        if self.output_dir is not None:
            return Path(self.output_dir)
        name = _run_name(self.algorithm)
        root = Path(RESULTS_ROOT)
        if getattr(getattr(self.algorithm, "config", None), "resume", False):
            earlier = sorted(p for p in root.glob(f"{name}-*") if p.is_dir())
            if earlier:
                return earlier[-1]
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path, n = root / f"{name}-{stamp}", 1
        while path.exists():  # two fits in one second
            n += 1
            path = root / f"{name}-{stamp}-{n}"
        return path

    def dev(
        self,
        agent: LitAgent,
        tasks: Sequence[Any],
        resources: dict[str, Resource] | None = None,
        *,
        model: str | None = None,
    ) -> list[AttemptOutcome]:
        """Run ``agent`` on ``tasks`` with ``resources`` and print rollouts, rewards and spans readably.

        An agent that calls a model needs one: ``model="tiny"`` / ``"smollm2"`` / a local HF folder serves
        it with the built-in engine for the run (published as the ``llm`` resource), or pass
        ``resources={"llm": agl.LLM(endpoint=..., model=...)}`` for a server of your own. The openai
        instrumentor is switched on, so the span tree shows the agent's model calls.
        """
        from agl.trainer.dev import run_dev, serve_model

        store = self.store
        if isinstance(store, str):
            raise ConfigError("Trainer.dev runs in-process: pass a LightningStore (or none), not a URL")
        given = dict(resources if resources is not None else self.initial_resources)

        def run() -> list[AttemptOutcome]:
            return asyncio.run(
                run_dev(agent, tasks, given or None, store, max_concurrency=max(self.n_runners, 1))
            )

        if model is None:
            return run()
        if any(isinstance(r, LLM) for r in given.values()):
            raise ConfigError("Trainer.dev got model= and an LLM in resources: pass one of them")
        with serve_model(model, self.serving.sampling) as llm:
            given["llm"] = llm
            return run()

    def fit(self, agent: LitAgent, train_dataset: Sequence[Any], val_dataset: Sequence[Any] = ()) -> Any:
        """Train ``agent`` with the algorithm; returns what the algorithm's ``run`` returns.

        Ctrl-C, or an exception of the algorithm, stops the runners, the gateway and the engine cleanly;
        the exception propagates.
        """
        from agl.trainer.fit import algorithm_entry, run_fit
        from agl.trainer.quiet import quiet_transformers

        refuse_in_spawned_rank()
        if self.algorithm is None:
            raise ConfigError("Trainer.fit needs an algorithm, e.g. Trainer(algorithm=agl.GRPO(...))")
        algorithm_entry(self.algorithm)  # a wrong object fails here, before anything starts
        if self.n_runners == 0 and self.store is None:
            raise ConfigError(
                "Trainer(n_runners=0) starts no runner, so it needs a store external runners reach: "
                "pass store='http://host:4747' (agl store serve) and attach agl runner --store to it"
            )
        with use_trackers(self.trackers), quiet_transformers():  # the MetricsLogger picks the trackers up
            return asyncio.run(run_fit(self, agent, list(train_dataset), list(val_dataset)))


def _run_name(algorithm: Any) -> str:
    """``grpo``, ``apo``, ``sft`` or the algorithm's own (function or class) name, as a folder name."""
    raw = getattr(algorithm, "__name__", None) or type(algorithm).__name__
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in raw.lower()) or "run"


def refuse_in_spawned_rank() -> None:
    """Raise when ``fit`` runs while a spawned data-parallel rank re-imports an unguarded main script
    (it would start a second training, and rank 0 would wait for this rank forever)."""
    if not os.environ.get("AGL_SPAWNED_RANK"):
        return
    # a spawned child runs its copy of the main script with __name__ == "__mp_main__": is it calling us?
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") != "__mp_main__":
        frame = frame.f_back  # type: ignore[assignment]
    if frame is not None:
        from agl.algorithm.policy.distributed import MAIN_GUARD_FIX

        raise ConfigError(f"Trainer.fit ran in a spawned training rank: {MAIN_GUARD_FIX}")
