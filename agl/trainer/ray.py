"""``Trainer.fit`` on a Ray cluster: runners and engine replicas on Ray actors, the algorithm on the driver.

``RayLauncher(runners=2).fit(trainer, agent, train, val)`` serves the trainer's store over HTTP from the
driver; each runner actor pulls rollouts from it with a ``LightningStoreClient``. Each engine replica
(``trainer.serving.engine``: built-in or vLLM) runs in an actor and reports its URL to the gateway on the driver;
new weights reach built-in engines as Ray objects and vLLM servers as folders (the cluster's nodes must
share ``output_dir``). ``host`` is the driver address actors connect to; engines bind their node's IP
unless ``host`` is a loopback address (one-machine clusters). Needs ``pip install 'agl[ray]'``.

Where things ran is recorded in the store: each runner's worker ``host`` carries ``ray_node_id`` and
``ray_node_ip``, and each engine replica's calls carry the backend name ``URL#ray-node=NODE_ID``. When a
runner actor dies (its node lost), ``fit`` fails that runner's in-flight attempts in the store and stops
with :class:`RayNodeLostError` naming the node; it does not carry on with fewer runners.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.agent.base import LitAgent
from agl.algorithm.base import TrainingContext
from agl.errors import AglError, ConfigError, install_command
from agl.schemas import AttemptStatus, WorkerStatus
from agl.store.client import LightningStoreClient

if TYPE_CHECKING:
    from agl.trainer.trainer import Trainer

log = logging.getLogger(__name__)

_NO_RAY = f"agl.trainer.ray needs Ray: {install_command('ray')} (ray>=2.9)"


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise ConfigError(_NO_RAY) from exc
    return ray


class RayNodeLostError(AglError, RuntimeError):
    """A runner actor died during ``fit`` (its Ray node was lost, or the actor crashed); the run stopped."""


def _where() -> dict[str, Any]:
    """Where the calling actor runs: Ray node id and IP, hostname and pid."""
    import ray

    return {
        "ray_node_id": ray.get_runtime_context().get_node_id(),
        "ray_node_ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
    }


def _check_resources(ray: Any, options: Mapping[str, Any], setting: str) -> None:
    """A custom resource no node of the cluster has would leave the actor pending forever: say so now."""
    wanted = dict(options.get("resources") or {})
    have = ray.cluster_resources()
    missing = sorted(name for name in wanted if name not in have)
    if missing:
        raise ConfigError(
            f"RayLauncher.{setting} asks for resources {missing} that no node of the Ray cluster has "
            f"(cluster resources: {sorted(have)}); start a node with ray start --resources or change {setting}"
        )


@dataclass(frozen=True)
class RayLauncher:
    """Where ``fit`` puts its parts on Ray; ``fit`` joins the running cluster or starts a local one.

    Args:
        runners: runner actors, each running ``runner_concurrency`` rollouts at a time.
        host: the driver address actors reach the store server and gateway at.
        init: ``ray.init`` keyword arguments when no cluster is connected yet (e.g. ``address="auto"``).
        runner_options / engine_options: ``.options(...)`` of the actors (``num_cpus``, ``num_gpus``,
            ``resources``, ``runtime_env``).
    """

    runners: int = 2
    runner_concurrency: int = 4
    host: str = "127.0.0.1"
    init: Mapping[str, Any] = field(default_factory=dict)
    runner_options: Mapping[str, Any] = field(default_factory=lambda: {"num_cpus": 0.5})
    engine_options: Mapping[str, Any] = field(default_factory=lambda: {"num_cpus": 1})

    def __post_init__(self) -> None:
        if self.runners < 1 or self.runner_concurrency < 1:
            raise ConfigError(
                f"RayLauncher needs runners >= 1 and runner_concurrency >= 1, got {self.runners}, "
                f"{self.runner_concurrency}"
            )

    def connect(self) -> Any:
        """The ``ray`` module, connected (``ray.init(**init)`` unless already initialized)."""
        ray = _ray()
        if not ray.is_initialized():
            ray.init(**dict(self.init))
        return ray

    def fit(self, trainer: Trainer, agent: LitAgent, train: Sequence[Any], val: Sequence[Any] = ()) -> Any:
        """``trainer.fit`` with runners and engines on actors; returns what the algorithm's ``run`` returns."""
        if trainer.algorithm is None:
            raise ConfigError("RayLauncher.fit needs Trainer(algorithm=...)")
        from agl.trackers import use_trackers

        with use_trackers(trainer.trackers):  # as Trainer.fit: the algorithm's MetricsLogger picks them up
            return asyncio.run(self._fit(trainer, agent, list(train), list(val)))

    async def _fit(self, trainer: Trainer, agent: LitAgent, train: Sequence[Any], val: Sequence[Any]) -> Any:
        from agl.asgi_server import BackgroundServer
        from agl.store.server import create_app
        from agl.trainer.fit import _open_store, _serve_model, algorithm_entry, served_model

        self.connect()
        entry = algorithm_entry(trainer.algorithm)
        spec = served_model(trainer.algorithm)
        out = trainer.run_dir = trainer.new_run_dir()
        out.mkdir(parents=True, exist_ok=True)
        # the gateway binds and advertises the driver address the runner actors use
        local = copy.copy(trainer)
        local.serving = dataclasses.replace(trainer.serving, host=self.host, public_host=self.host)
        async with contextlib.AsyncExitStack() as stack:
            store, owns_store = _open_store(trainer, out)
            if owns_store:
                stack.push_async_callback(store.aclose)
            # the runner actors get the token; nobody else on the network reaches the store
            store_token = secrets.token_urlsafe(24)
            store_server = BackgroundServer(create_app(store, token=store_token), host=self.host)
            await asyncio.to_thread(store_server.start)
            stack.callback(store_server.stop)
            ctx = TrainingContext(store=store, output_dir=str(out))
            if spec is not None:
                ctx = await _serve_model(stack, store, spec, local, ctx, placer=RayPlacer(self))
            fleet = RunnerFleet(self, agent, store_server.url, store_token)
            stack.push_async_callback(fleet.stop)
            runs = [asyncio.ensure_future(r) for r in fleet.start()]
            await fleet.placed()
            algorithm_task: asyncio.Future[Any] = asyncio.ensure_future(entry(ctx, train, val))
            try:
                await asyncio.wait({algorithm_task, *runs}, return_when=asyncio.FIRST_COMPLETED)
                if _lost_an_actor(algorithm_task):
                    # an engine actor died, most likely with its node, and the algorithm saw it first: the
                    # runner actors on that node end soon after, and their ends say which node was lost
                    await asyncio.wait(
                        runs, timeout=_RUNNER_LOSS_GRACE_S, return_when=asyncio.FIRST_EXCEPTION
                    )
                    if any(_lost_an_actor(r) for r in runs):
                        await fleet.raise_lost(store, runs)
                if not algorithm_task.done():  # a runner actor ended (or died) while the algorithm ran
                    await fleet.raise_lost(store, runs)
                return algorithm_task.result()
            finally:
                algorithm_task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await algorithm_task
                for run in runs:  # fleet.stop collects the results; these wrappers' errors are seen
                    run.add_done_callback(lambda f: f.cancelled() or f.exception())


class RunnerFleet:
    """``launcher.runners`` runner actors pulling from the store at ``store_url``."""

    def __init__(self, launcher: RayLauncher, agent: LitAgent, store_url: str, token: str | None = None):
        ray = launcher.connect()
        _check_resources(ray, launcher.runner_options, "runner_options")
        cls = ray.remote(_RunnerActor).options(**dict(launcher.runner_options))
        self.actors = [
            cls.remote(agent, store_url, launcher.runner_concurrency, token) for _ in range(launcher.runners)
        ]
        self.where: list[dict[str, Any]] = [{} for _ in self.actors]  # worker_id and node, once placed
        self._runs: list[Any] = []

    async def placed(self) -> list[dict[str, Any]]:
        """Wait until every actor runs; returns each one's worker id, Ray node id/IP, hostname and pid."""
        self.where = list(await asyncio.gather(*(a.where.remote() for a in self.actors)))
        return self.where

    async def raise_lost(self, store: Any, runs: Sequence[asyncio.Future[Any]]) -> None:
        """Some of the actors' ``runs`` ended early: fail the in-flight attempts of the lost actors and raise.

        Every actor on a node Ray reports dead counts as lost, and so does one on a dead actor's node
        whose own death shows within a few seconds: a lost node's actors die together, but their deaths
        reach the driver one by one, before Ray marks the node dead. Else the algorithm, stopping,
        would cancel those attempts as if nothing had happened to them.

        Raises:
            RayNodeLostError: an actor died (its node was lost, or it crashed).
            RuntimeError: an actor's run loop returned, or raised, while the algorithm still ran.
        """
        ray = _ray()
        died = {i: run.exception() for i, run in enumerate(runs) if _lost_an_actor(run)}
        if not died:
            for run in runs:
                if run.done():
                    run.result()  # an actor's own error, as it raised it
            raise RuntimeError("a Ray runner actor stopped while the algorithm was still running")
        nodes_of_dead = {self.where[i].get("ray_node_id") for i in died}
        node_mates = [
            r
            for i, r in enumerate(runs)
            if not r.done() and self.where[i].get("ray_node_id") in nodes_of_dead
        ]
        if node_mates:
            await asyncio.wait(node_mates, timeout=_NODE_MATES_GRACE_S)
            died = {i: run.exception() for i, run in enumerate(runs) if _lost_an_actor(run)}
        dead_nodes = {n["NodeID"] for n in ray.nodes() if not n.get("Alive", True)}
        lost = sorted(set(died) | {i for i, w in enumerate(self.where) if w.get("ray_node_id") in dead_nodes})
        nodes = {
            str(
                self.where[i].get("ray_node_id")
            ): f"{self.where[i].get('hostname')}, {self.where[i].get('ray_node_ip')}"
            for i in lost
        }
        named = "; ".join(f"{node} ({where})" for node, where in nodes.items())
        cause = str(next(iter(died.values()))).strip().splitlines()
        why = next((line for line in cause if "node" in line.lower()), cause[0] if cause else "")
        failed = 0
        for i in lost:
            node = self.where[i].get("ray_node_id")
            error = f"Ray node {node} lost (runner actor {i} died): {why}"
            failed += await _fail_attempts(store, self.where[i].get("worker_id"), error)
        raise RayNodeLostError(
            f"Ray runner actor(s) {lost} on node {named} died ({why}); the run stops: RayLauncher does not "
            f"continue on fewer runners. Their {failed} in-flight attempt(s) were marked failed in the store. "
            "Start fit again (from the last checkpoint) once the cluster has the resources back."
        ) from next(iter(died.values()))

    def start(self) -> list[Any]:
        """Start every actor's run loop; returns awaitable refs to each one's result (rollouts run)."""
        self._runs = [actor.run.remote() for actor in self.actors]
        return self._runs

    async def stop(self) -> list[dict[str, Any]]:
        """Stop claiming, let in-flight rollouts finish, and end the actors; returns each one's summary."""
        ray = _ray()
        await asyncio.gather(*(a.stop.remote() for a in self.actors), return_exceptions=True)
        results = await asyncio.gather(*self._runs, return_exceptions=True)
        for actor in self.actors:
            ray.kill(actor)
        return [r for r in results if isinstance(r, dict)]


_RUNNER_LOSS_GRACE_S = 30.0  # how long a lost engine actor's node has to show in its runner actors' ends
_NODE_MATES_GRACE_S = 10.0  # how long the other actors on a dead actor's node have to show their deaths


def _lost_an_actor(run: asyncio.Future[Any]) -> bool:
    """Whether ``run`` ended with a Ray actor's death (its node lost, or the actor crashed)."""
    if not run.done() or run.cancelled() or run.exception() is None:
        return False
    return isinstance(run.exception(), _ray().exceptions.RayActorError)


async def _fail_attempts(store: Any, worker_id: str | None, error: str) -> int:
    """Mark ``worker_id``'s preparing/running attempts failed with ``error``; returns how many."""
    if worker_id is None:
        return 0
    live = [AttemptStatus.PREPARING, AttemptStatus.RUNNING]
    attempts = (await store.query_attempts(worker_id=worker_id, status=live, limit=1000)).items
    for attempt in attempts:
        with contextlib.suppress(AglError):  # finished (or timed out) meanwhile: leave it as it is
            await store.update_attempt(
                attempt.rollout_id, attempt.attempt_id, status=AttemptStatus.FAILED, error=error
            )
    with contextlib.suppress(AglError):
        await store.update_worker(worker_id, status=WorkerStatus.OFFLINE)
    return len(attempts)


class _RunnerActor:
    """A ``Runner`` in a Ray actor (an async actor: ``run`` and ``stop`` share its event loop)."""

    def __init__(self, agent: LitAgent, store_url: str, max_concurrency: int, token: str | None) -> None:
        from agl.runner.runner import Runner

        self._where = _where()
        self.store = LightningStoreClient(store_url, token=token)
        self.runner = Runner(
            agent,
            self.store,
            max_concurrency=max_concurrency,
            poll_interval_s=0.02,
            handle_signals=False,
            host_info=self._where,
        )

    async def where(self) -> dict[str, Any]:
        return {"worker_id": self.runner.worker_id, **self._where}

    async def run(self) -> dict[str, Any]:
        try:
            outcomes = await self.runner.run()
        finally:
            self.runner.close()
            await self.store.aclose()
        return {"worker_id": self.runner.worker_id, "pid": os.getpid(), "rollouts": len(outcomes)}

    async def stop(self) -> None:
        self.runner.stop()


class RayPlacer:
    """An ``agl.engines.launch.Placer`` that starts each engine replica in its own Ray actor."""

    def __init__(self, launcher: RayLauncher) -> None:
        self.launcher = launcher
        self.ray = launcher.connect()

    def _actor(self, cls: type, *args: Any) -> Any:
        loopback = self.launcher.host in ("127.0.0.1", "localhost", "::1")
        options = dict(self.launcher.engine_options)
        _check_resources(self.ray, options, "engine_options")
        return self.ray.remote(cls).options(**options).remote(*args, loopback)

    def builtin(self, model_path: str, options: Mapping[str, Any]) -> RemoteBuiltin:
        return RemoteBuiltin(self.ray, self._actor(_BuiltinActor, model_path, dict(options)))

    def vllm(self, server_options: dict[str, Any], timeout_s: float) -> RemoteVllm:
        return RemoteVllm(self.ray, self._actor(_VllmActor, server_options, timeout_s))


def _bind_host(loopback: bool) -> str:
    if loopback:
        return "127.0.0.1"
    import ray

    return str(ray.util.get_node_ip_address())


class _BuiltinActor:
    def __init__(self, model_path: str, options: dict[str, Any], loopback: bool) -> None:
        from agl.engines.builtin.server import EngineServer

        self.server = EngineServer(model_path, host=_bind_host(loopback), **options).start()

    def info(self) -> tuple[str, int, str]:
        return self.server.base_url, os.getpid(), str(_where()["ray_node_id"])

    def update_weights(self, state: dict[str, Any]) -> str:
        return self.server.update_weights(state)

    def drop_prefix_cache(self) -> None:
        self.server.drop_prefix_cache()

    def release_weights(self) -> None:
        self.server.release_weights()

    def stop(self) -> None:
        self.server.stop()


class _VllmActor:
    def __init__(self, options: dict[str, Any], timeout_s: float, loopback: bool) -> None:
        from agl.engines.vllm import VllmServer

        self.server = VllmServer(**{**options, "host": _bind_host(loopback)}).start(timeout_s)

    def info(self) -> tuple[str, int, str]:
        return self.server.base_url, os.getpid(), str(_where()["ray_node_id"])

    def restart(self, model: str | None, timeout_s: float, model_version: str | None) -> None:
        self.server.restart(model, timeout_s, model_version=model_version)

    def load_lora(self, name: str, path: str) -> None:
        self.server.load_lora(name, path)

    def unload_lora(self, name: str, missing_ok: bool) -> None:
        self.server.unload_lora(name, missing_ok=missing_ok)

    def set_model_version(self, version: str, aliases: dict[str, str] | None) -> None:
        self.server.set_model_version(version, aliases)

    def stop(self) -> None:
        self.server.stop()


class _Remote:
    """The driver's handle on an engine actor: blocking calls, as ``ServedEngines`` makes from threads."""

    def __init__(self, ray: Any, actor: Any) -> None:
        self.ray, self.actor = ray, actor
        try:
            self.base_url, self.pid, self.node_id = ray.get(actor.info.remote())
        except ray.exceptions.RayError as exc:  # the actor's constructor raised: say why, not just "died"
            ray.kill(actor)
            why = str(exc).strip().splitlines()[-1]  # the traceback's last line: the original error
            raise ConfigError(f"an engine actor failed to start: {why}") from exc
        # the gateway records this as each call's backend: which node served it
        self.backend_name = f"{self.base_url}#ray-node={self.node_id}"

    def stop(self) -> None:
        try:
            self.ray.get(self.actor.stop.remote())
        except self.ray.exceptions.RayActorError as exc:  # its node was lost: nothing left to stop
            log.warning("engine actor %s is gone: %s", self.backend_name, str(exc).strip().splitlines()[0])
        finally:
            self.ray.kill(self.actor)


class RemoteBuiltin(_Remote):
    def update_weights(self, source: dict[str, Any]) -> str:
        return str(self.ray.get(self.actor.update_weights.remote(source)))

    def drop_prefix_cache(self) -> None:
        self.ray.get(self.actor.drop_prefix_cache.remote())

    def release_weights(self) -> None:
        self.ray.get(self.actor.release_weights.remote())


class RemoteVllm(_Remote):
    def restart(
        self, model: str | Path | None = None, timeout_s: float = 300.0, *, model_version: str | None = None
    ) -> None:
        self.ray.get(self.actor.restart.remote(model and str(model), timeout_s, model_version))

    def load_lora(self, name: str, path: str | Path) -> None:
        self.ray.get(self.actor.load_lora.remote(name, str(path)))

    def unload_lora(self, name: str, *, missing_ok: bool = False) -> None:
        self.ray.get(self.actor.unload_lora.remote(name, missing_ok))

    def set_model_version(self, version: str, aliases: dict[str, str] | None = None) -> None:
        self.ray.get(self.actor.set_model_version.remote(version, aliases))


__all__ = ["RayLauncher", "RayNodeLostError", "RayPlacer", "RunnerFleet"]
