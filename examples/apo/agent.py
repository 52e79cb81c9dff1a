"""A tool-using price agent, written with the plain openai SDK; its system prompt is the resource APO tunes."""

from __future__ import annotations

import json
from typing import Any, cast

import openai
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

import agl
from examples.apo.simulated_lm import CATALOG_CENTS, LOOKUP_TOOL, grade


@agl.rollout(name="price-agent")
async def price_agent(task: dict[str, Any], llm: agl.LLM, prompt: agl.PromptTemplate) -> float:
    """Answer the question, calling ``lookup`` when the model asks; reward 1 for a right, well-formed answer."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "agl", max_retries=1)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": prompt.format(**task)},
        {"role": "user", "content": task["question"]},
    ]
    used_tool = False
    reply = ""
    try:
        for _ in range(3):
            response = await client.chat.completions.create(
                model=llm.model,
                messages=cast("list[ChatCompletionMessageParam]", messages),
                tools=[cast("ChatCompletionToolParam", LOOKUP_TOOL)],
            )
            message = response.choices[0].message
            if not message.tool_calls:
                reply = message.content or ""
                break
            used_tool = True
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                item = json.loads(call.function.arguments).get("item", "")  # type: ignore[union-attr]
                price = CATALOG_CENTS.get(item)
                result = f"{price} cents" if price is not None else f"unknown item {item}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        await client.close()
    reward, feedback = grade(task, reply, used_tool)
    agl.emit_message(feedback)
    return reward
