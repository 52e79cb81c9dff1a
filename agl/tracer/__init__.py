"""The tracer: the active rollout context, OpenTelemetry capture and auto-instrumentation."""

from agl.tracer.context import RolloutContext, SpanBuffer, current_rollout, rollout_context
from agl.tracer.instrument import instrument, uninstrument
from agl.tracer.otel import span_processor, tracer_provider

__all__ = [
    "RolloutContext",
    "SpanBuffer",
    "current_rollout",
    "instrument",
    "rollout_context",
    "span_processor",
    "tracer_provider",
    "uninstrument",
]
