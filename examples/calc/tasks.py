"""Arithmetic word problems with a known answer, generated deterministically from a seed."""

from __future__ import annotations

import random
from typing import Any

_TEMPLATES = [
    ("{name} has {a} {thing}s and buys {b} more. How many {thing}s does {name} have now?", "+"),
    ("{name} had {a} {thing}s and gave away {b}. How many {thing}s are left?", "-"),
    ("There are {a} boxes with {b} {thing}s in each box. How many {thing}s are there in total?", "*"),
    ("{name} collects {a} {thing}s on Monday and {b} on Tuesday. How many {thing}s in all?", "+"),
]
_NAMES = ["Anna", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo"]
_THINGS = ["apple", "marble", "sticker", "pencil", "coin", "card"]


def make_tasks(n: int, seed: int) -> list[dict[str, Any]]:
    """``n`` problems; each has ``question``, the integer ``answer`` and the ``expression`` that gives it."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        template, op = rng.choice(_TEMPLATES)
        if op == "*":
            a, b = rng.randint(3, 19), rng.randint(3, 19)
        else:
            a, b = rng.randint(20, 199), rng.randint(11, 99)
            if op == "-" and b > a:
                a, b = b, a
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        question = template.format(name=rng.choice(_NAMES), thing=rng.choice(_THINGS), a=a, b=b)
        tasks.append({"question": question, "answer": answer, "expression": f"{a} {op} {b}"})
    return tasks
