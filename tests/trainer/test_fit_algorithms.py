"""Trainer.fit runs every kind of agl algorithm, and an algorithm that raises ends fit at once, cleanly.

Each test has a short pytest-timeout: a hang (the old behaviour when an algorithm raised before its
first await) fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

import agl
from agl.algorithm.apo import APO, APOConfig, APOResult
from agl.algorithm.base import Algorithm, TrainingContext
from agl.algorithm.sft import SFT, SFTConfig
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.schemas import LLM, PromptTemplate, RolloutCreate, RolloutStatus
from agl.store import SqliteLightningStore
from examples.apo.agent import price_agent
from examples.apo.simulated_lm import SimulatedLM, SimulatedLMServer, make_tasks
from tests.tiny_agents import digits_agent


@agl.rollout
async def echo_agent(task: int) -> float:
    await asyncio.sleep(0.01)
    return float(task)


class Boom(Exception):
    pass


class RaisesAtOnce(Algorithm):
    """Raises before its first await; notes the servers fit started so the test can check they stopped."""

    def __init__(self, model_path: str | None = None) -> None:
        self._model_path = model_path
        self.urls: list[str] = []

    def model_spec(self) -> agl.ModelSpec | None:
        return None if self._model_path is None else agl.ModelSpec(self._model_path)

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        if ctx.gateway is not None:
            self.urls.append(ctx.gateway.url)
        raise Boom("before the first await")


class RaisesAfterRollouts(Algorithm):
    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        done = await ctx.rollouts(train)
        assert all(r.status == RolloutStatus.SUCCEEDED for r, _ in done)
        raise Boom(f"after {len(done)} rollouts")


class RaisesWhileRolloutsRun(Algorithm):
    """Enqueues slow rollouts, then raises: fit must not wait for them (nor for the runner's grace)."""

    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> Any:
        await ctx.store.enqueue_rollouts([RolloutCreate(input=60) for _ in range(2)])
        while len((await ctx.store.query_attempts(limit=10)).items) < 2:  # both claimed
            await asyncio.sleep(0.05)
        raise Boom("with two attempts in flight")


class Mean(Algorithm):
    async def run(self, ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> float:
        done = await ctx.rollouts(train, group_size=2)
        rewards: list[float] = [s.attributes[agl.semconv.REWARD_VALUE] for _, spans in done for s in spans]
        return sum(rewards) / len(rewards)


def _agl_threads() -> set[str]:
    # the memory monitor is one daemon per process by design (agl.compute.memory.shared_monitor)
    names = {t.name for t in threading.enumerate() if t.name.startswith("agl")}
    return names - {"agl-memory-monitor"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("algorithm", [RaisesAtOnce, RaisesAfterRollouts])
def test_an_algorithm_that_raises_ends_fit_promptly(tmp_path: Path, algorithm: type[Algorithm]) -> None:
    with pytest.raises(Boom):
        agl.Trainer(algorithm=algorithm(), n_runners=2, output_dir=str(tmp_path)).fit(echo_agent, [1, 2])


@agl.rollout
async def sleeper(task: int) -> float:
    await asyncio.sleep(task)
    return 1.0


@pytest.mark.timeout(30)
def test_an_algorithm_raising_with_rollouts_in_flight_fails_them_at_once(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(Boom):
        agl.Trainer(algorithm=RaisesWhileRolloutsRun(), n_runners=2, output_dir=str(tmp_path)).fit(
            sleeper, []
        )
    assert time.monotonic() - started < 8  # neither the 60 s agents nor the runner's 10 s grace

    async def statuses() -> list[str]:
        store = SqliteLightningStore(tmp_path / "store.db")
        rollouts = (await store.query_rollouts()).items
        await store.aclose()
        return [r.status.value for r in rollouts]

    final = asyncio.run(statuses())
    assert len(final) == 2 and not {"running", "preparing"} & set(final)  # reported, not left claimed


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_raising_before_the_first_await_stops_the_engine_and_gateway(tmp_path: Path) -> None:
    algorithm = RaisesAtOnce(model_path=str(tiny_model()))
    with pytest.raises(Boom):
        agl.Trainer(algorithm=algorithm, n_runners=2, output_dir=str(tmp_path)).fit(digits_agent, ["a"])
    (gateway_url,) = algorithm.urls
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{gateway_url}/health", timeout=2)


@pytest.mark.timeout(30)
def test_custom_algorithm_and_function_form(tmp_path: Path) -> None:
    trainer = agl.Trainer(algorithm=Mean(), n_runners=3, output_dir=str(tmp_path / "a"))
    assert trainer.fit(echo_agent, [1, 2, 3]) == 2.0

    async def mean_fn(ctx: TrainingContext, train: Sequence[Any], val: Sequence[Any]) -> int:
        return len(await ctx.rollouts(train))

    fn_trainer = agl.Trainer(algorithm=mean_fn, n_runners=1, output_dir=str(tmp_path / "b"))
    assert fn_trainer.fit(echo_agent, [4, 5]) == 2


def test_an_object_that_is_no_algorithm_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no agl.Algorithm and no async function"):
        agl.Trainer(algorithm=object(), output_dir=str(tmp_path)).fit(echo_agent, [1])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="n_runners=0"):
        agl.Trainer(algorithm=Mean(), n_runners=0, output_dir=str(tmp_path)).fit(echo_agent, [1])
    with pytest.raises(ConfigError, match="n_runners must be >= 0"):
        agl.Trainer(algorithm=Mean(), n_runners=-1)


@pytest.mark.timeout(60)
def test_fit_runs_apo_against_the_simulated_lm(tmp_path: Path) -> None:
    with SimulatedLMServer(SimulatedLM()) as server:
        config = APOConfig(
            critic=LLM(endpoint=server.base_url, model="critic"),
            editor=LLM(endpoint=server.base_url, model="editor"),
            beam_width=2,
            branch_factor=2,
            rounds=3,
            minibatch_size=6,
        )
        trainer = agl.Trainer(
            algorithm=APO(config),
            n_runners=8,
            output_dir=str(tmp_path),
            initial_resources={
                "llm": LLM(endpoint=server.base_url, model="task"),
                "prompt": PromptTemplate(template="You are a shopping assistant. Answer the question."),
            },
        )
        train = [t.as_input() for t in make_tasks(12, seed=1)]
        val = [t.as_input() for t in make_tasks(9, seed=2)]
        result = trainer.fit(price_agent, train, val)
    assert isinstance(result, APOResult)
    assert result.rollouts_used > len(val) and len(result.history) > 1
    assert result.history[0].score == 0.0 and result.best.score == 1.0  # the search learned, via fit
    assert (tmp_path / "metrics.csv").exists() and (tmp_path / "curve.png").exists()  # the trainer's dir


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_fit_runs_sft_on_the_tiny_model(tmp_path: Path) -> None:
    config = SFTConfig(
        model_path=str(tiny_model()),
        iterations=1,
        samples_per_task=2,
        tasks_per_iteration=2,
        min_reward=None,
        top_k_per_task=1,
        batch_size=2,
        lr=1e-3,
    )
    before = _agl_threads()
    result = agl.Trainer(algorithm=SFT(config), n_runners=4, output_dir=str(tmp_path)).fit(
        digits_agent, ["a", "b"], ["c"]
    )
    assert result["history"][0]["samples"] > 0
    assert (tmp_path / "sft-iteration-1.jsonl").read_text().strip()
    assert _agl_threads() <= before  # runners, gateway and engine threads are gone


def test_the_published_llm_endpoint_names_a_host_remote_runners_can_reach() -> None:
    import socket
    from types import SimpleNamespace

    from agl.trainer.fit import _public_endpoint

    gateway = SimpleNamespace(
        endpoint_template="http://0.0.0.0:8123/rollout/{rollout_id}/attempt/{attempt_id}/v1"
    )
    wildcard = agl.Trainer(serving=agl.Serving(host="0.0.0.0"))
    assert _public_endpoint(gateway, wildcard) == (
        f"http://{socket.getfqdn()}:8123/rollout/{{rollout_id}}/attempt/{{attempt_id}}/v1"
    )
    named = agl.Trainer(serving=agl.Serving(host="0.0.0.0", public_host="trainer.lan"))
    assert _public_endpoint(gateway, named).startswith("http://trainer.lan:8123/rollout/")
    assert _public_endpoint(gateway, agl.Trainer(serving=agl.Serving(public_host="fd00::1"))).startswith(
        "http://[fd00::1]:8123/"
    )
