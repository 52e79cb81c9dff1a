"""The algorithm's two doors: ``ctx.rollouts`` (enqueue, wait, flush, spans) and ``ctx.publish_policy``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

import agl
from agl.adapter import final_reward
from agl.algorithm.base import TrainingContext, evaluate
from agl.algorithm.policy import LossConfig, Policy, PolicyConfig
from agl.engines.launch import BuiltinEngine, start_engines
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.runner.runner import Runner
from agl.schemas import LLM, ModelWeights, RolloutStatus
from agl.store.memory import InMemoryLightningStore


@agl.rollout
async def scored(task: str) -> float:
    if task == "boom":
        raise RuntimeError("the agent failed")
    return 0.5 if task == "half" else 1.0


async def test_rollouts_enqueue_groups_wait_flush_and_return_spans_in_task_order() -> None:
    store = InMemoryLightningStore()
    runner = Runner(scored, store, max_concurrency=4, poll_interval_s=0.01, handle_signals=False)
    running = asyncio.create_task(runner.run())
    statuses_at_flush: list[list[RolloutStatus]] = []

    async def flush() -> None:  # the gateway's flush runs after the wait: every rollout is done by then
        items = (await store.query_rollouts(limit=100)).items
        statuses_at_flush.append([r.status for r in items])

    ctx = TrainingContext(store=store, flush=flush)
    try:
        done = await ctx.rollouts(["a", "half"], mode="val", group_size=2, metadata={"step": 7}, timeout_s=30)
    finally:
        runner.stop()
        await running
        runner.close()
    assert [r.input for r, _ in done] == ["a", "a", "half", "half"]
    groups = [r.group_id for r, _ in done]
    assert groups[0] == groups[1] and groups[2] == groups[3] and groups[0] != groups[2]
    assert all(r.mode == "val" and r.metadata == {"step": 7} for r, _ in done)
    assert statuses_at_flush == [[RolloutStatus.SUCCEEDED] * 4]
    assert [final_reward(spans) for _, spans in done] == [1.0, 1.0, 0.5, 0.5]
    await store.aclose()


async def test_evaluate_is_the_mean_final_reward_with_failures_counted_apart() -> None:
    store = InMemoryLightningStore()
    runner = Runner(scored, store, max_concurrency=4, poll_interval_s=0.01, handle_signals=False)
    running = asyncio.create_task(runner.run())
    ctx = TrainingContext(store=store)
    try:
        result = await evaluate(ctx, ["a", "half", "boom"], None, timeout_s=30)
        empty = await evaluate(ctx, [], None)
    finally:
        runner.stop()
        await running
        runner.close()
    assert result.score == pytest.approx(0.75)  # over the two that yielded a reward, not (1 + 0.5 + 0) / 3
    assert (result.failures.failed, result.failures.total) == (1, 3)
    assert result.failures.by_class == {"agent": 1}
    assert "the agent failed" in (result.failures.first_error or "")
    assert empty.score != empty.score and empty.results == []  # NaN: nothing to score
    await store.aclose()


async def test_publish_policy_pushes_new_weights_to_the_engine_and_publishes_them_in_one_call(
    tmp_path: Path,
) -> None:
    path = tiny_model()
    engines = await start_engines(BuiltinEngine(), str(path), work_dir=tmp_path)
    store = InMemoryLightningStore()
    try:
        base_url = engines.replicas[0].base_url
        llm = LLM(endpoint=base_url, model="policy")
        ctx = TrainingContext(store=store, llm=llm, engines=engines, model_path=str(path))
        first = await ctx.publish_policy()  # nothing new: the weights the engine serves now
        policy = await asyncio.to_thread(Policy, PolicyConfig(model_path=str(path)), LossConfig())
        second = await ctx.publish_policy(policy, note="after a step")
        assert second.version != first.version and ctx.model_version == second.version
        async with httpx.AsyncClient() as client:  # the engine answers with the new version
            health = (await client.get(base_url.removesuffix("/v1") + "/health")).json()
        assert health["model_version"] == second.version
        latest = await store.get_latest_resources()
        assert latest is not None and latest.resources_id == second.resources_id
        assert latest.resources["llm"] == llm
        assert latest.resources["weights"] == ModelWeights(uri=str(path), version=second.version)
        assert latest.metadata == {"model_version": second.version, "note": "after a step"}
        with pytest.raises(ConfigError, match="no LoRA adapter"):  # vLLM's LoRA hot-load needs one
            policy.save_adapter(tmp_path / "adapter")
    finally:
        engines.stop()
        await store.aclose()


async def test_publish_policy_without_a_served_model_says_to_run_through_fit() -> None:
    ctx = TrainingContext(store=InMemoryLightningStore())
    with pytest.raises(ConfigError, match="Trainer.fit"):
        await ctx.publish_policy()
