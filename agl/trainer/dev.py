"""``Trainer.dev``: run an agent on a few tasks and show what happened, before any training."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.tree import Tree

from agl import semconv as sc
from agl.agent.base import LitAgent
from agl.runner.runner import AttemptOutcome, Runner
from agl.schemas import LLMCall, Resource, RolloutCreate, Span
from agl.store.base import LightningStore
from agl.store.memory import InMemoryLightningStore


def _describe(span: Span) -> str:
    call = LLMCall.from_span(span)
    a = span.attributes
    if call is not None:
        reply = call.response_message or {}
        tools = ", ".join(str((t.get("function") or {}).get("name")) for t in call.tool_calls)
        text = str(reply.get("content") or "")[:80]
        return f"[cyan]llm[/] {call.model}: {text!r}" + (f" tools={tools}" if tools else "")
    if span.name == sc.SPAN_REWARD:
        return f"[green]reward[/] {a.get(sc.REWARD_VALUE)}"
    if span.name == sc.SPAN_EXCEPTION:
        return f"[red]exception[/] {a.get(sc.EXCEPTION_TYPE)}: {a.get(sc.EXCEPTION_MESSAGE)}"
    if span.name == sc.SPAN_MESSAGE:
        return f"[yellow]message[/] {a.get(sc.MESSAGE_TEXT)}"
    shown = {k: v for k, v in a.items() if not k.startswith(("agl.rollout", "agl.attempt"))}
    return f"{span.name} {json.dumps(shown, default=str)[:100]}"


async def run_dev(
    agent: LitAgent,
    tasks: Sequence[Any],
    resources: dict[str, Resource] | None,
    store: LightningStore | None = None,
    console: Console | None = None,
    max_concurrency: int = 4,
) -> list[AttemptOutcome]:
    store = store or InMemoryLightningStore()
    console = console or Console()
    if resources:
        await store.add_resources(resources)
    rollouts = await store.enqueue_rollouts([RolloutCreate(input=t, mode="val") for t in tasks])
    runner = Runner(agent, store, max_concurrency=max_concurrency, poll_interval_s=0.01)
    outcomes = {o.rollout_id: o for o in await runner.run(max_rollouts=len(rollouts))}
    runner.close()
    table = Table(title=f"agl dev: {len(rollouts)} rollouts")
    for column in ("rollout", "task", "status", "reward", "spans"):
        table.add_column(column)
    for rollout in rollouts:
        outcome = outcomes[rollout.rollout_id]
        reward = "-" if outcome.reward is None else f"{outcome.reward:.3f}"
        table.add_row(
            rollout.rollout_id, str(rollout.input)[:40], outcome.status.value, reward, str(outcome.spans)
        )
    console.print(table)
    for rollout in rollouts:
        tree = Tree(f"[bold]{rollout.rollout_id}[/] {str(rollout.input)[:60]}")
        for span in (await store.query_spans(rollout_id=rollout.rollout_id)).items:
            tree.add(_describe(span))
        outcome = outcomes[rollout.rollout_id]
        if outcome.error:
            tree.add(f"[red]error[/] {outcome.error}")
        console.print(tree)
    return [outcomes[r.rollout_id] for r in rollouts]
