"""Rollouts that yield no reward are classed infra, agent or reward where they fail, and GRPO's
``on_failure`` resamples, drops or zeroes them per class; validation reports them apart from its score."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai
import pytest

import agl
from agl.algorithm.base import PendingRollouts, TrainingContext, evaluate
from agl.algorithm.grpo import GRPOConfig
from agl.algorithm.grpo.batch import build_batch
from agl.algorithm.grpo.failures import DROPPED_FILE, Settled, TaskIndex, settle_failures, write_dropped
from agl.algorithm.health import rollout_failures
from agl.errors import ConfigError, GatewayError, RewardError
from agl.failures import classify_exception
from agl.gateway import Gateway, GatewayConfig
from agl.models import tiny_model
from agl.schemas import AttemptStatus, RetryConfig, RolloutCreate
from agl.store import InMemoryLightningStore, LightningStore, SqliteLightningStore

DEAD = "http://127.0.0.1:9/v1"  # nothing listens: connection refused, as from a gateway that is down


async def _refused() -> None:
    client = openai.AsyncOpenAI(base_url=DEAD, api_key="k", max_retries=0)
    try:
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    finally:
        await client.close()


def _score(answer: str) -> float:
    raise KeyError(f"no gold answer for {answer!r}")


@agl.rollout
async def faulty_agent(task: str) -> float:
    """Fails as its task says: ``infra`` (the model unreachable), ``agent`` (its own code raises),
    ``reward`` (the reward function raises, wrapped in RewardError), ``nan`` (a reward that is not a
    number), ``hang`` (never finishes); ``ok`` scores 1."""
    if task == "infra":
        await _refused()
    if task == "agent":
        raise RecursionError("Recursion limit of 25 reached without hitting a stop condition")
    if task == "reward":
        try:
            return _score("42")
        except KeyError as exc:
            raise agl.RewardError("the reward function failed") from exc
    if task == "nan":
        return math.nan
    if task == "hang":
        await asyncio.sleep(60)
    return 1.0


def test_exceptions_are_classed_by_their_chain() -> None:
    request = httpx.Request("POST", DEAD)
    server_error = openai.InternalServerError(
        "upstream_failed",
        response=httpx.Response(502, request=request),
        body=None,
    )
    bad_request = openai.BadRequestError(
        "context too long",
        response=httpx.Response(400, request=request),
        body=None,
    )
    assert classify_exception(openai.APIConnectionError(request=request)) == "infra"
    assert classify_exception(server_error) == "infra"
    assert classify_exception(GatewayError("no replica")) == "infra"
    assert classify_exception(TimeoutError()) == "infra"
    assert classify_exception(bad_request) == "agent"  # the model's own output made the request bad
    assert classify_exception(ValueError("x")) == "agent"
    assert classify_exception(RecursionError("limit")) == "agent"
    try:
        try:
            raise openai.APIConnectionError(request=request)  # an LLM judge that cannot be reached
        except openai.APIConnectionError as exc:
            raise RewardError("judge down") from exc
    except RewardError as wrapped:
        assert classify_exception(wrapped) == "reward"  # the user said: the reward failed
    try:
        try:
            raise openai.APIConnectionError(request=request)
        except openai.APIConnectionError as exc:
            raise RuntimeError("tool call failed") from exc
    except RuntimeError as wrapped:
        assert classify_exception(wrapped) == "infra"


def test_on_failure_merges_defaults_and_names_a_bad_key_or_value() -> None:
    config = GRPOConfig(model_path="m", on_failure={"agent": "drop_group"})
    assert config.on_failure == {"infra": "resample", "agent": "drop_group", "reward": "drop_group"}
    assert GRPOConfig(model_path="m").on_failure == {
        "infra": "resample",
        "agent": "zero",
        "reward": "drop_group",
    }
    with pytest.raises(ConfigError, match=r"unknown failure class 'network'; use infra, agent, reward"):
        GRPOConfig(model_path="m", on_failure={"network": "zero"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"on_failure\['infra'\] = 'retry' is not an action; use resample"):
        GRPOConfig(model_path="m", on_failure={"infra": "retry"})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"on_failure\[\"reward\"\] cannot be \"zero\""):
        GRPOConfig(model_path="m", on_failure={"reward": "zero"})
    with pytest.raises(ConfigError, match="max_resamples must be >= 0"):
        GRPOConfig(model_path="m", max_resamples=-1)


async def _run(store: LightningStore, requests: list[RolloutCreate], agent: Any = faulty_agent) -> list[str]:
    created = await store.enqueue_rollouts(requests)
    runner = agl.Runner(agent, store, max_concurrency=8, poll_interval_s=0.01, heartbeat_interval_s=0.2)
    await runner.run(max_rollouts=len(requests))
    return [r.rollout_id for r in created]


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_the_runner_stores_each_class_with_the_failed_attempt(kind: str, tmp_path: Path) -> None:
    store = InMemoryLightningStore() if kind == "memory" else SqliteLightningStore(str(tmp_path / "s.db"))
    tasks = ["infra", "agent", "reward", "nan", "ok"]
    ids = await _run(store, [RolloutCreate(input=t) for t in tasks])
    timed = await _run(store, [RolloutCreate(input="hang", retry=RetryConfig(timeout_s=0.3))])
    classes = []
    for rid in ids + timed:
        attempts = (await store.query_attempts(rollout_id=rid)).items
        classes.append(attempts[-1].metadata.get("failure_class"))
    assert classes == ["infra", "agent", "reward", "reward", None, "infra"]
    rollouts = [await store.get_rollout(rid) for rid in ids + timed]
    failures = await rollout_failures(store, rollouts, {})
    assert (failures.failed, failures.total) == (5, 6)
    assert failures.by_class == {"infra": 2, "agent": 1, "reward": 2}
    errors = {f.rollout.input: f.error for f in failures.details}
    assert errors["reward"] == "RewardError: the reward function failed"
    assert errors["nan"].startswith("RewardError: rewards must be finite numbers")
    assert errors["hang"] == "the agent ran past timeout_s=0.3"
    assert (await store.query_attempts(rollout_id=timed[0])).items[-1].status == AttemptStatus.TIMEOUT
    await store.aclose()


@agl.rollout
async def gateway_agent(task: str, llm: agl.LLM) -> float:
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    try:
        await client.chat.completions.create(model=llm.model, messages=[{"role": "user", "content": task}])
    finally:
        await client.close()
    return 1.0


async def test_a_gateway_whose_engine_is_down_is_infra() -> None:
    store = InMemoryLightningStore()
    config = GatewayConfig(health_interval_s=0.1, backoff_s=0.01)
    with Gateway(store, [DEAD], config) as gateway:  # the engine behind it is not there: a 502 reply
        resources = await store.add_resources({"llm": agl.LLM(endpoint=gateway.endpoint_template, model="m")})
        (rid,) = await _run(
            store, [RolloutCreate(input="t", resources_id=resources.resources_id)], gateway_agent
        )
        rollout = await store.get_rollout(rid)
        failures = await rollout_failures(store, [rollout], {})
    assert failures.by_class == {"infra": 1}
    assert failures.first_error is not None and failures.first_error.startswith("InternalServerError")


async def test_an_attempt_the_watchdog_ends_or_a_rollout_left_unfinished_is_infra() -> None:
    store = InMemoryLightningStore()
    lost = await store.enqueue_rollout("t")
    claimed = await store.dequeue("w")  # a runner that claims it and dies: the watchdog's verdict
    assert claimed is not None
    await store.update_attempt(lost.rollout_id, claimed.attempt.attempt_id, status=AttemptStatus.UNRESPONSIVE)
    waiting = await store.enqueue_rollout("never run")
    rollouts = [await store.get_rollout(lost.rollout_id), waiting]
    failures = await rollout_failures(store, rollouts, {})
    assert failures.by_class == {"infra": 2}
    assert failures.details[0].error == "attempt unresponsive: its runner stopped reporting"


async def test_validation_scores_rewarded_rollouts_and_counts_failures_apart() -> None:
    store = InMemoryLightningStore()
    runner = agl.Runner(faulty_agent, store, max_concurrency=8, poll_interval_s=0.01)
    running = asyncio.create_task(runner.run())
    try:
        result = await evaluate(TrainingContext(store), ["ok", "ok", "agent", "infra"], None, timeout_s=30)
        failed = await evaluate(TrainingContext(store), ["agent"], None, timeout_s=30)
    finally:
        runner.stop()
        await running
    assert result.score == 1.0  # over the two that yielded a reward, not 0.5
    assert result.failures.by_class == {"infra": 1, "agent": 1}
    assert result.summary() == "1.000 over 2 of 4 rollouts; failed: infra 1, agent 1"
    assert math.isnan(failed.score) and failed.failures.all_failed


_SEEN: set[str] = set()


@agl.rollout
async def once_agent(task: str) -> float:
    """``once-<fault>[-n]``: the task's first rollout fails as :func:`faulty_agent`'s ``<fault>``, the
    others score 1 (a gateway down for a moment, an agent or reward that fails on one sample)."""
    if task.startswith("once-") and task not in _SEEN:
        _SEEN.add(task)
        return await faulty_agent.fn(task.split("-")[1])
    return await faulty_agent.fn("ok" if task.startswith("once-") else task)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    _SEEN.clear()


def _group(task: str, size: int) -> list[RolloutCreate]:
    return [RolloutCreate(input=task, group_id=f"g-{task}", metadata={"step": 1}) for _ in range(size)]


async def _settle(
    groups: list[list[RolloutCreate]], tmp_path: Path, *, max_resamples: int = 2, **on_failure: str
) -> tuple[Settled, list[dict[str, Any]], InMemoryLightningStore]:
    """One step's groups run by a real runner, then settled as ``on_failure`` says; with the rows of
    ``dropped.jsonl``."""
    store = InMemoryLightningStore()
    runner = agl.Runner(once_agent, store, max_concurrency=16, poll_interval_s=0.01, heartbeat_interval_s=0.2)
    running = asyncio.create_task(runner.run())
    ctx = TrainingContext(store, output_dir=str(tmp_path))
    config = GRPOConfig(model_path="m", on_failure=on_failure, max_resamples=max_resamples)  # type: ignore[arg-type]
    tasks = [g[0].input for g in groups]
    try:
        ids = [r.rollout_id for r in await store.enqueue_rollouts([r for g in groups for r in g])]
        done = await PendingRollouts(ctx, ids).collect(2.0)
        settled = await settle_failures(
            ctx,
            [r for r, _ in done],
            {r.rollout_id: s for r, s in done},
            on_failure=config.on_failure,
            max_resamples=config.max_resamples,
            timeout_s=5.0,
            step=3,
            task_index=TaskIndex(tasks),
        )
    finally:
        runner.stop()
        await running
    write_dropped(tmp_path, settled.dropped)
    path = tmp_path / DROPPED_FILE
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return settled, rows, store


async def test_defaults_resample_infra_zero_agent_and_drop_a_broken_rewards_group(tmp_path: Path) -> None:
    groups = [_group(t, 2) for t in ("once-infra", "once-agent", "once-reward", "ok")]
    settled, rows, _ = await _settle(groups, tmp_path)
    m = settled.metrics
    assert (m["resampled_rollouts"], m["zeroed_rollouts"], m["dropped_groups"]) == (1.0, 1.0, 1.0)
    assert m["failed_rollouts"] == 2.0 and (m["failed_agent"], m["failed_reward"], m["failed_infra"]) == (
        1,
        1,
        0,
    )
    trained = [r.input for r in settled.rollouts]
    assert sorted(trained) == ["ok", "ok", "once-agent", "once-agent", "once-infra", "once-infra"]
    assert all(r.status.value == "succeeded" for r in settled.rollouts if r.input == "once-infra")
    assert [r.group_id for r in settled.rollouts if r.input == "once-infra"] == ["g-once-infra"] * 2
    (zeroed,) = settled.zeroed
    batch = build_batch(settled.rollouts, settled.spans, GRPOConfig(model_path="m"), settled.zeroed)
    assert batch.metrics["reward_mean"] == pytest.approx(5 / 6)  # the agent's failure trains as 0
    by_reason = {(row["reason"], row["class"]): row for row in rows}
    assert set(by_reason) == {("resampled", "infra"), ("failed", "reward"), ("dropped with its group", None)}
    resampled = by_reason[("resampled", "infra")]
    assert resampled["error"].startswith("APIConnectionError: Connection error")
    assert (resampled["task_index"], resampled["attempts"], resampled["step"]) == (0, 1, 3)
    reward = by_reason[("failed", "reward")]
    assert reward["error"] == "RewardError: the reward function failed" and reward["task_index"] == 2
    healthy = by_reason[("dropped with its group", None)]
    assert healthy["group_class"] == "reward" and healthy["succeeded"] and healthy["error"] is None
    assert zeroed not in {row["rollout_id"] for row in rows}


async def test_drop_group_and_train_survivors_per_class(tmp_path: Path) -> None:
    groups = [_group("once-infra", 3), _group("once-agent", 3), _group("once-agent-2", 2)]
    settled, rows, _ = await _settle(groups, tmp_path, infra="drop_group", agent="train_survivors")
    trained = sorted(r.input for r in settled.rollouts)
    assert trained == ["once-agent", "once-agent"]  # 2 survivors of 3 train; 1 of 2 is too few
    assert all(r.status.value == "succeeded" for r in settled.rollouts) and not settled.zeroed
    assert settled.metrics["dropped_groups"] == 2.0 and settled.metrics["resampled_rollouts"] == 0.0
    reasons = sorted((row["task_index"], row["reason"], row["class"]) for row in rows)
    assert reasons == [
        (0, "dropped with its group", None),
        (0, "dropped with its group", None),
        (0, "failed", "infra"),
        (1, "failed", "agent"),
        (2, "failed", "agent"),
        (2, "fewer than 2 survivors", None),
    ]


async def test_a_resample_that_keeps_failing_drops_its_group(tmp_path: Path) -> None:
    settled, rows, _ = await _settle([_group("infra", 2), _group("ok", 2)], tmp_path, max_resamples=1)
    assert [r.input for r in settled.rollouts] == ["ok", "ok"]
    assert settled.metrics["resampled_rollouts"] == 2.0 and settled.metrics["failed_infra"] == 2.0
    assert sorted(row["reason"] for row in rows) == ["failed", "failed", "resampled", "resampled"]


async def test_a_rollout_unfinished_in_time_is_cancelled_and_resampled(tmp_path: Path) -> None:
    settled, rows, store = await _settle([_group("once-hang", 2)], tmp_path)
    assert [r.status.value for r in settled.rollouts] == ["succeeded", "succeeded"]
    (row,) = rows
    assert (row["class"], row["reason"]) == ("infra", "resampled")
    assert row["error"].startswith("rollout not finished in time")
    assert (await store.get_rollout(row["rollout_id"])).status.value == "cancelled"


@agl.rollout
async def model_agent(task: str, llm: agl.LLM) -> float:
    """Calls the tiny model through the gateway, then fails as its task says: ``once-infra`` finds the
    gateway down on its first rollout, ``once-agent`` / ``agent`` raise after the call, ``once-reward``
    has a reward function that raises. Every other rollout scores 1."""
    fault = task.split("-")[1] if task.startswith("once-") and task not in _SEEN else task
    _SEEN.add(task)
    client = openai.AsyncOpenAI(
        base_url=DEAD if fault == "infra" else llm.endpoint, api_key="k", max_retries=0
    )
    try:
        await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=4
        )
    finally:
        await client.close()
    return await faulty_agent.fn(fault if fault in ("agent", "reward") else "ok")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_grpo_step_on_the_tiny_model_handles_each_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=1,
        tasks_per_step=3,
        group_size=2,
        lr=1e-3,
        eval_every=1,
        export_model=False,
        stop_on_all_failed=False,
    )
    trainer = agl.Trainer(algorithm=agl.GRPO(config), n_runners=4, output_dir=str(tmp_path))
    result = trainer.fit(model_agent, ["once-infra", "once-agent", "once-reward"], ["ok", "agent"])
    (row,) = result["history"]
    # infra: resampled into its group (both then score 1: a flat group); agent: its failure trains as 0
    # beside the member that scored 1; reward: the whole group is dropped
    assert (row["resampled_rollouts"], row["zeroed_rollouts"], row["dropped_groups"]) == (1.0, 1.0, 1.0)
    assert (row["failed_agent"], row["failed_reward"], row["failed_infra"]) == (1.0, 1.0, 0.0)
    assert (row["groups"], row["zero_variance_groups"], row["samples"]) == (2.0, 1.0, 2.0)
    assert "loss" in row  # the step trained
    # validation: the score is over the rollout that yielded a reward; the agent's failure is apart
    assert result["val_reward_before"] == 1.0 and result["val_reward_after"] == 1.0
    assert result["val_failures_before"] == {"agent": 1} and result["val_failures_after"] == {"agent": 1}
    assert row["val_failed_agent"] == 1.0 and row["val_rollouts"] == 2.0
    rows = [json.loads(line) for line in (tmp_path / DROPPED_FILE).read_text().splitlines()]
    train = sorted((r["reason"], r["class"], r["task_index"]) for r in rows if r["mode"] == "train")
    assert train == [("dropped with its group", None, 2), ("failed", "reward", 2), ("resampled", "infra", 0)]
    val = sorted((r["step"], r["class"], r["task_index"]) for r in rows if r["mode"] == "val")
    assert val == [(0, "agent", 1), (1, "agent", 1)]
    assert all(r["attempts"] == 1 and r["error"] for r in rows if r["class"])
    err = capsys.readouterr().err
    assert "val_failed=1/2 (agent 1)" in err
