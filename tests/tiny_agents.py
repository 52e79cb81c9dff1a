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
