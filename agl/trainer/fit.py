"""``Trainer.fit``: wire store, engine, gateway, runners and the algorithm, run it, tear it all down."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import secrets
import socket
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast
from urllib.parse import urlsplit, urlunsplit

from agl.agent.base import LitAgent
from agl.algorithm.base import Algorithm, AlgorithmFn, TrainingContext
from agl.algorithm.spec import ModelSpec, TeacherSpec
from agl.errors import ConfigError
from agl.runner.runner import Runner
from agl.schemas import LLM, Resource
from agl.store.base import LightningStore
from agl.trainer.serving import Serving

if TYPE_CHECKING:
    from agl.engines.launch import Placer
    from agl.gateway.config import UpstreamConfig

log = logging.getLogger(__name__)


class FitSettings(Protocol):
    """What ``fit`` reads of the ``agl.Trainer`` (so this module need not import it)."""

    algorithm: Algorithm | AlgorithmFn | None
    store: LightningStore | str | None
    n_runners: int
    output_dir: str | None
    serving: Serving
    initial_resources: dict[str, Resource]
    run_dir: Path | None

    def new_run_dir(self) -> Path: ...


def algorithm_entry(algorithm: object) -> AlgorithmFn:
    """How ``fit`` calls ``algorithm``: ``run(ctx, train, val)`` for an ``agl.Algorithm`` (GRPO, APO, SFT,
    yours), or the ``async def fn(ctx, train, val)`` form itself.

    Raises:
        ConfigError: ``algorithm`` is neither.
    """
    if isinstance(algorithm, Algorithm):
        return algorithm.run
    if inspect.iscoroutinefunction(algorithm):
        return cast(AlgorithmFn, algorithm)
    raise ConfigError(
        f"Trainer(algorithm=...) got a {type(algorithm).__name__}, which is no agl.Algorithm and no async "
        "function: pass agl.GRPO/SFT/APO, an agl.Algorithm subclass or an async def fn(ctx, train, val)"
    )


def served_model(algorithm: object) -> ModelSpec | None:
    """The model ``fit`` serves for ``algorithm``: its ``model_spec()`` (None for the function form).

    Raises:
        ConfigError: ``model_spec()`` returned no ``ModelSpec``; NotImplementedError: a local teacher on vLLM.
    """
    if not isinstance(algorithm, Algorithm):
        return None
    spec = algorithm.model_spec()
    if spec is None:
        return None
    owner = f"{type(algorithm).__name__}.model_spec()"
    if not isinstance(spec, ModelSpec):
        raise ConfigError(f"{owner} must return an agl.ModelSpec or None, got a {type(spec).__name__}")
    if spec.teacher is not None and spec.teacher.path is not None:
        from agl.engines.launch import VllmEngine

        if isinstance(spec.teacher.engine, VllmEngine):
            raise NotImplementedError(
                f"{owner} declares a teacher ({spec.teacher.path}) served by vLLM, which Trainer.fit does not "
                "do yet: leave TeacherSpec.engine None (the built-in engine), or serve it yourself and pass "
                "its URL as the teacher's endpoint"
            )
    return spec


def _open_store(trainer: FitSettings, out: Path) -> tuple[LightningStore, bool]:
    """The trainer's store and whether ``fit`` owns it (opened it, so closes it)."""
    if isinstance(trainer.store, LightningStore):
        return trainer.store, False
    if isinstance(trainer.store, str):
        from agl.store import open_store

        return open_store(trainer.store), True
    from agl.store.sqlite import SqliteLightningStore

    return SqliteLightningStore(out / "store.db"), True


async def run_fit(trainer: FitSettings, agent: LitAgent, train: Sequence[Any], val: Sequence[Any]) -> Any:
    """Serve the algorithm's model (if it has one) behind a gateway, run runners, run the algorithm.

    An exception of the algorithm, or of the runners, ends ``fit`` at once: the exit stack stops the
    runners, the gateway and the engine, and the exception propagates.
    """
    entry = algorithm_entry(trainer.algorithm)
    spec = served_model(trainer.algorithm)
    out = trainer.run_dir = trainer.new_run_dir()
    out.mkdir(parents=True, exist_ok=True)
    if trainer.output_dir is None:  # say where this run's folder is: its name is new each run
        print(
            f"agl: Trainer.fit writes to {out}/ (Trainer(output_dir=...) to choose)",
            file=sys.stderr,
            flush=True,
        )
    async with contextlib.AsyncExitStack() as stack:
        store, owns_store = _open_store(trainer, out)
        if owns_store or _is_client(store):
            # a client's aclose only drops this event loop's connection pool, which dies with the loop
            # anyway; the caller's client stays usable
            stack.push_async_callback(store.aclose)
        ctx = TrainingContext(store=store, output_dir=str(out))
        if spec is not None:
            ctx = await _serve_model(stack, store, spec, trainer, ctx)
        if trainer.initial_resources:
            await ctx.publish(trainer.initial_resources)
        if trainer.n_runners == 0:
            log.info("Trainer.fit starts no runner: external runners (agl runner) must serve the store")
            return await entry(ctx, train, val)
        # Ctrl-C interrupts the whole fit (asyncio cancels it); the exit stack then stops everything
        # idle polls back off to 0.1 s, not the runner's default 1 s: the algorithm enqueues a step's rollouts
        # right after its update, and a long back-off would leave them queued for up to a second every step
        runner = Runner(
            agent,
            store,
            max_concurrency=trainer.n_runners,
            poll_interval_s=0.02,
            max_poll_interval_s=0.1,
            handle_signals=False,
        )
        runner_task = asyncio.create_task(runner.run())

        async def stop_runner() -> None:
            runner.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await runner_task
            runner.close()

        stack.push_async_callback(stop_runner)
        algorithm_task: asyncio.Future[Any] = asyncio.ensure_future(entry(ctx, train, val))
        stack.push_async_callback(_cancel, algorithm_task)
        try:
            await asyncio.wait({algorithm_task, runner_task}, return_when=asyncio.FIRST_COMPLETED)
            if not algorithm_task.done():  # the runner ended on its own: nothing would run the rollouts
                runner_task.result()  # its exception, if it raised one
                raise RuntimeError("the in-process runner stopped while the algorithm was still running")
            return algorithm_task.result()
        except BaseException:
            runner.shutdown_grace_s = 0  # nobody will read in-flight rollouts: fail them now, not after grace
            raise


def _is_client(store: LightningStore) -> bool:
    from agl.store.client import LightningStoreClient

    return isinstance(store, LightningStoreClient)


async def _cancel(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _public_endpoint(gateway: Any, trainer: FitSettings) -> str:
    """The gateway's rollout-scoped endpoint under the host name runners elsewhere can reach."""
    host = trainer.serving.public_host or trainer.serving.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.getfqdn()
    parts = urlsplit(str(gateway.endpoint_template))
    netloc = f"[{host}]" if ":" in host else host
    return urlunsplit(parts._replace(netloc=f"{netloc}:{parts.port}"))


def gateway_client_token(settings: Serving) -> str | None:
    """The token model calls need: the settings' own; generated (and printed once) for a gateway bound
    beyond loopback without one, so that it is never open to the network; none on loopback."""
    if settings.token or settings.loopback:
        return settings.token or None
    token = secrets.token_urlsafe(24)
    print(
        f"agl: the gateway binds {settings.host} and no token was given, so fit made one: {token}\n"
        "     agents get it as llm.api_key (openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key));"
        " choose your own with Trainer(serving=agl.Serving(token=...))",
        file=sys.stderr,
        flush=True,
    )
    return token


async def _serve_model(
    stack: contextlib.AsyncExitStack,
    store: LightningStore,
    model: ModelSpec,
    trainer: FitSettings,
    ctx: TrainingContext,
    placer: Placer | None = None,
) -> TrainingContext:
    from agl.engines.launch import BuiltinEngine, start_engines
    from agl.gateway import Gateway

    spec = trainer.serving.engine or BuiltinEngine()
    work_dir = Path(ctx.output_dir) / "engine"
    engines = await start_engines(
        spec,
        model.path,
        lora_rank=model.lora_rank,
        precision=model.precision,
        work_dir=work_dir,
        placer=placer,
        adapters={a.name: a.rank for a in model.adapters.values()},
    )
    stack.callback(engines.stop)
    upstreams = list(engines.upstreams)
    release_teacher = None
    if model.teacher is not None:
        teacher_upstream, release_teacher = await _teacher_upstream(stack, model.teacher, work_dir, placer)
        upstreams.append(teacher_upstream)
    settings = trainer.serving
    client_token = gateway_client_token(settings)
    gateway = Gateway(
        store,
        upstreams,
        host=settings.host,
        port=settings.port,
        token=settings.admin_token or secrets.token_urlsafe(24),
        client_token=client_token,
        # each agent's calls through its endpoint reach its own adapter (ModelSpec.adapters)
        agent_models={agent: a.name for agent, a in model.adapters.items()},
    )
    await asyncio.to_thread(gateway.start)
    stack.callback(gateway.stop)
    llm = LLM(
        endpoint=_public_endpoint(gateway, trainer),
        model="policy",
        api_key=client_token,  # agents that build their client from llm.api_key need no change
        sampling_parameters=dict(trainer.serving.sampling),
    )
    ctx.llm, ctx.flush, ctx.model_path = llm, gateway.flush, model.path
    if model.teacher is not None:  # the same gateway, so teacher calls are recorded like the student's
        ctx.teacher_llm = llm.model_copy(update={"model": model.teacher.model})
    if release_teacher is not None:
        ctx.release_teacher = release_teacher
    ctx.engines, ctx.gateway = engines, gateway
    return ctx


async def _teacher_upstream(
    stack: contextlib.AsyncExitStack, teacher: TeacherSpec, work_dir: Path, placer: Placer | None
) -> tuple[UpstreamConfig, Callable[[], Awaitable[None]] | None]:
    """The gateway's upstream for the teacher, under its own model name: its endpoint, or a frozen
    built-in engine fit starts for its folder (stopped with the rest, or by the release this returns
    with it, once the algorithm has the teacher's traces)."""
    from agl.compute.memory import release_free_memory
    from agl.engines.launch import start_engines
    from agl.gateway.config import UpstreamConfig

    if teacher.endpoint is not None:
        upstream = UpstreamConfig(
            url=teacher.endpoint, kind="openai", api_key=teacher.api_key, models=[teacher.model]
        )
        return upstream, None
    assert teacher.path is not None
    served = await start_engines(
        teacher.engine,
        teacher.path,
        precision=teacher.precision,
        work_dir=work_dir / "teacher",
        placer=placer,
    )
    stack.callback(served.stop)

    async def release() -> None:
        await asyncio.to_thread(served.stop)
        served.replicas.clear()  # the engines' weights and caches go with their last references
        gc.collect()
        release_free_memory()  # glibc would hold the freed weights for reuse: hand them to the OS
        log.info("the teacher's engine is stopped: its memory goes to training")

    upstream = served.upstreams[0]
    named = upstream.model_copy(update={"models": [teacher.model], "name": f"teacher:{upstream.backend}"})
    return named, release
