"""The Ray launcher on a local 2-CPU Ray cluster (one per module, ~15 s to start): engine and runner actors.

An engine actor serves the tiny model and takes new weights as a Ray object; ``RayLauncher.fit`` runs one
GRPO step with two runner actors pulling rollouts from the driver's store server over HTTP and the engine
in an actor, while the algorithm stays on the driver.
"""

from __future__ import annotations

import asyncio
import os
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import agl
from agl import semconv as sc
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.schemas import RolloutCreate

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    try:
        import ray
    except ImportError:
        pytest.fail("Ray is not installed: pip install 'agl[ray]' (or .venv/bin/pip install 'ray>=2.9')")
    ray.init(
        address="local",  # a fresh instance of its own, never a cluster another process started on this machine
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 * 1024**2,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}},  # actors import tests.*
        log_to_driver=False,
    )
    yield ray
    ray.shutdown()


def test_launcher_config_is_checked() -> None:
    from agl.trainer.ray import RayLauncher

    with pytest.raises(ConfigError, match="runners >= 1"):
        RayLauncher(runners=0)


def test_engine_actor_serves_the_tiny_model_and_takes_weights(ray_cluster: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from agl.trainer.ray import RayLauncher, RayPlacer

    engine = RayPlacer(RayLauncher()).builtin(str(tiny_model()), {})
    try:
        assert engine.pid != os.getpid()
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        first = httpx.post(f"{engine.base_url}/chat/completions", json=body, timeout=60).json()
        assert first["model_version"] == "v0" and first["choices"][0]["token_ids"]
        state = AutoModelForCausalLM.from_pretrained(tiny_model(), dtype=torch.float32).state_dict()
        assert engine.update_weights({k: v * 0.5 for k, v in state.items()}) == "v1"
        second = httpx.post(f"{engine.base_url}/chat/completions", json=body, timeout=60).json()
        assert second["model_version"] == "v1"
    finally:
        engine.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{engine.base_url}/models", timeout=5)


def test_engine_actor_that_cannot_start_says_why(ray_cluster: Any, tmp_path: Path) -> None:
    from agl.trainer.ray import RayLauncher, RayPlacer

    placer = RayPlacer(RayLauncher(engine_options={"num_cpus": 0.5}))
    options = {"model": str(tiny_model()), "python": str(tmp_path / "no-python")}
    with pytest.raises(ConfigError, match="engine actor failed to start.*setup_vllm.sh"):
        placer.vllm(options, timeout_s=60)


@agl.rollout
async def slow_hash_agent(task: str, llm: agl.LLM, rollout: agl.Rollout) -> float:
    """One chat call and a short pause, so two runner actors share the queue; reward varies by answer."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=3)
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"add {task}"}],
        max_tokens=6,
        seed=zlib.crc32(rollout.rollout_id.encode()) % 1000,
    )
    await client.close()
    await asyncio.sleep(0.5)
    return zlib.crc32((reply.choices[0].message.content or "").encode()) % 100 / 100


def test_fit_on_ray_runs_runners_and_engine_on_actors(ray_cluster: Any, tmp_path: Path) -> None:
    from agl.store.sqlite import SqliteLightningStore
    from agl.trainer.ray import RayLauncher

    config = GRPOConfig(
        model_path=str(tiny_model()), steps=1, tasks_per_step=2, group_size=4, lr=1e-3, eval_every=1
    )
    trainer = agl.Trainer(algorithm=GRPO(config), output_dir=str(tmp_path))
    launcher = RayLauncher(runners=2, runner_concurrency=2, engine_options={"num_cpus": 0.5})
    result = launcher.fit(trainer, slow_hash_agent, ["1", "2", "3"], ["4"])
    assert len(result["history"]) == 1 and result["history"][0]["trained_tokens"] > 0

    async def read() -> tuple[list[Any], list[Any], list[Any]]:
        store = SqliteLightningStore(tmp_path / "store.db")
        try:
            rollouts = (await store.query_rollouts(limit=100)).items
            attempts = (await store.query_attempts(limit=100)).items
            spans = []
            for r in rollouts:
                spans += [
                    s
                    for s in (await store.query_spans(rollout_id=r.rollout_id)).items
                    if sc.LLM_API in s.attributes
                ]
            workers = (await store.query_workers()).items
            return rollouts, attempts, spans + workers
        finally:
            await store.aclose()

    rollouts, attempts, found = asyncio.run(read())
    spans = [s for s in found if hasattr(s, "attributes")]
    workers = [w for w in found if hasattr(w, "host")]
    assert len(rollouts) == 8 + 2 and all(r.status == agl.RolloutStatus.SUCCEEDED for r in rollouts)
    # both runner actors ran rollouts, in processes other than the driver, and recorded their Ray node
    assert len({a.worker_id for a in attempts}) == 2
    hosts = [w.host for w in workers if w.worker_id in {a.worker_id for a in attempts}]
    assert {h["pid"] for h in hosts}.isdisjoint({os.getpid()})
    assert {h["ray_node_id"] for h in hosts} == {ray_cluster.get_runtime_context().get_node_id()}
    # the engine actor served every call, with token ids and the version of the weights used
    assert len(spans) == 10 and all(s.attributes[sc.LLM_HAS_TOKEN_IDS] for s in spans)
    assert len({s.attributes[sc.LLM_BACKEND] for s in spans}) == 1
    versions = sorted(s.attributes[sc.LLM_MODEL_VERSION] for s in spans)
    assert versions == ["v0"] * 9 + ["v1"]  # the last validation ran after the step's weight sync


def test_a_node_mate_whose_death_shows_late_is_counted_lost(ray_cluster: Any) -> None:
    """Actors of a lost node die together but their deaths reach the driver one by one, before Ray marks
    the node dead: the in-flight attempts of a node-mate whose death shows a moment later fail too, naming
    the node, instead of being left to the stopping algorithm to cancel."""
    from agl.trainer.ray import RayNodeLostError, RunnerFleet

    async def scenario() -> tuple[str, list[agl.Attempt]]:
        store = agl.InMemoryLightningStore()
        await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(2)])
        for worker in ("w-a", "w-b"):
            claimed = await store.dequeue(worker)
            assert claimed is not None
            await store.update_attempt(
                claimed.rollout.rollout_id, claimed.attempt.attempt_id, status=agl.AttemptStatus.RUNNING
            )
        fleet = RunnerFleet.__new__(RunnerFleet)  # the actors' places, without starting actors
        fleet.where = [{"worker_id": w, "ray_node_id": "node-x", "hostname": "h"} for w in ("w-a", "w-b")]
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        first.set_exception(ray_cluster.exceptions.RayActorError(error_msg="its node has died"))
        loop.call_later(0.3, second.set_exception, ray_cluster.exceptions.RayActorError(error_msg="its node"))
        with pytest.raises(RayNodeLostError) as err:
            await fleet.raise_lost(store, [first, second])
        second.exception()
        return str(err.value), (await store.query_attempts(limit=10)).items

    message, attempts = asyncio.run(scenario())
    assert "2 in-flight attempt(s) were marked failed" in message and "[0, 1]" in message
    assert [a.status for a in attempts] == [agl.AttemptStatus.FAILED] * 2
    assert all("Ray node node-x lost" in (a.error or "") for a in attempts)
