"""The compute thread: one thread runs the process's PyTorch work, and a training run puts all of it there."""

from __future__ import annotations

import asyncio
import contextvars
import os
import threading
from pathlib import Path

import openai
import pytest

import agl
from agl.algorithm.grpo import GRPO, GRPOConfig
from agl.algorithm.policy.model import Policy
from agl.compute.thread import run_compute
from agl.engines.builtin.engine import Engine
from agl.models import tiny_model

REQUEST = contextvars.ContextVar("REQUEST", default="none")


async def test_jobs_run_in_order_on_one_named_thread_with_the_callers_context() -> None:
    REQUEST.set("r-1")

    def job(i: int) -> tuple[int, threading.Thread, str]:
        return i, threading.current_thread(), REQUEST.get()

    seen = await asyncio.gather(*(run_compute(job, i) for i in range(5)))
    assert [i for i, _, _ in seen] == list(range(5))
    assert len({t for _, t, _ in seen}) == 1 and seen[0][1].name.startswith("agl-compute")
    assert {r for _, _, r in seen} == {"r-1"}

    def fails() -> None:
        raise ValueError("bad shape")

    with pytest.raises(ValueError, match="bad shape"):
        await run_compute(fails)
    assert (await run_compute(lambda: 7)) == 7  # the thread survives a failed job


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
async def test_a_forked_child_gets_a_thread_of_its_own() -> None:
    await run_compute(lambda: None)  # the parent's thread exists before the fork
    pid = os.fork()
    if pid == 0:  # the child: a job must run, not wait for a thread that was not copied
        try:
            ok = asyncio.run(asyncio.wait_for(run_compute(lambda: 41 + 1), 10)) == 42
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@agl.rollout
async def _agent(task: str, llm: agl.LLM) -> float:
    async with openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0) as client:
        reply = await client.chat.completions.create(
            model=llm.model, messages=[{"role": "user", "content": task}], max_tokens=4
        )
    return float(len(reply.choices[0].message.content or "") % 3)


@pytest.mark.timeout(240)
def test_fit_runs_every_model_computation_on_the_compute_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine batches, weight loads, policy creation and steps and the weights handed to the engine all run
    on one thread, so PyTorch keeps one OpenMP team (see agl/compute/thread.py)."""
    threads: dict[str, set[str]] = {}

    def record(cls: type, name: str) -> None:
        original = getattr(cls, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            threads.setdefault(name, set()).add(threading.current_thread().name)
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, wrapper)

    for cls, name in [(Engine, "_step"), (Engine, "_load"), (Engine, "__init__")]:
        record(cls, name)
    for name in ("__init__", "step", "engine_weights"):
        record(Policy, name)
    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=2,
        tasks_per_step=2,
        group_size=2,
        eval_every=0,
        export_model=False,
    )
    agl.Trainer(algorithm=GRPO(config), n_runners=4, output_dir=str(tmp_path)).fit(_agent, ["a", "b", "c"])
    assert set(threads) == {"_step", "_load", "__init__", "step", "engine_weights"}
    names = set().union(*threads.values())
    assert len(names) == 1 and next(iter(names)).startswith("agl-compute"), threads
