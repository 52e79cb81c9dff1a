"""The OpenTelemetry side of the tracer: one TracerProvider whose processor files spans under their rollout.

``RolloutSpanProcessor`` notes the active rollout when a span starts and, when it ends, converts it
to an ``agl.schemas.Span`` (canonical LLM keys added) in that rollout's buffer. It never blocks or
raises into the agent: a failure is logged once and counted.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

from agl import semconv as sc
from agl.schemas import Span, SpanEvent, SpanKind, SpanLink, SpanStatus, StatusCode
from agl.tracer.context import RolloutContext, current_agent, current_rollout
from agl.tracer.normalize import normalize_openinference

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import Span as SdkSpan

log = logging.getLogger(__name__)

#: attribute keys whose values agl writes as JSON strings (OTel attributes hold only primitives)
JSON_KEYS = frozenset(
    {sc.OPERATION_INPUT, sc.OPERATION_OUTPUT, sc.OBJECT_VALUE, sc.REWARD_VALUES, sc.TAGS, sc.ANNOTATION}
)

_KINDS = {
    0: SpanKind.INTERNAL,
    1: SpanKind.SERVER,
    2: SpanKind.CLIENT,
    3: SpanKind.PRODUCER,
    4: SpanKind.CONSUMER,
}
_STATUS = {0: StatusCode.UNSET, 1: StatusCode.OK, 2: StatusCode.ERROR}


def _attrs(raw: Any) -> dict[str, Any]:
    """OTel attributes as JSON values: tuples become lists, agl's JSON-string keys are parsed."""
    out = {k: list(v) if v.__class__ is tuple else v for k, v in (raw or {}).items()}
    for key in JSON_KEYS.intersection(out):  # a few keys at most; a span may carry hundreds
        value = out[key]
        if isinstance(value, str):
            try:
                out[key] = json.loads(value)
            except ValueError:
                pass
    return out


def to_agl_span(span: ReadableSpan, ctx: RolloutContext) -> Span:
    """An OTel span as an agl Span of ``ctx``'s attempt, with canonical LLM keys when it is a model call."""
    sc_ctx = span.get_span_context()
    assert sc_ctx is not None
    attributes = _attrs(span.attributes)
    attributes.update(normalize_openinference(attributes))
    if ctx.agent_name and sc.AGENT_NAME not in attributes:
        attributes[sc.AGENT_NAME] = ctx.agent_name
    return Span(
        rollout_id=ctx.rollout_id,
        attempt_id=ctx.attempt_id,
        trace_id=format(sc_ctx.trace_id, "032x"),
        span_id=format(sc_ctx.span_id, "016x"),
        parent_id=format(span.parent.span_id, "016x") if span.parent is not None else None,
        name=span.name,
        kind=_KINDS.get(span.kind.value, SpanKind.INTERNAL),
        start_time_ns=span.start_time or 0,
        end_time_ns=max(span.end_time or 0, span.start_time or 0),
        attributes=attributes,
        events=[
            SpanEvent(name=e.name, time_ns=e.timestamp, attributes=_attrs(e.attributes)) for e in span.events
        ],
        links=[
            SpanLink(
                trace_id=format(link.context.trace_id, "032x"),
                span_id=format(link.context.span_id, "016x"),
                attributes=_attrs(link.attributes),
            )
            for link in span.links
        ],
        status=SpanStatus(
            code=_STATUS.get(span.status.status_code.value, StatusCode.UNSET),
            description=span.status.description,
        ),
        resource=_attrs(span.resource.attributes),
    )


class RolloutSpanProcessor(SpanProcessor):
    """Files every finished span into the buffer of the rollout that was active when it started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[int, RolloutContext] = {}
        self.converted = 0

    def on_start(self, span: SdkSpan, parent_context: Context | None = None) -> None:
        ctx = current_rollout(required=False)
        if ctx is None:
            return
        span.set_attribute(sc.ROLLOUT_ID, ctx.rollout_id)
        span.set_attribute(sc.ATTEMPT_ID, ctx.attempt_id)
        agent = current_agent()
        if agent is not None:  # agl.agent_scope: spans started inside belong to that agent
            span.set_attribute(sc.AGENT_NAME, agent)
        with self._lock:
            self._open[span.get_span_context().span_id] = ctx

    def on_end(self, span: ReadableSpan) -> None:
        span_context = span.get_span_context()
        if span_context is None:
            return
        with self._lock:
            ctx = self._open.pop(span_context.span_id, None)
        if ctx is None:
            return  # started outside any rollout
        ctx.buffer.add(functools.partial(to_agl_span, span, ctx))
        self.converted += 1

    def shutdown(self) -> None:
        with self._lock:
            self._open.clear()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


_provider_lock = threading.Lock()
_provider: TracerProvider | None = None
_processor = RolloutSpanProcessor()


def tracer_provider() -> TracerProvider:
    """agl's own TracerProvider, created once; it does not replace the application's global provider."""
    global _provider
    with _provider_lock:
        if _provider is None:
            from opentelemetry.sdk.resources import Resource

            _provider = TracerProvider(resource=Resource.create({"service.name": "agl-agent"}))
            _provider.add_span_processor(_processor)
        return _provider


def span_processor() -> RolloutSpanProcessor:
    return _processor
