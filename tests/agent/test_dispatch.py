"""LitAgent picks the method for a rollout's mode through the whole class hierarchy, sync and async."""

from __future__ import annotations

from typing import Any

import pytest

import agl
from agl.schemas import RolloutCreate
from agl.store import InMemoryLightningStore


class Base(agl.LitAgent):
    def rollout(self, task: Any, resources: dict[str, Any], rollout: agl.Rollout) -> float:
        return 0.0

    def training_rollout(self, task: Any, resources: dict[str, Any], rollout: agl.Rollout) -> float:
        return 1.0


class Child(Base):
    """Inherits training_rollout from Base, adds validation_rollout."""

    def validation_rollout(self, task: Any, resources: dict[str, Any], rollout: agl.Rollout) -> float:
        return 2.0


class GrandChild(Child):
    """Two levels below the class that defines both mode methods; overrides nothing."""


class AsyncBase(agl.LitAgent):
    async def rollout(self, task: Any, resources: dict[str, Any], rollout: agl.Rollout) -> float:
        return 10.0

    async def training_rollout(self, task: Any, resources: dict[str, Any], rollout: agl.Rollout) -> float:
        return 11.0


class AsyncMiddle(AsyncBase):
    async def validation_rollout(self, task: Any, resources: dict[str, Any], rollout: agl.Rollout) -> float:
        return 12.0


class AsyncLeaf(AsyncMiddle):
    async def rollout(self, task: Any, resources: dict[str, Any], rollout: agl.Rollout) -> float:
        return 13.0  # overriding rollout must not shadow the inherited mode methods


class RolloutOnly(agl.LitAgent):
    def rollout(self, task: Any, resources: dict[str, Any], rollout: agl.Rollout) -> float:
        return 5.0


class RolloutOnlyChild(RolloutOnly):
    pass


async def _rewards(agent: agl.LitAgent) -> dict[str, float | None]:
    store = InMemoryLightningStore()
    rollouts = await store.enqueue_rollouts(
        [RolloutCreate(input="t", mode=mode) for mode in ("train", "val", "test")]
    )
    runner = agl.Runner(agent, store, poll_interval_s=0.01, handle_signals=False)
    outcomes = {o.rollout_id: o for o in await runner.run(max_rollouts=3)}
    runner.close()
    await store.aclose()
    for outcome in outcomes.values():
        assert outcome.error is None, outcome.error
    return {r.mode: outcomes[r.rollout_id].reward for r in rollouts}


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        (Base(), {"train": 1.0, "val": 0.0, "test": 0.0}),
        (Child(), {"train": 1.0, "val": 2.0, "test": 0.0}),
        (GrandChild(), {"train": 1.0, "val": 2.0, "test": 0.0}),
        (AsyncMiddle(), {"train": 11.0, "val": 12.0, "test": 10.0}),
        (AsyncLeaf(), {"train": 11.0, "val": 12.0, "test": 13.0}),
        (RolloutOnlyChild(), {"train": 5.0, "val": 5.0, "test": 5.0}),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, agl.LitAgent) else "",
)
async def test_mode_methods_are_found_through_inheritance(
    agent: agl.LitAgent, expected: dict[str, float]
) -> None:
    assert await _rewards(agent) == expected


async def test_an_agent_without_rollout_fails_the_attempt_with_a_clear_error() -> None:
    store = InMemoryLightningStore()
    await store.enqueue_rollouts([RolloutCreate(input="t", mode="val")])
    runner = agl.Runner(agl.LitAgent(), store, poll_interval_s=0.01, handle_signals=False)
    [outcome] = await runner.run(max_rollouts=1)
    runner.close()
    assert outcome.error is not None and "must implement rollout" in outcome.error
