"""``Trainer.fit``: wire store, engine, gateway, runners and the algorithm, run it, tear it all down."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.agent.base import LitAgent
from agl.algorithm.base import TrainingContext
from agl.runner.runner import Runner
from agl.schemas import LLM
from agl.store.base import LightningStore

if TYPE_CHECKING:
    from agl.trainer.trainer import Trainer

log = logging.getLogger(__name__)


async def run_fit(trainer: Trainer, agent: LitAgent, train: Sequence[Any], val: Sequence[Any]) -> Any:
    """Serve the algorithm's model (if it has one) behind a gateway, run runners, run the algorithm."""
    out = Path(trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    owns_store = trainer.store is None
    store: LightningStore
    if trainer.store is None:
        from agl.store.sqlite import SqliteLightningStore

        store = SqliteLightningStore(out / "store.db")
    else:
        store = trainer.store
    async with contextlib.AsyncExitStack() as stack:
        if owns_store:
            stack.push_async_callback(store.aclose)
        ctx = TrainingContext(store=store, output_dir=str(out))
        model_path = getattr(trainer.algorithm, "model_path", None)
        if model_path is not None:
            ctx = await _serve_model(stack, store, str(model_path), trainer, ctx)
        # Ctrl-C interrupts the whole fit (asyncio cancels it); the exit stack then stops everything
        runner = Runner(
            agent, store, max_concurrency=trainer.n_runners, poll_interval_s=0.02, handle_signals=False
        )
        runner_task = asyncio.create_task(runner.run())

        async def stop_runner() -> None:
            runner.stop()
            with contextlib.suppress(asyncio.CancelledError):
                await runner_task
            runner.close()

        stack.push_async_callback(stop_runner)
        return await trainer.algorithm.run(ctx, train, val)


async def _serve_model(
    stack: contextlib.AsyncExitStack,
    store: LightningStore,
    model_path: str,
    trainer: Trainer,
    ctx: TrainingContext,
) -> TrainingContext:
    from agl.engines.builtin.server import EngineServer
    from agl.gateway import Gateway, UpstreamConfig

    engine = EngineServer(model_path, **trainer.engine_options)
    await asyncio.to_thread(engine.start)
    stack.callback(engine.stop)
    gateway = Gateway(store, [UpstreamConfig(url=engine.base_url, kind="agl")])
    await asyncio.to_thread(gateway.start)
    stack.callback(gateway.stop)
    llm = LLM(endpoint=gateway.endpoint_template, model="policy", sampling_parameters=dict(trainer.sampling))

    async def sync_weights(state: dict[str, Any]) -> str:
        return await asyncio.to_thread(engine.update_weights, state)

    ctx.llm, ctx.flush, ctx.sync_weights = llm, gateway.flush, sync_weights
    ctx.extra.update(engine=engine, gateway=gateway)
    return ctx
