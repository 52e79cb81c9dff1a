"""The Runner: isolation under concurrency, failures, timeouts, heartbeats, cancellation, shutdown, hooks."""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import agl
from agl import semconv as sc
from agl.schemas import (
    LLM,
    AttemptStatus,
    PromptTemplate,
    RetryConfig,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Span,
)
from agl.store import InMemoryLightningStore, LightningStore, SqliteLightningStore
from tests.store.conftest import FakeClock
from tests.support.waiting import until


async def _run(agent: Any, store: LightningStore, n: int, **kwargs: Any) -> list[Any]:
    runner = agl.Runner(agent, store, poll_interval_s=0.01, **kwargs)
    return await runner.run(max_rollouts=n)


async def _spans(store: LightningStore, rollout_id: str) -> list[Span]:
    return (await store.query_spans(rollout_id=rollout_id)).items


async def test_100_concurrent_rollouts_keep_their_spans_apart() -> None:
    store = InMemoryLightningStore()

    @agl.rollout
    async def agent(task: dict[str, int]) -> float:
        for step in range(3):
            await asyncio.sleep(random.random() / 100)
            agl.emit_object({"task": task["i"], "step": step})
        return float(task["i"])

    created = await store.enqueue_rollouts([RolloutCreate(input={"i": i}) for i in range(100)])
    outcomes = await _run(agent, store, 100, max_concurrency=100)
    assert len(outcomes) == 100 and all(o.status == AttemptStatus.SUCCEEDED for o in outcomes)
    for rollout in created:
        spans = await _spans(store, rollout.rollout_id)
        objects = [s.attributes[sc.OBJECT_VALUE]["task"] for s in spans if s.name == sc.SPAN_OBJECT]
        rewards = [s.attributes[sc.REWARD_VALUE] for s in spans if s.name == sc.SPAN_REWARD]
        assert objects == [rollout.input["i"]] * 3 and rewards == [float(rollout.input["i"])]


async def test_sync_agents_run_on_threads_without_mixing() -> None:
    store = InMemoryLightningStore()

    @agl.rollout
    def agent(task: int) -> None:
        time.sleep(0.01)
        agl.emit_reward(float(task))

    created = await store.enqueue_rollouts([RolloutCreate(input=i) for i in range(20)])
    outcomes = await _run(agent, store, 20, max_concurrency=8)
    assert {o.reward for o in outcomes} == {float(i) for i in range(20)}
    for rollout in created:
        (reward,) = await _spans(store, rollout.rollout_id)
        assert reward.attributes[sc.REWARD_VALUE] == float(rollout.input)


async def test_resources_are_injected_by_name_and_type() -> None:
    store = InMemoryLightningStore()
    await store.add_resources(
        {
            "main": LLM(endpoint="http://gw/rollout/{rollout_id}/attempt/{attempt_id}/v1", model="m"),
            "system": PromptTemplate(template="Be {tone}."),
        }
    )
    seen: dict[str, Any] = {}

    @agl.rollout
    def agent(task: str, llm: LLM, prompt: PromptTemplate, rollout: Rollout, system: PromptTemplate) -> None:
        seen.update(task=task, endpoint=llm.endpoint, prompt=prompt.format(tone=task), rid=rollout.rollout_id)
        assert system is prompt

    (created,) = await store.enqueue_rollouts([RolloutCreate(input="kind")])
    (outcome,) = await _run(agent, store, 1)
    assert outcome.status == AttemptStatus.SUCCEEDED
    assert seen["prompt"] == "Be kind." and seen["rid"] == created.rollout_id
    assert seen["endpoint"] == f"http://gw/rollout/{created.rollout_id}/attempt/{outcome.attempt_id}/v1"


async def test_missing_resource_fails_with_a_clear_error() -> None:
    store = InMemoryLightningStore()

    @agl.rollout
    def agent(task: str, llm: LLM) -> None:
        pass

    await store.enqueue_rollout("x")
    (outcome,) = await _run(agent, store, 1)
    assert outcome.status == AttemptStatus.FAILED and "LLM resource" in (outcome.error or "")


async def test_agent_error_records_exception_and_fails_attempt() -> None:
    store = InMemoryLightningStore()

    @agl.rollout
    async def agent(task: str) -> None:
        raise KeyError("missing tool")

    rollout = await store.enqueue_rollout("x")
    (outcome,) = await _run(agent, store, 1)
    assert outcome.status == AttemptStatus.FAILED and "missing tool" in (outcome.error or "")
    (span,) = await _spans(store, rollout.rollout_id)
    assert span.name == sc.SPAN_EXCEPTION and span.attributes[sc.EXCEPTION_TYPE] == "KeyError"
    assert (await store.get_rollout(rollout.rollout_id)).status == RolloutStatus.FAILED


async def test_timeout_cancels_agent_and_retries() -> None:
    store = InMemoryLightningStore()
    calls = []

    @agl.rollout
    async def agent(task: str, rollout: Rollout) -> float:
        calls.append(rollout.num_attempts)
        if len(calls) == 1:
            await asyncio.sleep(30)
        return 1.0

    rollout = await store.enqueue_rollout("x", retry=RetryConfig(max_attempts=2, timeout_s=0.2))
    started = time.monotonic()
    outcomes = await _run(agent, store, 2)
    assert time.monotonic() - started < 10
    assert [o.status for o in outcomes] == [AttemptStatus.TIMEOUT, AttemptStatus.SUCCEEDED]
    assert (await store.get_rollout(rollout.rollout_id)).status == RolloutStatus.SUCCEEDED


async def test_heartbeats_keep_a_long_attempt_alive() -> None:
    """On the store's own clock the attempt runs 1.5 s against a 0.4 s heartbeat timeout; the watchdog
    passes between steps find it alive only because each step waits for a heartbeat that lands after it."""
    clock = FakeClock()
    store = InMemoryLightningStore(clock=clock, watchdog_interval_s=0)  # the agent runs the watchdog

    async def heartbeat_since(rollout_id: str, moment: float) -> bool:
        (attempt,) = (await store.query_attempts(rollout_id=rollout_id)).items
        return attempt.last_heartbeat_at is not None and attempt.last_heartbeat_at >= moment

    @agl.rollout
    async def agent(task: str, rollout: Rollout) -> float:
        for _ in range(5):
            clock.advance(0.3)
            await until(functools.partial(heartbeat_since, rollout.rollout_id, clock()), "a heartbeat")
            assert await store.run_watchdog() == []
        return 1.0

    rollout = await store.enqueue_rollout("x", retry=RetryConfig(heartbeat_timeout_s=0.4))
    (outcome,) = await _run(agent, store, 1, heartbeat_interval_s=0.05)
    assert outcome.status == AttemptStatus.SUCCEEDED
    assert (await store.get_rollout(rollout.rollout_id)).status == RolloutStatus.SUCCEEDED
    await store.aclose()


async def test_cancelling_the_rollout_stops_the_agent() -> None:
    store = InMemoryLightningStore()
    started = asyncio.Event()

    @agl.rollout
    async def agent(task: str) -> float:
        started.set()
        await asyncio.sleep(30)
        return 1.0

    rollout = await store.enqueue_rollout("x")
    run = asyncio.create_task(_run(agent, store, 1, heartbeat_interval_s=0.05))
    await started.wait()
    await store.cancel_rollout(rollout.rollout_id)
    (outcome,) = await asyncio.wait_for(run, 10)
    assert outcome.status == AttemptStatus.FAILED
    assert (await store.get_rollout(rollout.rollout_id)).status == RolloutStatus.CANCELLED


async def test_returned_spans_and_bad_return_values() -> None:
    store = InMemoryLightningStore()

    @agl.rollout
    def agent(task: str, rollout: Rollout) -> Any:
        if task == "bad":
            return "not a reward"
        return [Span.new("ignored", "ignored", "custom", {"k": 1})]

    good = await store.enqueue_rollout("good")
    await store.enqueue_rollout("bad")
    outcomes = await _run(agent, store, 2)
    assert [o.status for o in outcomes] == [AttemptStatus.SUCCEEDED, AttemptStatus.FAILED]
    assert "list of spans" in (outcomes[1].error or "")
    (custom,) = await _spans(store, good.rollout_id)
    assert custom.name == "custom" and custom.rollout_id == good.rollout_id


async def test_hooks_run_in_order() -> None:
    store = InMemoryLightningStore()
    order: list[str] = []

    async def async_hook(*args: Any) -> None:
        order.append("trace_end")

    hooks = agl.runner.RunnerHooks(
        on_rollout_start=lambda ctx: order.append("rollout_start"),
        on_trace_start=lambda ctx: order.append("trace_start"),
        on_trace_end=async_hook,
        on_rollout_end=lambda ctx, outcome: order.append(f"rollout_end:{outcome.status.value}"),
    )

    @agl.rollout
    def agent(task: str) -> float:
        order.append("agent")
        return 1.0

    await store.enqueue_rollout("x")
    await _run(agent, store, 1, hooks=hooks)
    assert order == ["rollout_start", "trace_start", "agent", "trace_end", "rollout_end:succeeded"]


class Solver(agl.LitAgent):
    name = "solver"

    def training_rollout(self, task: Any, resources: Any, rollout: Rollout) -> float:
        return 1.0

    async def validation_rollout(self, task: Any, resources: Any, rollout: Rollout) -> float:
        return 0.25


async def test_lit_agent_dispatches_on_mode_and_tags_spans() -> None:
    store = InMemoryLightningStore()
    train = await store.enqueue_rollout("a", mode="train")
    await store.enqueue_rollout("b", mode="val")
    outcomes = await _run(Solver(), store, 2)
    assert [o.reward for o in outcomes] == [1.0, 0.25]
    (reward,) = await _spans(store, train.rollout_id)
    assert reward.attributes[sc.AGENT_NAME] == "solver"


async def test_step_runs_one_rollout_online() -> None:
    store = InMemoryLightningStore()
    runner = agl.Runner(agl.rollout(lambda task: task * 2.0), store)
    outcome = await runner.step(0.5)
    assert outcome.status == AttemptStatus.SUCCEEDED and outcome.reward == 1.0
    assert (await store.get_rollout(outcome.rollout_id)).status == RolloutStatus.SUCCEEDED


RUNNER_SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    import agl
    from agl.store import SqliteLightningStore

    @agl.rollout
    async def agent(task):
        print("started", flush=True)
        await asyncio.sleep(task)
        return 1.0

    async def main():
        store = SqliteLightningStore(sys.argv[1])
        runner = agl.Runner(agent, store, max_concurrency=2, shutdown_grace_s=float(sys.argv[2]))
        await runner.run()
        await store.aclose()
        print("stopped", flush=True)

    asyncio.run(main())
    """
)


@pytest.mark.parametrize(
    ("grace", "expected"), [(10.0, RolloutStatus.SUCCEEDED), (0.2, RolloutStatus.FAILED)]
)
async def test_sigterm_finishes_or_hands_back_in_flight_attempts(
    tmp_path: Path, grace: float, expected: RolloutStatus
) -> None:
    db = tmp_path / "runner.db"
    store = SqliteLightningStore(db)
    rollout = await store.enqueue_rollout(1.5)
    proc = subprocess.Popen(
        [sys.executable, "-c", RUNNER_SCRIPT, str(db), str(grace)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert proc.stdout is not None
    assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "started"
    proc.send_signal(signal.SIGTERM)
    out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
    assert proc.returncode == 0 and "stopped" in out
    assert (await store.get_rollout(rollout.rollout_id)).status == expected
    await store.aclose()


async def test_step_stores_the_given_resources() -> None:
    store = InMemoryLightningStore()

    @agl.rollout
    def agent(task: str, prompt: PromptTemplate) -> float:
        return float(len(prompt.format(name=task)))

    runner = agl.Runner(agent, store)
    outcome = await runner.step("ab", resources={"prompt": PromptTemplate(template="hi {name}")})
    assert outcome.status == AttemptStatus.SUCCEEDED and outcome.reward == 5.0
    rollout = await store.get_rollout(outcome.rollout_id)
    assert (await store.get_resources(rollout.resources_id)).resources["prompt"].template == "hi {name}"  # type: ignore[arg-type, union-attr]
    with pytest.raises(ValueError, match="not both"):
        await runner.step("x", resources={}, resources_id="r")


class _WatchedStore(InMemoryLightningStore):
    """Notes whether instrumentation was enabled during the runner's store calls; can fail span writes."""

    def __init__(self, failing_writes: int = 0) -> None:
        super().__init__()
        self.enabled: list[tuple[str, bool]] = []
        self.failing_writes = failing_writes
        self.heartbeated = asyncio.Event()

    def _note(self, call: str) -> None:
        from opentelemetry.instrumentation.utils import is_instrumentation_enabled

        self.enabled.append((call, is_instrumentation_enabled()))

    async def add_spans(self, spans: Any) -> list[Span]:
        self._note("add_spans")
        if self.failing_writes:
            self.failing_writes -= 1
            raise agl.errors.StoreUnavailableError("store down for a moment")
        return await super().add_spans(spans)

    async def heartbeat(self, rollout_id: str, attempt_id: str) -> Rollout:
        self._note("heartbeat")
        self.heartbeated.set()
        return await super().heartbeat(rollout_id, attempt_id)

    async def update_attempt(self, *args: Any, **kwargs: Any) -> Any:
        self._note("update_attempt")
        return await super().update_attempt(*args, **kwargs)


async def test_store_calls_run_with_instrumentation_suppressed() -> None:
    store = _WatchedStore()

    @agl.rollout
    async def agent(task: str) -> float:
        from opentelemetry.instrumentation.utils import is_instrumentation_enabled

        assert is_instrumentation_enabled()  # the agent itself stays traced
        await asyncio.wait_for(store.heartbeated.wait(), 30)  # runs until a heartbeat has been sent
        return 1.0

    await store.enqueue_rollout("x")
    (outcome,) = await _run(agent, store, 1, heartbeat_interval_s=0.05)
    assert outcome.status == AttemptStatus.SUCCEEDED
    assert {call for call, _ in store.enabled} == {"add_spans", "heartbeat", "update_attempt"}
    assert not any(enabled for _, enabled in store.enabled)


async def test_span_write_failures_are_retried_counted_and_never_fail_the_agent() -> None:
    store = _WatchedStore(failing_writes=2)
    rollout = await store.enqueue_rollout("x")
    runner = agl.Runner(
        agl.rollout(lambda task: 0.5),
        store,
        poll_interval_s=0.01,
        store_backoff_s=0.01,
        max_store_backoff_s=0.05,
        report_timeout_s=0.3,
    )
    (outcome,) = await runner.run(max_rollouts=1)
    assert outcome.status == AttemptStatus.SUCCEEDED and outcome.spans == 1
    assert runner.stats.span_export_errors == 2 and runner.stats.spans_lost == 0
    (reward,) = await _spans(store, rollout.rollout_id)
    assert reward.attributes[sc.REWARD_VALUE] == 0.5

    store.failing_writes = 1000  # unreachable for longer than report_timeout_s: given up
    await store.enqueue_rollout("y")
    (outcome,) = await runner.run(max_rollouts=1)
    assert outcome.status == AttemptStatus.SUCCEEDED and outcome.spans == 0
    assert runner.stats.spans_lost == 1


@pytest.mark.parametrize("backend", ["memory", "sqlite"])
async def test_an_idle_runner_claims_a_queued_rollout_without_waiting_out_its_back_off(
    backend: str, tmp_path: Path
) -> None:
    """An in-process store signals the runner when a rollout is queued: a runner backed off to a 30 s poll
    still starts it at once."""
    store: LightningStore = (
        InMemoryLightningStore() if backend == "memory" else SqliteLightningStore(str(tmp_path / "s.db"))
    )
    started = asyncio.Event()

    @agl.rollout
    async def agent(task: str) -> float:
        started.set()
        return 1.0

    empty = asyncio.Event()
    dequeue = store.dequeue

    async def watched(worker_id: str) -> Any:
        claimed = await dequeue(worker_id)
        if claimed is None:
            empty.set()
        return claimed

    store.dequeue = watched  # type: ignore[method-assign]
    runner = agl.Runner(agent, store, poll_interval_s=30.0, max_poll_interval_s=30.0)
    running = asyncio.create_task(runner.run(max_rollouts=1))
    await asyncio.wait_for(empty.wait(), 10)  # the runner found nothing and backed off for 30 s
    await store.enqueue_rollout("go")
    await asyncio.wait_for(started.wait(), 10)
    await asyncio.wait_for(running, 10)
