"""Small agents the training tests share: real openai-SDK calls to the tiny model behind the gateway."""

from __future__ import annotations

import openai

import agl


@agl.rollout
async def digits_agent(task: str, llm: agl.LLM) -> float:
    """Reward: the share of digits in a 4-token reply (a signal a tiny model can learn in a few steps)."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=4
    )
    await client.close()
    return sum(c.isdigit() for c in reply.choices[0].message.content or "") / 4


@agl.rollout
async def keyless_agent(task: str, llm: agl.LLM) -> float:
    """An agent whose every rollout fails before it reaches the model (a bug in the agent's own code)."""
    raise RuntimeError(f"agent bug on task {task!r}")


_SAMPLES: dict[tuple[str, int], int] = {}


@agl.rollout
async def scored_agent(task: dict[str, object], llm: agl.LLM) -> float:
    """Calls the model, then scores by the task, so evaluations are checkable by hand: the n-th run of a task
    gets the n-th of its ``rewards`` (``rewards_tiny`` when the model is named ``tiny``, i.e. an endpoint, not
    fit's ``policy``); ``fail: agent`` / ``fail: reward`` raise a bug in the agent or in its reward."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "k", max_retries=0)
    await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    await client.close()
    if task.get("fail") == "agent":
        raise RuntimeError(f"agent bug on task {task['id']}")
    if task.get("fail") == "reward":
        raise agl.RewardError(f"the reward of task {task['id']} could not be computed")
    rewards = task["rewards_tiny" if llm.model == "tiny" else "rewards"]
    assert isinstance(rewards, list)
    key = (llm.model, int(str(task["id"])))
    n = _SAMPLES.get(key, 0)
    _SAMPLES[key] = n + 1
    return float(rewards[n % len(rewards)])
