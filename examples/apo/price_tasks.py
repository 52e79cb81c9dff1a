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
    # the hard variant's business rules: each applies only to some tasks, so a small minibatch can miss it
    "bulk": (
        "bulk discount",
        "Orders of 10 or more units get a 10% bulk discount on the total.",
        "discount missed: orders of 10 or more units get a 10% bulk discount",
    ),
    "tax": (
        "sales tax",
        "When the question asks for the price including sales tax, add 8% sales tax to the total.",
        "tax missed: a total including sales tax must add 8%",
    ),
}
#: the rules the basic variant's tasks exercise
BASIC_RULES = ("format", "tool", "trap")
BULK_UNITS, BULK_FACTOR, TAX_FACTOR = 10, 0.9, 1.08

LOOKUP_TOOL: dict[str, Any] = {
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


def adjust(total: float, units: int, with_tax: bool, bulk: bool, tax: bool) -> float:
    """The hard variant's business rules on a computed total: bulk discount, then sales tax."""
    if bulk and units >= BULK_UNITS:
        total *= BULK_FACTOR
    if tax and with_tax:
        total *= TAX_FACTOR
    return round(total, 2)


def make_tasks(
    n: int, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3), variant: str = "basic"
) -> list[PriceTask]:
    """``n`` tasks cycling through ``levels``, deterministic by seed.

    ``variant="hard"`` adds two business rules that apply to some tasks only: orders of 10+ units get
    a bulk discount, and about a quarter of the questions ask for the total including sales tax.
    """
    if variant not in ("basic", "hard"):
        raise ValueError(f"variant must be 'basic' or 'hard', got {variant!r}")
    hard = variant == "hard"
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        level = levels[i % len(levels)]
        item = f"item-{rng.randrange(len(CATALOG_CENTS))}"
        units = rng.randint(2, 14) if hard else rng.randint(2, 9)
        with_tax = hard and rng.random() < 0.25
        suffix = " including sales tax" if with_tax else ""
        cents = CATALOG_CENTS[item]
        if level == 1:
            price = rng.randint(2, 40)
            question = f"One {item} costs {price} dollars. What do {units} of them cost{suffix}?"
            base: float = units * price
        elif level == 2:
            question = f"What do {units} units of {item} cost{suffix}, in catalog units?"
            base = units * cents
        else:
            question = f"What do {units} units of {item} cost{suffix} in dollars?"
            base = round(units * cents / 100, 2)
        tasks.append(PriceTask(question, adjust(base, units, with_tax, True, True), level))
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
    ratio = value / float(task["answer"]) if task["answer"] else 0.0
    if task["level"] == 3 and ratio > 20:  # still in cents
        return 0.0, RULES["trap"][2]
    question = str(task["question"])
    units = re.search(r"(?:What do|cost of) (\d+)", question)
    taxed = "including sales tax" in question
    undiscounted = (1 / BULK_FACTOR, 1 / (BULK_FACTOR * TAX_FACTOR) if taxed else 1 / BULK_FACTOR)
    if units and int(units.group(1)) >= BULK_UNITS and any(abs(ratio - r) < 0.005 for r in undiscounted):
        return 0.0, RULES["bulk"][2]  # the total without the discount (with or without the tax)
    if taxed:
        return 0.0, RULES["tax"][2]
    return 0.0, f"wrong value: expected {task['answer']}, got {value}"


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"
