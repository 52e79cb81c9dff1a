"""Every emitter, inside and outside a rollout."""

from __future__ import annotations

import asyncio
import threading

import pytest

import agl
from agl import semconv as sc
from agl.errors import AgentError, NoActiveRolloutError
from agl.schemas import Attempt, Rollout, StatusCode
from agl.tracer import RolloutContext, rollout_context


def _ctx(name: str = "ro-test") -> RolloutContext:
    rollout = Rollout(rollout_id=name, created_at=0, updated_at=0)
    attempt = Attempt(attempt_id=f"at-{name}", rollout_id=name, attempt_number=1, started_at=0)
    return RolloutContext(rollout=rollout, attempt=attempt, agent_name="solver")


def test_emit_reward_number_and_dict() -> None:
    ctx = _ctx()
    with rollout_context(ctx):
        agl.emit_reward(0.5)
        agl.emit_reward({"len": 0.1, "acc": 1.0}, primary_key="acc", response_id="chatcmpl-1")
    first, second = ctx.buffer.take()
    assert first.name == sc.SPAN_REWARD and first.attributes[sc.REWARD_VALUE] == 0.5
    assert second.attributes[sc.REWARD_VALUE] == 1.0
    assert list(second.attributes[sc.REWARD_VALUES]) == ["acc", "len"]  # primary first
    assert second.attributes[sc.REWARD_RESPONSE_ID] == "chatcmpl-1"
    assert first.rollout_id == "ro-test" and first.attempt_id == "at-ro-test"
    assert first.attributes[sc.AGENT_NAME] == "solver"


def test_emit_reward_rejects_bad_values() -> None:
    with rollout_context(_ctx()):
        with pytest.raises(AgentError, match="primary_key"):
            agl.emit_reward({"a": 1.0}, primary_key="b")
        with pytest.raises(AgentError, match="number"):
            agl.emit_reward("high")  # type: ignore[arg-type]
        with pytest.raises(AgentError, match="empty"):
            agl.emit_reward({})


def test_message_object_exception_annotation() -> None:
    ctx = _ctx()
    with rollout_context(ctx):
        agl.emit_message("looks wrong", tags=["feedback"])
        agl.emit_object({"plan": [1, 2], "obj": object()})
        try:
            raise ValueError("bad tool input")
        except ValueError as error:
            agl.emit_exception(error)
        agl.emit_annotation({"judge": "gpt"}, links=["a" * 16])
    message, obj, exc, note = ctx.buffer.take()
    assert message.attributes[sc.MESSAGE_TEXT] == "looks wrong" and message.attributes[sc.TAGS] == [
        "feedback"
    ]
    assert (
        obj.attributes[sc.OBJECT_VALUE]["plan"] == [1, 2]
        and "object" in obj.attributes[sc.OBJECT_VALUE]["obj"]
    )
    assert (
        exc.attributes[sc.EXCEPTION_TYPE] == "ValueError"
        and "bad tool input" in exc.attributes[sc.EXCEPTION_STACKTRACE]
    )
    assert exc.status.code == StatusCode.ERROR
    assert note.attributes[sc.ANNOTATION] == {"judge": "gpt"} and note.links[0].span_id == "a" * 16


def test_outside_a_rollout_raises_unless_local() -> None:
    with pytest.raises(NoActiveRolloutError, match="local=True"):
        agl.emit_reward(1.0)
    with pytest.raises(NoActiveRolloutError):
        agl.emit_message("x")
    span = agl.emit_reward(1.0, local=True)
    assert span.attributes[sc.REWARD_VALUE] == 1.0 and span.rollout_id == "local"


def test_operation_decorator_records_inputs_output_and_children() -> None:
    ctx = _ctx()

    @agl.operation
    def plan(goal: str, steps: int = 2) -> list[str]:
        agl.emit_reward(0.3)
        return [goal] * steps

    with rollout_context(ctx):
        assert plan("win", steps=3) == ["win"] * 3
    reward, op = ctx.buffer.take()
    assert op.attributes[sc.OPERATION_INPUT] == {"goal": "win", "steps": 3}
    assert op.attributes[sc.OPERATION_OUTPUT] == ["win"] * 3
    assert reward.parent_id == op.span_id and reward.trace_id == op.trace_id
    assert op.end_time_ns >= op.start_time_ns


async def test_operation_async_and_context_manager_and_errors() -> None:
    ctx = _ctx()

    @agl.operation("fetch")
    async def fetch(url: str) -> str:
        await asyncio.sleep(0)
        return url.upper()

    with rollout_context(ctx):
        assert await fetch("a") == "A"
        with agl.operation("block", k=1) as op:
            op.set_output({"done": True})
        with pytest.raises(RuntimeError), agl.operation("fails"):
            raise RuntimeError("tool broke")
    fetched, block, failed = ctx.buffer.take()
    assert fetched.name == "fetch" and fetched.attributes[sc.OPERATION_OUTPUT] == "A"
    assert block.attributes[sc.OPERATION_INPUT] == {"k": 1} and block.attributes[sc.OPERATION_OUTPUT] == {
        "done": True
    }
    assert failed.status.code == StatusCode.ERROR and failed.attributes[sc.EXCEPTION_MESSAGE] == "tool broke"


def test_threads_started_with_a_copied_context_keep_their_rollout() -> None:
    import contextvars

    ctxs = [_ctx(f"ro-{i}") for i in range(8)]

    def work(i: int) -> None:
        agl.emit_reward(float(i))

    threads = []
    for i, ctx in enumerate(ctxs):
        with rollout_context(ctx):
            run_ctx = contextvars.copy_context()
        threads.append(threading.Thread(target=run_ctx.run, args=(work, i)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, ctx in enumerate(ctxs):
        (span,) = ctx.buffer.take()
        assert span.rollout_id == f"ro-{i}" and span.attributes[sc.REWARD_VALUE] == float(i)
