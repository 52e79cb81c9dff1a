"""``Trainer.dev``: run an agent on a few tasks and show what happened, before any training."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
from collections.abc import Iterator, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from agl import semconv as sc
from agl.adapter.rewards import final_reward
from agl.agent.base import FunctionAgent, LitAgent
from agl.algorithm.base import TrainingContext
from agl.errors import ConfigError
from agl.runner.runner import AttemptOutcome, Runner
from agl.schemas import LLM, LLMCall, PromptTemplate, Resource, Span
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


@contextlib.contextmanager
def serve_model(model: str, sampling: dict[str, Any] | None = None) -> Iterator[LLM]:
    """The built-in engine serving ``model`` (``"tiny"``, ``"smollm2"`` or a local HF folder) on
    loopback for ``dev``, as the LLM resource agents get; stopped on exit."""
    from agl.engines.builtin.server import EngineServer

    path = model
    if model == "tiny":
        from agl.models import tiny_model

        path = str(tiny_model())
    elif model == "smollm2":
        from agl.models import smollm2

        path = str(smollm2())
    server = EngineServer(path, model_name=model).start()
    try:
        yield LLM(endpoint=server.base_url, model=model, sampling_parameters=dict(sampling or {}))
    finally:
        server.stop()


def _check_resources(agent: LitAgent, resources: dict[str, Resource]) -> None:
    """An ``@agl.rollout`` agent that wants an LLM or a prompt dev was not given fails here, naming
    dev's own arguments (the runner's message would point at the store)."""
    if not isinstance(agent, FunctionAgent):
        return
    for name, param in agent._signature.parameters.items():
        if param.default is not inspect.Parameter.empty or name in resources:
            continue
        for kind, hint in ((LLM, "model='tiny' (serves the built-in engine) or "), (PromptTemplate, "")):
            wanted = name == kind.__name__.lower() or name == "prompt" and kind is PromptTemplate
            if (wanted or param.annotation in (kind, kind.__name__, f"agl.{kind.__name__}")) and not any(
                isinstance(r, kind) for r in resources.values()
            ):
                raise ConfigError(
                    f"the agent's parameter {name!r} wants an agl.{kind.__name__} and Trainer.dev got none: "
                    f"pass {hint}resources={{{name!r}: agl.{kind.__name__}(...)}} to dev"
                )


async def run_dev(
    agent: LitAgent,
    tasks: Sequence[Any],
    resources: dict[str, Resource] | None,
    store: LightningStore | None = None,
    console: Console | None = None,
    max_concurrency: int = 4,
) -> list[AttemptOutcome]:
    """Run each task once (mode ``val``) and print a table and each rollout's span tree.

    The reward shown (and returned) is the one training uses: the rollout's final reward as the
    adapter reads it from the spans, not a per-call reward emitted last.
    """
    from agl.tracer.instrument import instrument

    store = store or InMemoryLightningStore()
    console = console or Console()
    _check_resources(agent, resources or {})
    instrument("openai")  # the agent's own model calls show up in the span tree
    if resources:
        await store.add_resources(resources)
    pending = await TrainingContext(store=store).start_rollouts(tasks, mode="val")
    runner = Runner(agent, store, max_concurrency=max_concurrency, poll_interval_s=0.01)
    outcomes = {o.rollout_id: o for o in await runner.run(max_rollouts=len(pending.ids))}
    runner.close()
    done = await pending.collect(timeout_s=0)  # the runner ran them all: nothing left to wait for
    rollouts = [r for r, _ in done]
    spans = {r.rollout_id: s for r, s in done}
    outcomes = {rid: dataclasses.replace(o, reward=final_reward(spans[rid])) for rid, o in outcomes.items()}
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
        for span in spans[rollout.rollout_id]:
            tree.add(_describe(span))
        outcome = outcomes[rollout.rollout_id]
        if outcome.error:
            failed_as = f" ({outcome.failure_class})" if outcome.failure_class else ""
            tree.add(f"[red]error{failed_as}[/] {escape(outcome.error)}")
        console.print(tree)
    return [outcomes[r.rollout_id] for r in rollouts]
