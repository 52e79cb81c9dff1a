"""``GRPOConfig(refill=True)``: groups whose rewards tie are set aside and more tasks drawn until the step
holds ``tasks_per_step`` groups with signal, within a cap of extra rollouts (real runner and store)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest

import agl
from agl.algorithm.base import TrainingContext
from agl.algorithm.grpo import GRPOConfig
from agl.algorithm.grpo.async_loop import VersionLog
from agl.algorithm.grpo.failures import DROPPED_FILE
from agl.algorithm.grpo.refill import Round, StepRollouts, signal_groups
from agl.errors import ConfigError
from agl.models import tiny_model
from agl.store import SqliteLightningStore

_CALLS: Counter[str] = Counter()


@agl.rollout
async def task_agent(task: str) -> float:
    """``one-*`` always scores 1 (its groups tie); ``varies-*`` alternates 0 and 1 per call of the task,
    so a group of two differs; ``broken-*`` has a reward function that fails."""
    if task.startswith("broken"):
        raise agl.RewardError("no gold answer")
    if task.startswith("one"):
        return 1.0
    _CALLS[task] += 1
    return float(_CALLS[task] % 2)


@pytest.fixture(autouse=True)
def _fresh() -> None:
    _CALLS.clear()


ONES = [f"one-{i}" for i in range(4)]
VARIES = [f"varies-{i}" for i in range(4)]


async def _step(
    tmp_path: Path, train: list[str], first: list[str], **options: Any
) -> tuple[Round, Round, list[tuple[int, str]]]:
    """Step 1's first draw (``first``, as the pipeline would enqueue it) settled, then refilled; with each
    refill rollout's (round, task) in enqueue order."""
    store = SqliteLightningStore(str(tmp_path / "store.db"))
    runner = agl.Runner(
        task_agent, store, max_concurrency=1, poll_interval_s=0.01
    )  # one at a time: fixed order
    running = asyncio.create_task(runner.run())
    ctx = TrainingContext(store, output_dir=str(tmp_path))
    config = GRPOConfig(model_path="m", tasks_per_step=2, group_size=2, refill=True, **options)
    rollouts = StepRollouts(ctx, config, train, VersionLog("v0"), 0, tmp_path)
    try:
        pending = await ctx.start_rollouts(first, group_size=2, metadata={"step": 1})
        done = await pending.collect(10.0)
        drawn = await rollouts.settle(
            [r for r, _ in done], {r.rollout_id: s for r, s in done}, step=1, enqueued_version=0
        )
        refilled = await rollouts.refill(drawn, step=1, resources_id=None)
        extra = (await store.query_rollouts()).items
    finally:
        runner.stop()
        await running
        await store.aclose()
    order = [(r.metadata["refill_round"], r.input) for r in extra if "refill_round" in r.metadata]
    return drawn, refilled, order


async def test_a_step_whose_groups_all_tie_draws_more_until_it_has_signal(tmp_path: Path) -> None:
    drawn, refilled, order = await _step(tmp_path, ONES + VARIES, ["one-0", "one-1"])
    assert signal_groups(drawn, refilled_config()) == []  # the first draw trains nothing
    m = refilled.metrics
    # one round of 4 tasks (2 wanted / 1 share of signal so far, capped by 2 x 2 x 2 extra rollouts)
    assert (m["refill_rounds"], m["refill_rollouts"], m["groups_with_signal"]) == (1.0, 8.0, 2.0)
    assert m["rollouts"] == 12.0 and m["failed_rollouts"] == 0.0
    assert {t for _, t in order} <= set(ONES[2:] + VARIES) and len(order) == 8
    assert not {t for _, t in order} & {"one-0", "one-1"}  # a task drawn at this step is not drawn again
    assert len(signal_groups(refilled, refilled_config())) == 2  # surplus groups with signal left out
    trained = Counter(r.input for r in refilled.rollouts)
    assert all(n == 2 for n in trained.values())


def refilled_config() -> GRPOConfig:
    return GRPOConfig(model_path="m", tasks_per_step=2, group_size=2, refill=True)


async def test_the_cap_on_extra_rollouts_is_honoured_and_reported(tmp_path: Path) -> None:
    _, capped, order = await _step(tmp_path, ONES, ONES[:2], refill_max_rollouts=3)
    m = capped.metrics
    assert (m["refill_rounds"], m["refill_rollouts"], m["groups_with_signal"]) == (1.0, 2.0, 0.0)
    assert len(order) == 2  # 3 // group_size: one more task, then the cap
    _, exhausted, _ = await _step(tmp_path / "b", ONES[:3], ONES[:2])
    assert (exhausted.metrics["refill_rounds"], exhausted.metrics["refill_rollouts"]) == (1.0, 2.0)
    _, off, _ = await _step(tmp_path / "c", ONES + VARIES, ONES[:2], refill_max_rollouts=0)
    assert (off.metrics["refill_rounds"], off.metrics["refill_rollouts"]) == (0.0, 0.0)


async def test_refill_rollouts_are_settled_like_the_first_draw(tmp_path: Path) -> None:
    train = ["one-0", "one-1", "broken-0", "broken-1", "broken-2", "varies-0"]
    _, refilled, order = await _step(tmp_path, train, ["one-0", "one-1"])
    m = refilled.metrics
    assert m["refill_rollouts"] == 8.0 and m["failed_reward"] == 6.0 and m["dropped_groups"] == 3.0
    assert m["groups_with_signal"] == 1.0  # only varies-0 has signal; every task was drawn
    assert {t for _, t in order} == {"broken-0", "broken-1", "broken-2", "varies-0"}
    rows = [json.loads(line) for line in (tmp_path / DROPPED_FILE).read_text().splitlines()]
    assert {(r["step"], r["class"], r["task_index"]) for r in rows if r["class"]} == {
        (1, "reward", 2),
        (1, "reward", 3),
        (1, "reward", 4),
    }


async def test_the_same_seed_draws_the_same_refill_tasks(tmp_path: Path) -> None:
    tasks = ONES + VARIES
    _, _, first = await _step(tmp_path / "a", tasks, ONES[:2])
    _, _, again = await _step(tmp_path / "b", tasks, ONES[:2])
    _, _, other = await _step(tmp_path / "c", tasks, ONES[:2], seed=7)
    assert first == again
    assert first != other


def test_refill_config_errors() -> None:
    with pytest.raises(ConfigError, match="refill=True.*set async_rollouts=False or refill=False"):
        GRPOConfig(model_path="m", refill=True, async_rollouts=True)
    with pytest.raises(ConfigError, match="baseline='batch' compares the whole batch"):
        GRPOConfig(model_path="m", refill=True, baseline="batch", scale_by_std="none")
    with pytest.raises(ConfigError, match="refill_max_rollouts must be None or an int >= 0, got -1"):
        GRPOConfig(model_path="m", refill=True, refill_max_rollouts=-1)
    assert not GRPOConfig(model_path="m").refill  # off by default


@agl.rollout
async def flat_or_varied_agent(task: str, llm: agl.LLM) -> float:
    """One call to the tiny model; ``flat-*`` tasks score 1 whatever it says, the others score the
    share of distinct characters in its reply (which differs between samples)."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=6
        )
    finally:
        await client.close()
    return 1.0 if task.startswith("flat") else len(set(reply.choices[0].message.content or "")) / 16


def _fit(out: Path) -> dict[str, Any]:
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=2,
        tasks_per_step=2,
        group_size=2,
        lr=1e-3,
        eval_every=0,
        export_model=False,
        refill=True,
    )
    train = ["vary-a", "vary-b", "vary-c", "flat-a", "flat-b", "flat-c"]  # seed 0 draws flat-a, flat-c first
    result: dict[str, Any] = agl.Trainer(algorithm=agl.GRPO(config), n_runners=4, output_dir=str(out)).fit(
        flat_or_varied_agent, train, ["flat-a"]
    )
    return result


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_fit_steps_refill_their_tied_groups_and_a_seed_reproduces_them(tmp_path: Path) -> None:
    first = _fit(tmp_path / "a")
    row = first["history"][0]
    assert row["refill_rounds"] == 1.0 and row["refill_rollouts"] == 8.0  # all 4 undrawn tasks, one round
    assert row["groups_with_signal"] == 2.0 and row["zero_variance_groups"] == 3.0  # flat-a, -b, -c
    assert row["rollouts"] == 12.0 and row["samples"] == 4.0 and "loss" in row  # two groups trained
    keys = ("reward_mean", "reward_std", "refill_rollouts", "refill_rounds", "groups_with_signal", "samples")
    again = _fit(tmp_path / "b")
    assert [[r[k] for k in keys] for r in first["history"]] == [
        [r[k] for k in keys] for r in again["history"]
    ]
