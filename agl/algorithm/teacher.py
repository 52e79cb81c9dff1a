"""A stronger model as the warm start: the agent runs against the teacher, its good conversations train
the student, then the algorithm goes on as usual (``GRPOConfig(warm_start=agl.Teacher(...))``,
``SFTConfig(teacher=...)``).

The teacher is served behind the same gateway (``ModelSpec.teacher``), so the user's agent runs
unchanged through the store and runners under a resources version of its own (``llm`` names the
teacher) and its rollouts are recorded with mode ``"teacher"`` (``"teacher_val"`` for its held-out
score). Its calls are never trained on as the student's own samples: the kept conversations (tool calls
included) are re-rendered in the student's chat template with the tools the agent declared.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl.adapter import Sample, final_reward, llm_calls, to_messages
from agl.algorithm.base import TrainingContext, evaluate
from agl.algorithm.health import rollout_failures, shorten
from agl.algorithm.spec import TeacherSpec
from agl.errors import ConfigError
from agl.schemas import Rollout

if TYPE_CHECKING:
    from agl.compute.precision import Precision
    from agl.engines.launch import EngineSpec

log = logging.getLogger(__name__)

#: rollout modes of the teacher's runs: its traces on train tasks, and its held-out score
TEACHER_MODE, TEACHER_VAL_MODE = "teacher", "teacher_val"
TRACES_FILE = "teacher_traces.jsonl"


@dataclass(frozen=True)
class Teacher:
    """A stronger model whose best rollouts on the train tasks are the student's first lesson.

    Args:
        endpoint: an OpenAI-compatible base URL (``https://api.openai.com/v1``); or
        path: a local Hugging Face folder, which ``Trainer.fit`` serves with the built-in engine (frozen).
        model: the model name the agent sends: the endpoint's own (required with ``endpoint``); with
            ``path``, the name fit serves it under (``"teacher"``).
        api_key: the endpoint's key (sent upstream, never recorded).
        precision: the local teacher's (``"auto"``, ``"fp32"``, ``"bf16"``).
        engine: what serves ``path`` (``agl.engines.BuiltinEngine(...)``; vLLM is not supported yet).
        samples_per_task: teacher rollouts per train task.
        max_tasks: run the teacher on at most this many train tasks (None: all of them).
        min_reward: keep rollouts scoring at least this (None: any succeeded one).
        top_k: keep at most this many best rollouts per task (None: all that pass ``min_reward``).
        keep: a test on a rollout's conversation (OpenAI chat messages, tool calls included), applied
            before ``top_k``: only conversations it passes are kept. A right answer can be reached the
            wrong way (a tool agent's teacher answering from its own arithmetic); ``Teacher.calls_a_tool``
            keeps only conversations that use the agent's tools.
        steps, batch_size, lr, seed: the student's SFT schedule on the kept conversations, as
            :class:`~agl.algorithm.grpo.WarmStart`'s (``lr`` None: the algorithm's).
        export_jsonl: write the kept traces to ``OUT/teacher_traces.jsonl`` (OpenAI chat format with
            ``tools``), reusable with ``WarmStart.from_jsonl``.
    """

    endpoint: str | None = None
    model: str | None = None
    api_key: str | None = field(default=None, repr=False)
    path: str | None = None
    precision: Precision = "auto"
    engine: EngineSpec | None = None
    samples_per_task: int = 4
    max_tasks: int | None = 32
    min_reward: float | None = 1.0
    top_k: int | None = 1
    keep: Callable[[list[dict[str, Any]]], bool] | None = None
    steps: int = 8
    batch_size: int = 8
    lr: float | None = None
    seed: int = 0
    export_jsonl: bool = True

    def __post_init__(self) -> None:
        if self.endpoint is not None and self.model is None:
            raise ConfigError(
                "Teacher(endpoint=...) needs model=: the model name the endpoint serves (e.g. 'gpt-4o-mini')"
            )
        for name in ("samples_per_task", "steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Teacher.{name} must be an integer >= 1, got {value!r}")
        if self.max_tasks is not None and (isinstance(self.max_tasks, bool) or self.max_tasks < 1):
            raise ConfigError(f"Teacher.max_tasks must be >= 1 or None, got {self.max_tasks!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or self.top_k < 1):
            raise ConfigError(f"Teacher.top_k must be >= 1 or None, got {self.top_k!r}")
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"Teacher.lr must be > 0, got {self.lr}")
        if self.keep is not None and not callable(self.keep):
            raise ConfigError(
                f"Teacher.keep must be a function of a conversation's messages returning a bool "
                f"(e.g. agl.Teacher.calls_a_tool), got {self.keep!r}"
            )
        self.spec()  # endpoint xor path, a valid URL, a model name other than 'policy'

    @staticmethod
    def calls_a_tool(messages: list[dict[str, Any]]) -> bool:
        """True when an assistant turn of ``messages`` calls a tool (a ``keep`` test for tool agents)."""
        return any(m.get("role") == "assistant" and m.get("tool_calls") for m in messages)

    def spec(self) -> TeacherSpec:
        """What ``Trainer.fit`` serves for this teacher (``ModelSpec.teacher``)."""
        return TeacherSpec(
            path=self.path,
            precision=self.precision,
            engine=self.engine,
            endpoint=self.endpoint,
            model=self.model or "teacher",
            api_key=self.api_key,
        )


@dataclass
class TeacherTraces:
    """The teacher's kept conversations, each with the tools its agent declared, and the counts."""

    conversations: list[list[dict[str, Any]]]
    tools: list[list[dict[str, Any]] | None]
    counts: dict[str, float]
    resources_id: str


def sft_steps(
    policy: Any, samples: list[Sample], *, steps: int, batch_size: int, lr: float | None, seed: int
) -> list[dict[str, float]]:
    """Blocking: ``steps`` SFT steps on random batches of ``samples`` at ``lr`` (the optimizer's own
    learning rate is restored afterwards)."""
    groups = policy.optimizer.param_groups
    saved = [g["lr"] for g in groups]
    if lr is not None:
        for g in groups:
            g["lr"] = lr
    rng = random.Random(seed)
    rows = []
    try:
        for step in range(1, steps + 1):
            batch = rng.sample(samples, min(batch_size, len(samples)))
            row = {"warm_start_step": float(step), **policy.sft_step(batch)}
            log.info("warm start step %d/%d: loss %.3f", step, steps, row["sft_loss"])
            rows.append(row)
    finally:
        for g, saved_lr in zip(groups, saved, strict=True):
            g["lr"] = saved_lr
    return rows


def samples_from_traces(tokenizer: Any, traces: TeacherTraces) -> list[Sample]:
    """The kept conversations rendered in the student's chat template, each with its own tools."""
    from agl.algorithm.sft.samples import samples_from_messages

    out: list[Sample] = []
    for n, (messages, tools) in enumerate(zip(traces.conversations, traces.tools, strict=True)):
        made = samples_from_messages(tokenizer, [messages], tools)
        out += [dataclasses.replace(s, rollout_id=f"teacher-trace-{n}") for s in made]
    return out


def _teacher_llm(ctx: TrainingContext) -> Any:
    if ctx.teacher_llm is None:
        raise ConfigError(
            "a Teacher needs Trainer.fit to serve it (the algorithm declares it in model_spec().teacher); "
            "run the algorithm through Trainer.fit"
        )
    return ctx.teacher_llm


async def publish_teacher(ctx: TrainingContext) -> str:
    """A resources version whose ``llm`` is the teacher (tagged ``role="teacher"``); returns its id."""
    return await ctx.publish({"llm": _teacher_llm(ctx)}, role="teacher", model_version="teacher")


async def teacher_score(
    ctx: TrainingContext, val: Sequence[Any], resources_id: str, *, timeout_s: float | None
) -> float:
    """The teacher's held-out reward: one ``teacher_val`` rollout per val task (failures score 0)."""
    return (await evaluate(ctx, val, resources_id, mode=TEACHER_VAL_MODE, timeout_s=timeout_s)).score


async def collect_traces(
    ctx: TrainingContext,
    teacher: Teacher,
    train: Sequence[Any],
    resources_id: str,
    *,
    timeout_s: float | None,
    held_out: float | None = None,
) -> TeacherTraces:
    """Run the agent against the teacher (``samples_per_task`` per task, on at most ``max_tasks`` train
    tasks), keep the rollouts by reward, and return their conversations with their tools.

    Raises:
        ConfigError: no teacher rollout passed the filters (nothing to train the student on).
    """
    from agl.algorithm.chat_jsonl import request_tools
    from agl.algorithm.sft.samples import select_rollouts

    tasks = list(train)
    if teacher.max_tasks is not None and len(tasks) > teacher.max_tasks:
        tasks = random.Random(teacher.seed).sample(tasks, teacher.max_tasks)
    done = await ctx.rollouts(
        tasks,
        mode=TEACHER_MODE,
        group_size=teacher.samples_per_task,
        resources_id=resources_id,
        metadata={"role": "teacher"},
        timeout_s=timeout_s,
    )
    rollouts: list[Rollout] = [r for r, _ in done]
    spans = {r.rollout_id: s for r, s in done}
    conversation = {r.rollout_id: to_messages(llm_calls(spans[r.rollout_id])) for r in rollouts}
    passed = [r for r in rollouts if teacher.keep is None or teacher.keep(conversation[r.rollout_id])]
    kept = select_rollouts(passed, spans, min_reward=teacher.min_reward, top_k_per_task=teacher.top_k)
    rewards = [final_reward(spans[r.rollout_id]) or 0.0 for r in rollouts]
    failures = await rollout_failures(ctx.store, rollouts, spans)
    counts = {
        "teacher_rollouts": float(len(rollouts)),
        "teacher_failed": float(failures.failed),
        "teacher_kept": float(len(kept)),
        "teacher_train_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
    }
    if teacher.keep is not None:
        counts["teacher_failed_keep"] = float(len(rollouts) - len(passed))
    kept = [r for r in kept if conversation[r.rollout_id]]
    traces = TeacherTraces(
        [conversation[r.rollout_id] for r in kept],
        [request_tools(spans[r.rollout_id]) for r in kept],
        counts,
        resources_id,
    )
    if not traces.conversations:
        failed = (
            f", {failures.failed} failed (the first: {shorten(failures.first_error, 300)})"
            if failures.failed
            else ""
        )
        own = "" if held_out is None else f"; its own held-out score {held_out:.3f}"
        keep = (
            ""
            if teacher.keep is None
            else f", keep={getattr(teacher.keep, '__name__', 'keep')} failed {len(rollouts) - len(passed)}"
        )
        raise ConfigError(
            f"the teacher's {len(rollouts)} rollouts on {len(tasks)} train tasks kept none{failed} "
            f"(Teacher(min_reward={teacher.min_reward}, top_k={teacher.top_k}{keep}); mean reward "
            f"{counts['teacher_train_reward']:.3f}{own}): lower min_reward, raise samples_per_task, try a "
            "stronger teacher, or check that the agent reaches the teacher (its rollouts have mode 'teacher' "
            "in the store)"
        )
    log.info("teacher: kept %d of %d rollouts on %d tasks", len(kept), len(rollouts), len(tasks))
    return traces


def export_traces(traces: TeacherTraces, path: str | Path) -> int:
    """Write the kept traces as OpenAI chat JSONL with the tools (``WarmStart.from_jsonl`` reads it)."""
    from agl.algorithm.chat_jsonl import export_jsonl

    return export_jsonl(traces.conversations, path, tools=traces.tools)


async def teach(
    ctx: TrainingContext,
    teacher: Teacher,
    policy: Any,
    train: Sequence[Any],
    val: Sequence[Any],
    phases: dict[str, float],
    *,
    timeout_s: float | None,
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """The teacher's held-out score (``phases["teacher"]``), its traces on train tasks, and the student's
    SFT steps on them (blocking work on the compute thread). Returns the step rows and the counts;
    the caller publishes the student's new weights."""
    from agl.compute.thread import run_compute

    resources_id = await publish_teacher(ctx)
    if val:
        phases["teacher"] = await teacher_score(ctx, val, resources_id, timeout_s=timeout_s)
        log.info("teacher: held-out score %.4f on %d tasks", phases["teacher"], len(val))
    traces = await collect_traces(
        ctx, teacher, train, resources_id, timeout_s=timeout_s, held_out=phases.get("teacher")
    )
    await ctx.release_teacher()  # its work is done: a local teacher's memory goes to the student's training
    if teacher.export_jsonl:
        export_traces(traces, Path(ctx.output_dir) / TRACES_FILE)
    samples = samples_from_traces(policy.tokenizer, traces)
    if not samples:
        raise ConfigError("the teacher's kept conversations have no assistant turn to train on")
    rows = await run_compute(
        sft_steps,
        policy,
        samples,
        steps=teacher.steps,
        batch_size=teacher.batch_size,
        lr=teacher.lr,
        seed=teacher.seed,
    )
    return rows, {**traces.counts, "teacher_samples": float(len(samples))}


__all__ = [
    "TEACHER_MODE",
    "TEACHER_VAL_MODE",
    "TRACES_FILE",
    "Teacher",
    "TeacherTraces",
    "collect_traces",
    "export_traces",
    "samples_from_traces",
    "sft_steps",
    "teach",
]
