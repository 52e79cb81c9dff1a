"""Trainer.dev: a readable debug run of an agent on a few tasks."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

import agl
from agl.agent.base import LitAgent
from agl.errors import ConfigError
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
    assert "error (agent) ValueError: three is unlucky" in text and outcomes[2].failure_class == "agent"


def test_trainer_dev_is_synchronous() -> None:
    agent: LitAgent = agl.rollout(lambda task: 1.0)
    outcomes = agl.Trainer(n_runners=2).dev(agent, ["a", "b"])
    assert [o.reward for o in outcomes] == [1.0, 1.0]


@agl.rollout
async def chatty_agent(task: str, llm: agl.LLM) -> None:
    """Calls the model, rewards the rollout, then judges the call: training reads 1.0, not the -5."""
    import openai

    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "none", max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=3
    )
    await client.close()
    agl.emit_reward(1.0)
    agl.emit_reward(-5, response_id=reply.id)


@pytest.mark.slow  # serves the tiny model
def test_dev_serves_a_model_shows_its_calls_and_the_training_reward(
    capsys: pytest.CaptureFixture[str],
) -> None:
    outcomes = agl.Trainer(n_runners=1).dev(chatty_agent, ["hello"], model="tiny")
    assert [o.status.value for o in outcomes] == ["succeeded"], outcomes[0].error
    assert outcomes[0].reward == 1.0  # the rollout's final reward, as the adapter computes it
    text = capsys.readouterr().out
    assert "1.000" in text and "-5.000" not in text  # the table's reward column
    assert "llm tiny:" in text  # the instrumented model call is in the span tree


def test_dev_without_the_resource_the_agent_wants_names_devs_own_arguments() -> None:
    with pytest.raises(ConfigError, match=r"'llm' wants an agl.LLM and Trainer.dev got none.*model='tiny'"):
        agl.Trainer().dev(chatty_agent, ["hello"])
    with pytest.raises(ConfigError, match="pass one of them"):
        agl.Trainer().dev(
            chatty_agent, ["x"], {"llm": agl.LLM(endpoint="http://127.0.0.1:9/v1", model="m")}, model="tiny"
        )
