"""Recipe: a LangGraph SQL agent learns to query a shop database (SmolLM2-135M-Instruct, 2 CPU cores).

    python -m examples.sql_agent.train                 # SmolLM2: base, SFT warm start, GRPO
    python -m examples.sql_agent.train --model tiny    # a fast smoke run of the whole loop

The agent (``examples/sql_agent/agent.py``) is a plain LangGraph ReAct graph with a ``run_sql`` tool. The
loop: measure held-out execution accuracy; a short SFT warm start on correct traces of *train* questions;
GRPO through the store, runners, gateway and engine; measure again. Held-out questions pair each question
template with values it never had in training. Writes ``curve.png``, ``summary.json`` and the trained model
under ``--out`` (default ``results/sql_agent``, or ``results/sql_agent-tiny`` for ``--model tiny``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from langchain_core.utils.function_calling import convert_to_openai_tool

import agl
from examples.heldout import split_by_template
from examples.recipe import Recipe, recipe_args, run_recipe
from examples.sql_agent.agent import SYSTEM, make_sql_tool, sql_agent
from examples.sql_agent.shop import build_database, format_rows, make_questions, run_query


def sql_trace(task: dict[str, Any]) -> list[dict[str, Any]]:
    """A correct conversation for ``task``, shaped as ChatOpenAI sends it: query, rows, answer."""
    call = {
        "id": "call-0",
        "type": "function",
        "function": {"name": "run_sql", "arguments": json.dumps({"query": task["sql"]})},
    }
    rows = format_rows(run_query(task["database"], task["sql"]))
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": task["question"]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call-0", "content": rows},
        {"role": "assistant", "content": rows},
    ]


async def _limit_flags(store_path: Path) -> dict[str, list[bool]]:
    store = agl.SqliteLightningStore(store_path)
    flags: dict[str, list[bool]] = {"val": [], "train": []}
    try:
        cursor = None
        while True:
            page = await store.query_rollouts(limit=500, cursor=cursor)
            for rollout in page.items:
                spans = (await store.query_spans(rollout_id=rollout.rollout_id, name="agl.object")).items
                values = [s.attributes.get("agl.object.value") for s in spans]
                hits = [bool(v.get("hit_recursion_limit")) for v in values if isinstance(v, dict)]
                if hits:
                    flags.setdefault(rollout.mode, []).append(hits[-1])
            cursor = page.next_cursor
            if cursor is None:
                return flags
    finally:
        await store.aclose()


def recursion_limit_share(store_path: Path, n_test: int) -> dict[str, Any]:
    """Share of rollouts that hit the graph's recursion limit: over training, and per held-out phase
    (validation runs base, after the warm start and after GRPO, ``n_test`` rollouts each, in that order)."""
    flags = asyncio.run(_limit_flags(store_path))
    share = {"train": sum(flags["train"]) / max(len(flags["train"]), 1)}
    for index, phase in enumerate(["base", "after_warm_start", "after_grpo"]):
        chunk = flags["val"][index * n_test : (index + 1) * n_test]
        if len(chunk) == n_test:
            share[phase] = sum(chunk) / n_test
    return {"recursion_limit_share": share}


def split(args: argparse.Namespace) -> tuple[Path, list[dict[str, Any]], list[dict[str, Any]]]:
    """The shop database and its (train, test) questions: from ``--split-seed``, whatever ``--seed``."""
    database = build_database(args.out / "shop.db", seed=args.split_seed)
    questions = [{**q, "database": str(database)} for q in make_questions(database)]
    train, test = split_by_template(questions, test=args.test, key="question", seed=args.split_seed)
    return database, train, test


def main() -> None:
    args = recipe_args(__doc__ or "", "sql_agent")
    agl.instrument("langchain")  # LangGraph's nodes and tool calls show in the dashboard
    database, train, test = split(args)
    recipe = Recipe(
        name="sql_agent",
        framework="LangGraph",
        agent=sql_agent,
        train=train,
        test=test,
        warm_start=[sql_trace(t) for t in train],
        tools=[convert_to_openai_tool(make_sql_tool(database, []))],  # exactly what bind_tools sends
        metric="execution accuracy",
        report=recursion_limit_share,
    )
    run_recipe(recipe, args)


if __name__ == "__main__":
    main()
