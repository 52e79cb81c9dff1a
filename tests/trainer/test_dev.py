"""Trainer.dev: a readable debug run of an agent on a few tasks."""

from __future__ import annotations

import io

from rich.console import Console

import agl
from agl.agent.base import LitAgent
from agl.schemas import PromptTemplate
from agl.trainer.dev import run_dev


async def test_dev_prints_rollouts_rewards_and_spans() -> None:
    @agl.rollout
    def agent(task: int, prompt: PromptTemplate) -> float:
        agl.emit_message(prompt.format(n=task))
        if task == 3:
            raise ValueError("three is unlucky")
        return task / 2

    out = io.StringIO()
    outcomes = await run_dev(
        agent,
        [1, 2, 3],
        {"prompt": PromptTemplate(template="task {n}")},
        console=Console(file=out, width=140),
    )
    text = out.getvalue()
    assert [o.reward for o in outcomes[:2]] == [0.5, 1.0] and outcomes[2].status.value == "failed"
    assert "task 1" in text and "reward 0.5" in text and "three is unlucky" in text and "succeeded" in text


def test_trainer_dev_is_synchronous() -> None:
    agent: LitAgent = agl.rollout(lambda task: 1.0)
    outcomes = agl.Trainer(n_runners=2).dev(agent, ["a", "b"])
    assert [o.reward for o in outcomes] == [1.0, 1.0]
