"""Emitters: record rewards, messages, objects, exceptions and annotations as spans of the active rollout.

They work in sync, async and threaded code (the active rollout lives in a ContextVar; copy the
context into threads you start, e.g. with ``contextvars.copy_context().run``). Outside a rollout
they raise ``NoActiveRolloutError`` unless ``local=True``, which returns the span without storing it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import math
import re
import secrets
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, overload

from agl import semconv as sc
from agl.errors import AgentError, RewardError, install_command
from agl.schemas import Span, SpanLink, SpanStatus, StatusCode
from agl.tracer.context import RolloutContext, agent_context, current_agent, current_rollout

F = TypeVar("F", bound=Callable[..., Any])


def _parent() -> tuple[str | None, str | None]:
    """(trace_id, span_id) of the current OpenTelemetry span, if one is recording."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None, None
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None, None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def _emit(
    name: str,
    attributes: dict[str, Any],
    *,
    local: bool,
    tags: Sequence[str] | None = None,
    links: Sequence[str] | None = None,
    error: bool = False,
) -> Span:
    ctx: RolloutContext | None = current_rollout(required=not local)
    if tags:
        attributes[sc.TAGS] = list(tags)
    trace_id, parent_id = _parent()
    if ctx is not None:
        trace_id = trace_id or ctx.trace_id
        agent = current_agent() or ctx.agent_name
        if agent:
            attributes.setdefault(sc.AGENT_NAME, agent)
    now = time.time_ns()
    span = Span(
        rollout_id=ctx.rollout_id if ctx else "local",
        attempt_id=ctx.attempt_id if ctx else "local",
        trace_id=trace_id or secrets.token_hex(16),
        span_id=secrets.token_hex(8),
        parent_id=parent_id,
        name=name,
        start_time_ns=now,
        end_time_ns=now,
        attributes=attributes,
        links=[SpanLink(trace_id=trace_id or "0" * 32, span_id=s) for s in links or ()],
        status=SpanStatus(code=StatusCode.ERROR if error else StatusCode.OK),
    )
    if ctx is not None:
        ctx.buffer.add(span)
    return span


def emit_reward(
    value: float | dict[str, float],
    *,
    primary_key: str | None = None,
    response_id: str | None = None,
    tags: Sequence[str] | None = None,
    local: bool = False,
) -> Span:
    """Record a reward: a number, or named numbers with ``primary_key`` naming the one to train on.

    ``response_id`` ties the reward to the LLM response it judges (a per-call reward).
    """
    if isinstance(value, dict):
        if not value:
            raise RewardError("emit_reward got an empty dict; pass at least one named reward")
        key = primary_key or next(iter(value))
        if key not in value:
            raise RewardError(f"primary_key {key!r} is not among the rewards {sorted(value)}")
        values = {key: float(value[key]), **{k: float(v) for k, v in value.items() if k != key}}
        primary = values[key]
    else:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RewardError(f"a reward must be a number or a dict of numbers, got {type(value).__name__}")
        key, primary, values = primary_key or "reward", float(value), {primary_key or "reward": float(value)}
    not_finite = {k: v for k, v in values.items() if not math.isfinite(v)}
    if not_finite:  # the store keeps JSON, which has no NaN/Infinity: fail here, not at the store
        raise RewardError(f"rewards must be finite numbers, got {not_finite}; check the reward computation")
    attrs: dict[str, Any] = {sc.REWARD_VALUE: primary, sc.REWARD_VALUES: values, sc.REWARD_PRIMARY_KEY: key}
    if response_id is not None:
        attrs[sc.REWARD_RESPONSE_ID] = response_id
    span = _emit(sc.SPAN_REWARD, attrs, local=local, tags=tags)
    ctx = current_rollout(required=False)
    if ctx is not None:
        ctx.last_reward = primary
    return span


def emit_message(text: str, *, tags: Sequence[str] | None = None, local: bool = False) -> Span:
    """Record a free-text message (feedback, a log line the optimizer should see)."""
    return _emit(sc.SPAN_MESSAGE, {sc.MESSAGE_TEXT: str(text)}, local=local, tags=tags)


def emit_object(value: Any, *, tags: Sequence[str] | None = None, local: bool = False) -> Span:
    """Record any JSON-serializable value (non-serializable parts become their repr)."""
    return _emit(sc.SPAN_OBJECT, {sc.OBJECT_VALUE: _jsonable(value)}, local=local, tags=tags)


def emit_exception(exc: BaseException, *, tags: Sequence[str] | None = None, local: bool = False) -> Span:
    """Record an exception with its type, message and stack trace."""
    attrs = {
        sc.EXCEPTION_TYPE: type(exc).__name__,
        sc.EXCEPTION_MESSAGE: str(exc),
        sc.EXCEPTION_STACKTRACE: "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)),
    }
    return _emit(sc.SPAN_EXCEPTION, attrs, local=local, tags=tags, error=True)


def emit_annotation(
    annotation: dict[str, Any],
    *,
    links: Sequence[str] | None = None,
    tags: Sequence[str] | None = None,
    local: bool = False,
) -> Span:
    """Record key-value annotations, optionally linked to other spans by span id."""
    return _emit(
        sc.SPAN_ANNOTATION, {sc.ANNOTATION: _jsonable(annotation)}, local=local, tags=tags, links=links
    )


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=repr))


class _Operation:
    """The handle ``with operation(...) as op`` yields: ``op.set_output(value)`` records the result."""

    def __init__(self, span: Any) -> None:
        self._span = span

    def set_output(self, value: Any) -> None:
        self._span.set_attribute(sc.OPERATION_OUTPUT, json.dumps(_jsonable(value)))


@contextlib.contextmanager
def _operation_span(name: str, inputs: Any) -> Iterator[_Operation]:
    from agl.tracer.otel import tracer_provider

    current_rollout()
    tracer = tracer_provider().get_tracer("agl.emit")
    with tracer.start_as_current_span(name, record_exception=False, set_status_on_exception=False) as span:
        span.set_attribute(sc.OPERATION_NAME, name)
        if inputs is not None:
            span.set_attribute(sc.OPERATION_INPUT, json.dumps(_jsonable(inputs)))
        try:
            yield _Operation(span)
        except BaseException as exc:
            from opentelemetry.trace import Status
            from opentelemetry.trace import StatusCode as OtelStatus

            span.set_attribute(sc.EXCEPTION_TYPE, type(exc).__name__)
            span.set_attribute(sc.EXCEPTION_MESSAGE, str(exc))
            span.set_status(Status(OtelStatus.ERROR, str(exc)))
            raise


_AGENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")


@contextlib.contextmanager
def agent_scope(name: str) -> Iterator[None]:
    """Mark the code inside as agent ``name`` (``with agl.agent_scope("writer"): ...``), for
    ``GRPOConfig(agents=...)`` and per-agent groups.

    Spans and emitters inside carry the name; openai calls inside are traced (the openai instrumentor
    is switched on once), and the gateway's record of each call takes the agent of the traced call
    with the same response id. Without the instrumentor, give the agent its own gateway endpoint
    instead: ``llm.endpoint_for("writer")``. Scopes nest (the innermost wins) and follow asyncio tasks.
    With a LoRA adapter per agent (several ``GRPOConfig.agents``) use the endpoint: a scope names a call
    only after it ran, so the base model, not the agent's adapter, answered it.
    """
    if not isinstance(name, str) or not _AGENT_NAME.fullmatch(name):
        raise AgentError(
            f"agent name must be 1-128 letters, digits or '_.:-', starting with a letter or digit, got {name!r}"
        )
    if current_rollout(required=False) is None:
        with agent_context(name):
            yield
        return
    from agl.tracer.instrument import instrument
    from agl.tracer.otel import tracer_provider

    if "openai" not in instrument("openai"):  # once per process
        logging.getLogger(__name__).warning(
            "agent_scope(%r): openinference-instrumentation-openai is not installed, so gateway calls "
            "cannot be matched to the scope; %s or use llm.endpoint_for(%r)",
            name,
            install_command("integrations"),
            name,
        )
    tracer = tracer_provider().get_tracer("agl.emit")
    with agent_context(name), tracer.start_as_current_span(name) as span:
        span.set_attribute(sc.AGENT_NAME, name)
        yield


class OperationScope(Protocol):
    """What ``operation("name")`` returns: a context manager yielding the handle, and a decorator."""

    def __enter__(self) -> _Operation: ...
    def __exit__(self, *exc: Any) -> bool: ...
    def __call__(self, fn: F) -> F: ...


@overload
def operation(name: F) -> F: ...
@overload
def operation(name: str | None = None, **inputs: Any) -> OperationScope: ...
def operation(name: Any = None, **inputs: Any) -> Any:
    """Record a unit of work (inputs, output, error, duration) as a span; nested spans become its children.

    Use as ``@operation``, ``@operation("name")`` or ``with operation("name", x=1) as op: op.set_output(y)``.
    """
    if callable(name):
        return operation(None)(name)

    class _Both(contextlib.ContextDecorator):
        def __init__(self) -> None:
            self._cm: Any = None

        def __enter__(self) -> _Operation:
            self._cm = _operation_span(name or "operation", inputs or None)
            return self._cm.__enter__()  # type: ignore[no-any-return]

        def __exit__(self, *exc: Any) -> bool:
            return bool(self._cm.__exit__(*exc))

        def __call__(self, fn: F) -> F:  # type: ignore[override]
            op_name = name or fn.__qualname__
            signature = inspect.signature(fn)

            def bound(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
                return dict(signature.bind_partial(*args, **kwargs).arguments)

            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                    with _operation_span(op_name, bound(args, kwargs)) as op:
                        result = await fn(*args, **kwargs)
                        op.set_output(result)
                        return result

                return async_wrapper  # type: ignore[return-value]

            @functools.wraps(fn)
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with _operation_span(op_name, bound(args, kwargs)) as op:
                    result = fn(*args, **kwargs)
                    op.set_output(result)
                    return result

            return wrapper  # type: ignore[return-value]

    return _Both()
