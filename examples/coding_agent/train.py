"""Recipe: an OpenAI Agents SDK coding agent learns to write functions that pass hidden tests (SmolLM2, 2 cores).

    python -m examples.coding_agent.train                 # SmolLM2: base, then GRPO (no warm start)
    python -m examples.coding_agent.train --model tiny    # a fast smoke run of the whole loop

The agent (``examples/coding_agent/agent.py``) is a plain Agents-SDK agent; its reward is the share of hidden
unit tests its function passes in ``agl.sandbox``. The loop: held-out pass rate of the base model; GRPO;
measure again. SmolLM2 already passes about 63% of the held-out tests (98% after GRPO, seeds 0-2, in
``benchmarks/results/recipe_variants/2026-12-07-413c3cd-coding_agent-default.json``), and a warm start on
reference solutions of *train* specs (``--sft-steps 12``) takes it to 100%, leaving GRPO nothing to add, so it
is off. Held-out specs pair each template with constants it never had in training. Writes ``curve.png``, ``summary.json`` and the trained model under
``--out`` (default ``results/coding_agent``, or ``results/coding_agent-tiny`` for ``--model tiny``).
"""

from __future__ import annotations

import argparse
from typing import Any

from examples.coding_agent.agent import INSTRUCTIONS, coding_agent
from examples.coding_agent.tasks import make_tasks
from examples.heldout import split_by_template
from examples.recipe import Recipe, recipe_args, run_recipe


def solution_trace(task: dict[str, Any]) -> list[dict[str, Any]]:
    """The reference solution as the agent is asked to reply: one fenced code block."""
    return [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": task["spec"]},
        {"role": "assistant", "content": f"```python\n{task['reference']}```"},
    ]


def split(args: argparse.Namespace) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, test) tasks: the held-out split from ``--split-seed``, whatever ``--seed``."""
    return split_by_template(make_tasks(), test=args.test, key="spec", seed=args.split_seed)


def main() -> None:
    args = recipe_args(__doc__ or "", "coding_agent", sft_steps=0)  # the base already passes 63%: GRPO alone
    train, test = split(args)
    recipe = Recipe(
        name="coding_agent",
        framework="OpenAI Agents SDK",
        agent=coding_agent,
        train=train,
        test=test,
        warm_start=[solution_trace(t) for t in train],
        metric="hidden-test pass rate",
    )
    run_recipe(recipe, args)


if __name__ == "__main__":
    main()
