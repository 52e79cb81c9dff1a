"""The calc agent: plain openai SDK, a ``calculator`` tool, then a final answer. Reward 1 when it is right."""

from __future__ import annotations

import ast
import json
import operator
import re
from collections.abc import Callable
from typing import Any, cast

import openai
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

import agl

SYSTEM = "Call the calculator with the arithmetic expression, then reply 'Answer: ' and the result."
CALCULATOR: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
    },
}
_OPS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> str:
    """A safe arithmetic evaluator (no names, no calls)."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        value = ev(ast.parse(expression.replace("x", "*").replace("×", "*"), mode="eval"))
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if value == int(value) else f"{value:.4g}"


def final_number(text: str) -> float | None:
    match = re.search(r"Answer:\s*(-?\d+(?:\.\d+)?)", text or "")
    return float(match.group(1)) if match else None


def expression_of(call: Any) -> str:
    """The ``expression`` argument of a tool call; "" when the model wrote something else (bad JSON, a number)."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError:
        return ""
    return str(arguments.get("expression", "")) if isinstance(arguments, dict) else ""


async def solve(
    client: openai.AsyncOpenAI, model: str, question: str, sampling: dict[str, Any], **request: Any
) -> str:
    """Up to three model turns: tool call(s), then the reply; ``request`` goes with every call (headers)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    for _ in range(3):
        response = await client.chat.completions.create(
            model=model,
            messages=cast("list[ChatCompletionMessageParam]", messages),
            tools=[cast("ChatCompletionToolParam", CALCULATOR)],
            max_tokens=40,
            **sampling,
            **request,
        )
        message = response.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": calculate(expression_of(call))}
            )
    return ""


def score(reply: str, answer: float) -> float:
    """1 when the reply's ``Answer: N`` is the right number, else 0."""
    value = final_number(reply)
    return 1.0 if value is not None and abs(value - answer) < 1e-6 else 0.0


@agl.rollout(name="calc")
async def calc_agent(task: dict[str, Any], llm: agl.LLM, rollout: agl.Rollout) -> float:
    """The calc agent under training: validation rollouts decode greedily."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "agl", max_retries=2)
    sampling = {"temperature": 0.0} if rollout.mode == "val" else dict(llm.sampling_parameters)
    try:
        reply = await solve(client, llm.model, task["question"], sampling)
    finally:
        await client.close()
    return score(reply, task["answer"])
