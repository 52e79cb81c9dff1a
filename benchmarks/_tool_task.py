"""The 5-turn tool task of ``grpo_vs_trl.py --task tools``, shared by the agl sides and the TRL side.

Add five numbers with an ``add`` tool, two at a time, then say the total: four tool calls and an answer, five
model calls per rollout. It imports nothing from agl (the TRL side runs in its own venv) and only the standard
library at import time.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

SYSTEM = (
    "You add numbers with the add tool, two numbers a call: the first two, then the running total and the "
    "next number. When every number is added, reply with the total only."
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of a and b.
    """
    return int(a) + int(b)


def tool_schema() -> dict[str, Any]:
    """``add`` as an OpenAI tool, exactly as TRL describes it to the template (transformers' schema)."""
    from transformers.utils.chat_template_utils import get_json_schema

    return dict(get_json_schema(add))


def make_pool(n: int, seed: int, numbers: int = 5) -> list[dict[str, Any]]:
    """``n`` tasks: a system and a user message, the total as the answer, and the numbers."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        values = [rng.randrange(1, 20) for _ in range(numbers)]
        listed = ", ".join(str(v) for v in values)
        prompt = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"Add {listed}."},
        ]
        tasks.append({"id": f"t{i}", "prompt": prompt, "answer": str(sum(values)), "numbers": values})
    return tasks


def trace(task: dict[str, Any]) -> list[dict[str, Any]]:
    """A correct conversation for ``task`` in OpenAI chat format: the warm start's training data."""
    values = task["numbers"]
    messages = list(task["prompt"])
    total = values[0]
    for i, value in enumerate(values[1:]):
        call_id = f"call-{i}"
        arguments = json.dumps({"a": total, "b": value})
        call = {"id": call_id, "type": "function", "function": {"name": "add", "arguments": arguments}}
        total = add(total, value)
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": call_id, "name": "add", "content": str(total)})
    messages.append({"role": "assistant", "content": str(total)})
    return messages


def numbers_in(text: str) -> list[str]:
    """The integers written in ``text``, as the rewards read a reply."""
    return re.findall(r"-?\d+", text)


def call_tool(name: str, arguments: str | dict[str, Any]) -> str:
    """Run one tool call as TRL does (an unknown tool or bad arguments become an error result)."""
    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
        if name != "add":
            raise ValueError(f"Tool {name} not found.")
        return str(add(**args))
    except Exception as exc:  # the model's arguments, not the benchmark, are at fault: tell the model
        return str({"error": str(exc)})


async def converse(
    client: Any, model: str, task: dict[str, Any], *, turns: int, max_tokens: int, **sampling: Any
) -> tuple[str, int]:
    """Up to ``turns`` model calls of ``client`` (an ``openai.AsyncOpenAI``) on ``task``, running each reply's
    tool calls and stopping at a reply without any. Returns the last reply's text and the tokens counted as
    TRL counts them: the first prompt and every generated token (tool results left out)."""
    messages: list[dict[str, Any]] = list(task["prompt"])
    answer, tokens = "", 0
    for _ in range(turns):
        reply = await client.chat.completions.create(
            model=model, messages=messages, tools=[tool_schema()], max_tokens=max_tokens, **sampling
        )
        if reply.usage:
            tokens += reply.usage.completion_tokens + (reply.usage.prompt_tokens if not tokens else 0)
        message = reply.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            result = call_tool(call.function.name, call.function.arguments)
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result}
            )
    return answer, tokens
