"""``agl.Trainer``: wires store, gateway, engine, runners and an algorithm. Wiring only; no training logic here."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.agent.base import LitAgent
from agl.errors import ConfigError
from agl.runner.runner import AttemptOutcome
from agl.schemas import LLM, Resource
from agl.store.base import LightningStore
from agl.trackers import check_names, use_trackers

if TYPE_CHECKING:
    from agl.engines.launch import EngineSpec

#: where ``fit`` writes when ``output_dir`` is not given: ``results/<run name>-<timestamp>``
RESULTS_ROOT = "results"


@dataclass(frozen=True)
class GatewaySettings:
    """Where ``fit``'s LLM gateway binds, the host name it is published under, and its tokens.

    Args:
        host, port: where it binds (``0.0.0.0`` for runners on other machines; port 0: a free one).
        public_host: the host name remote runners use; defaults to ``host``, or this machine's name
            when that is a wildcard address.
        token: required on model calls; agents get it as ``llm.api_key``. A gateway bound beyond
            loopback without one gets a generated token (printed once), so it is never open there.
        admin_token: guards ``/admin/*`` and ``/metrics``; a random one when not given (``fit``
            itself pauses and flushes the gateway in process, without HTTP).
    """

    host: str = "127.0.0.1"
    port: int = 0
    public_host: str | None = None
    token: str | None = dataclasses.field(default=None, repr=False)
    admin_token: str | None = dataclasses.field(default=None, repr=False)

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach ``host``."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: assume it resolves beyond loopback
            return False


class Trainer:
    """Runs an agent against an algorithm.

    Args:
        algorithm: what improves the agent (GRPO, APO, SFT or your own ``agl.Algorithm``).
        store: a LightningStore, or a store URL (``http://host:4747`` of ``agl store serve``,
            ``sqlite:///...``); defaults to an in-memory one for ``dev`` and SQLite for ``fit``.
        n_runners: concurrent rollouts the in-process runners execute; 0 starts none, for runners
            attached elsewhere (``agl runner --store URL``) to the same store.
        output_dir: metrics, checkpoints and (by default) the SQLite store go here; by default a new
            ``results/<algorithm>-<timestamp>`` per ``fit`` (``run_dir`` names it), so runs never mix.
        sampling: sampling parameters of the LLM resource agents get (the policy's own).
        engine_options: passed to the built-in engine serving the algorithm's model.
        engine: which engine serves the algorithm's model: ``agl.engines.BuiltinEngine(...)`` (the
            default) or ``agl.engines.VllmEngine(replicas=..., ...)`` (vLLM replicas behind the gateway).
        initial_resources: published before the algorithm starts (APO reads its prompt and the
            task LLM from the latest resources).
        gateway: where the LLM gateway binds and its tokens (:class:`GatewaySettings`).
        gateway_host, gateway_port, public_host: the same as ``gateway=GatewaySettings(host, port,
            public_host)``, kept for existing code; not together with ``gateway``.
        trackers: experiment trackers the algorithm's metrics go to (``"tensorboard"``, ``"wandb"``,
            ``"mlflow"``; see :mod:`agl.trackers`); None: TensorBoard, and wandb when its env is set.
    """

    def __init__(
        self,
        *,
        algorithm: Any = None,
        store: LightningStore | str | None = None,
        n_runners: int = 4,
        output_dir: str | None = None,
        sampling: dict[str, Any] | None = None,
        engine_options: dict[str, Any] | None = None,
        initial_resources: dict[str, Resource] | None = None,
        gateway_host: str | None = None,
        gateway_port: int | None = None,
        public_host: str | None = None,
        engine: EngineSpec | None = None,
        gateway: GatewaySettings | None = None,
        trackers: Sequence[str] | None = None,
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
        self.engine = engine
        self.trackers = None if trackers is None else check_names(trackers)
        if gateway is not None and (gateway_host, gateway_port, public_host) != (None, None, None):
            raise ConfigError(
                "pass the gateway's host/port/public_host either in gateway=GatewaySettings(...) or as "
                "gateway_host/gateway_port/public_host, not both"
            )
        self.gateway = gateway or GatewaySettings(
            host=gateway_host or "127.0.0.1", port=gateway_port or 0, public_host=public_host
        )
        #: the output folder of the latest ``fit`` (``output_dir``, or the per-run default)
        self.run_dir: Path | None = None

    # the pre-GatewaySettings names, read-only
    @property
    def gateway_host(self) -> str:
        return self.gateway.host

    @property
    def gateway_port(self) -> int:
        return self.gateway.port

    @property
    def public_host(self) -> str | None:
        return self.gateway.public_host

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
        with serve_model(model, self.sampling) as llm:
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
        from agl.algorithm.grpo.distributed import MAIN_GUARD_FIX

        raise ConfigError(f"Trainer.fit ran in a spawned training rank: {MAIN_GUARD_FIX}")
