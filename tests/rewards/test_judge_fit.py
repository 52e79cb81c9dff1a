"""One GRPO step through ``Trainer.fit`` on the tiny model with an agent that returns no reward and a judge
(a scripted OpenAI-compatible server on loopback): the judge's scores are the rewards trained on, the
group it fails on leaves the step (not a reward of 0), and validation is judged rollout by rollout."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import openai
import pytest

import agl
from agl import semconv as sc
from agl.adapter import final_reward
from agl.algorithm.base import rollout_spans
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.algorithm.policy import Policy
from agl.models import tiny_model
from agl.rewards import Judge
from agl.schemas import RolloutStatus
from agl.store import SqliteLightningStore
from tests.support.openai_upstream import OpenAIUpstream

pytestmark = pytest.mark.slow


@agl.rollout
async def unlabelled_agent(task: str, llm: agl.LLM) -> None:
    """One short completion and no reward: only a judge can say how good it was."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    try:
        await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=4
        )
    finally:
        await client.close()


def scores(*values: float) -> str:
    return json.dumps({"scores": [{"score": v, "reason": f"looks {v}"} for v in values]})


@pytest.mark.timeout(240)
def test_one_step_trains_on_the_judges_scores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trained: list[Any] = []
    step = Policy.step

    def recording_step(self: Policy, samples: Any, advantages: Any, index: Any) -> Any:
        trained.append((list(samples), list(advantages)))
        return step(self, samples, advantages, index)

    monkeypatch.setattr(Policy, "step", recording_step)
    with OpenAIUpstream(model="judge") as up:
        # the baseline validation (one rollout, judged alone); the step's two groups, judged at once: the
        # first call gets the scores, the other group's two tries are malformed; the last validation
        up.script(scores(0.5), scores(0.9, 0.1), "no json", "[]", scores(0.7))
        judge = Judge(up.base_url, "Short, polite replies score high.", model="judge", max_tries=2)
        config = GRPOConfig(
            model_path=str(tiny_model()),
            steps=1,
            group_size=2,
            tasks_per_step=2,
            lr=1e-3,
            eval_every=1,
            export_model=False,
            judge=judge,
        )
        store_url = f"sqlite:///{tmp_path / 'store.db'}"
        result = agl.Trainer(
            algorithm=GRPO(config), store=store_url, n_runners=4, output_dir=str(tmp_path)
        ).fit(unlabelled_agent, ["hello", "thanks"], ["bye"])
        assert len(up.requests) == 5
    (row,) = result["history"]
    assert (row["judged_groups"], row["judge_failures"]) == (2, 1)
    # the step ran 4 rollouts; the judged group trained its 2, the group the judge failed on none: its two
    # rollouts are reward failures, counted and written to dropped.jsonl, never a reward of 0
    assert row["rollouts"] == 4 and row["samples"] == 2
    assert row["failed_rollouts"] == row["failed_reward"] == row["dropped_rollouts"] == 2
    dropped = [json.loads(line) for line in (tmp_path / "dropped.jsonl").read_text().splitlines()]
    assert [(d["class"], d["reason"], d["step"]) for d in dropped] == [
        ("reward", "the judge gave no score", 1)
    ] * 2
    assert all(
        d["error"].startswith("JudgeError: the judge gave no usable scores in 2 tries") for d in dropped
    )
    assert row["reward_mean"] == pytest.approx(0.5) and row["reward_max"] == 0.9
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0
    assert (result["val_reward_before"], result["val_reward_after"]) == (0.5, 0.7)
    ((samples, advantages),) = trained
    assert sorted(s.reward for s in samples) == [0.1, 0.9]  # the judge's scores, nothing of the failed group
    assert sorted(advantages) == pytest.approx([-1.0, 1.0], abs=1e-3)
    assert all(s.group_id == samples[0].group_id for s in samples)

    async def stored() -> None:
        async with SqliteLightningStore(str(tmp_path / "store.db")) as store:
            rollouts = (await store.query_rollouts(mode="train")).items
            assert len(rollouts) == 4 and all(r.status == RolloutStatus.SUCCEEDED for r in rollouts)
            rewards: dict[str, list[float | None]] = {}
            by_rollout: dict[str, float | None] = {}
            for r in rollouts:
                spans = await rollout_spans(store, r.rollout_id)
                assert any(s.name == sc.SPAN_JUDGE for s in spans)
                by_rollout[r.rollout_id] = final_reward(spans)
                rewards.setdefault(r.group_id or "", []).append(by_rollout[r.rollout_id])
            scored = [sorted(v) for v in rewards.values() if None not in v]  # type: ignore[type-var]
            assert scored == [[0.1, 0.9]] and [v for v in rewards.values() if None in v] == [[None, None]]
            assert all(by_rollout[s.rollout_id] == s.reward for s in samples)  # each sample's judged reward

    asyncio.run(stored())
