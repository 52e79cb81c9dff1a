"""The price-question tasks of the simulated LM test bed: catalog, hidden rules, task generator and grader.

Pure Python with no server dependency, so other environments (the DSPy side of the APO benchmark)
can import it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

CATALOG_CENTS = {f"item-{i}": 100 * (3 + (i * 7) % 11) + 25 * (i % 4) for i in range(200)}

#: rule name -> (what the prompt must contain, the instruction that satisfies it, the feedback a failure yields)
RULES: dict[str, tuple[str, str, str]] = {
    "format": (
        "ANSWER:",
        "End your reply with one line of the form 'ANSWER: <number>'.",
        "wrong format: the reply must end with 'ANSWER: <number>'",
    ),
    "tool": (
        "lookup tool",
        "When a price is not given, call the lookup tool with the item name before answering.",
        "price unknown: the agent guessed instead of calling the lookup tool",
    ),
    "trap": (
        "cents",
        "Catalog prices are in cents: convert them to dollars before computing the total.",
        "unit error: catalog prices are in cents but the answer must be in dollars",
    ),
}

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the catalog price of an item.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]},
    },
}


@dataclass(frozen=True, slots=True)
class PriceTask:
    """``level`` 1: price given (needs the format rule); 2: price only in the catalog (needs the tool);
    3: the catalog price is in cents (needs the warning too)."""

    question: str
    answer: float
    level: int

    def as_input(self) -> dict[str, Any]:
        return {"question": self.question, "answer": self.answer, "level": self.level}


def make_tasks(n: int, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3)) -> list[PriceTask]:
    """``n`` tasks cycling through ``levels``, deterministic by seed."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        level = levels[i % len(levels)]
        item = f"item-{rng.randrange(len(CATALOG_CENTS))}"
        units = rng.randint(2, 9)
        cents = CATALOG_CENTS[item]
        if level == 1:
            price = rng.randint(2, 40)
            tasks.append(
                PriceTask(
                    f"One {item} costs {price} dollars. What do {units} of them cost?", units * price, 1
                )
            )
        elif level == 2:
            tasks.append(
                PriceTask(f"What do {units} units of {item} cost, in catalog units?", units * cents, 2)
            )
        else:
            question = f"What do {units} units of {item} cost in dollars?"
            tasks.append(PriceTask(question, round(units * cents / 100, 2), 3))
    return tasks


def grade(task: dict[str, Any], reply: str, used_tool: bool) -> tuple[float, str]:
    """Reward 1 for the right number in the required format; otherwise 0 and feedback naming the failure."""
    match = re.search(r"ANSWER:\s*(-?[\d.]+)\s*$", reply.strip())
    if match is None:
        return 0.0, RULES["format"][2]
    value = float(match.group(1))
    if abs(value - float(task["answer"])) < 1e-6:
        return 1.0, "correct"
    if task["level"] >= 2 and not used_tool:
        return 0.0, RULES["tool"][2]
    if task["level"] == 3:
        return 0.0, RULES["trap"][2]
    return 0.0, f"wrong value: expected {task['answer']}, got {value}"


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"
