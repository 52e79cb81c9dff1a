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
from collections import OrderedDict
from collections.abc import Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from pydantic import BaseModel

from agl import semconv as sc
from agl.schemas import Span, SpanEvent, SpanKind, SpanLink, SpanStatus, StatusCode
from agl.schemas._base import MAX_JSON_DEPTH, _fine
from agl.tracer.context import RolloutContext, current_agent, current_rollout
from agl.tracer.normalize import normalize_openinference

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import Span as SdkSpan

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)

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
    return _parse_json_keys({k: list(v) if v.__class__ is tuple else v for k, v in _plain(raw).items()})


def _parse_json_keys(out: dict[str, Any]) -> dict[str, Any]:
    for key in JSON_KEYS.intersection(out):  # a few keys at most; a span may carry hundreds
        value = out[key]
        if isinstance(value, str):
            try:
                out[key] = json.loads(value)
            except ValueError:
                pass
    return out


def _plain(raw: Any) -> Mapping[str, Any]:
    """OTel attributes as the plain dict under the SDK's ``BoundedAttributes`` when there is one.

    ``BoundedAttributes`` serves each key through a Python ``__getitem__``; the dict under it holds the
    same values, and the span has ended, so nothing writes to it any more.
    """
    plain = getattr(raw, "_dict", None)
    if plain.__class__ is dict or plain.__class__ is OrderedDict:
        return cast("dict[str, Any]", plain)
    return cast("Mapping[str, Any]", raw or {})


_SCALARS = frozenset({str, int, float, bool})
_FLAT = _SCALARS | {tuple}
_is_tuple = tuple.__instancecheck__


def _flat_json(raw: Any) -> dict[str, Any] | None:
    """OTel attributes as JSON values, when they are what ``check_json`` accepts; else None (use :func:`_attrs`).

    OTel attribute values are text, bools, numbers or flat tuples of them. After a look at the exact
    types, orjson (in C) refuses what JSON cannot keep exactly: integers beyond 64 bits and unpaired
    surrogates; NaN and infinities come out as ``null``, so output holding ``null`` anywhere (even
    inside a string) goes the slow way, as does any value of another exact type. Half the cost of
    ``check_json``'s walk.
    """
    plain = _plain(raw)
    values = plain.values()
    kinds = set(map(type, values))
    if not kinds <= _FLAT:
        return None
    if tuple in kinds and not set(map(type, chain.from_iterable(filter(_is_tuple, values)))) <= _SCALARS:
        return None
    try:
        if b"null" in orjson.dumps(plain, option=orjson.OPT_PASSTHROUGH_SUBCLASS):
            return None
    except orjson.JSONEncodeError:  # a key that is no exact str, a 65-bit integer, a lone surrogate
        return None
    return {k: list(v) if v.__class__ is tuple else v for k, v in plain.items()}


_set = object.__setattr__
_SPAN_SET = frozenset(Span.model_fields) - {"sequence_id"}  # the fields the validating path is given
_STATUS_SET = frozenset({"code", "description"})


def _built(cls: type[M], values: dict[str, Any], given: frozenset[str]) -> M:
    """``cls`` holding ``values`` (every field, in field order) unvalidated, as ``model_construct`` builds it.

    ``given`` is the fields-set the validating path records. Only for values this module made and checked:
    ``model_construct`` itself costs as much as validating a small span.
    """
    model = cls.__new__(cls)
    _set(model, "__dict__", values)
    _set(model, "__pydantic_fields_set__", set(given))
    _set(model, "__pydantic_extra__", None)
    _set(model, "__pydantic_private__", None)
    return model


def _events_links(span: ReadableSpan) -> tuple[list[SpanEvent], list[SpanLink]]:
    events = [
        SpanEvent(name=e.name, time_ns=e.timestamp, attributes=_attrs(e.attributes)) for e in span.events
    ]
    links = [
        SpanLink(
            trace_id=format(link.context.trace_id, "032x"),
            span_id=format(link.context.span_id, "016x"),
            attributes=_attrs(link.attributes),
        )
        for link in span.links
    ]
    return events, links


def to_agl_span(span: ReadableSpan, ctx: RolloutContext) -> Span:
    """An OTel span as an agl Span of ``ctx``'s attempt, with canonical LLM keys when it is a model call.

    The common span (flat attributes of plain values, no events or links) is checked in one pass and
    built without pydantic's validation, which was most of its cost; anything else is validated. Either
    way the result equals ``Span(...)`` of the same fields (tests pin both paths).
    """
    sc_ctx = span.get_span_context()
    assert sc_ctx is not None
    raw = getattr(span, "_attributes", None)  # ReadableSpan.attributes wraps it in a mappingproxy
    flat = _flat_json(span.attributes if raw is None else raw)
    attributes = _attrs(span.attributes) if flat is None else flat
    fast = flat is not None
    parsed = JSON_KEYS.intersection(attributes)
    if parsed:
        _parse_json_keys(attributes)
    extra = normalize_openinference(attributes)
    attributes.update(extra)
    if parsed or extra:  # values parsed from JSON text may be anything: check them as the model would
        fast = fast and _fine({k: attributes[k] for k in (*parsed, *extra)}, MAX_JSON_DEPTH)
    if ctx.agent_name and sc.AGENT_NAME not in attributes:
        attributes[sc.AGENT_NAME] = ctx.agent_name
    resource = _flat_json(span.resource.attributes)
    fast = fast and resource is not None and not span.events and not span.links
    fast = fast and span.name.__class__ is str and "\x00" not in span.name
    code = _STATUS.get(span.status.status_code.value, StatusCode.UNSET)
    description = span.status.description
    start = span.start_time or 0
    fields: dict[str, Any] = {
        "rollout_id": ctx.rollout_id,
        "attempt_id": ctx.attempt_id,
        "trace_id": format(sc_ctx.trace_id, "032x"),
        "span_id": format(sc_ctx.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent is not None else None,
        "name": span.name,
        "kind": _KINDS.get(span.kind.value, SpanKind.INTERNAL),
        "start_time_ns": start,
        "end_time_ns": max(span.end_time or 0, start),
        "attributes": attributes,
    }
    if fast and (description is None or description.__class__ is str):
        fields["events"], fields["links"] = [], []
        fields["status"] = _built(SpanStatus, {"code": code, "description": description}, _STATUS_SET)
        fields["resource"] = resource
        fields["sequence_id"] = None
        return _built(Span, fields, _SPAN_SET)
    fields["events"], fields["links"] = _events_links(span)
    fields["status"] = SpanStatus(code=code, description=description)
    fields["resource"] = _attrs(span.resource.attributes)
    return Span(**fields)


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
        ids = {sc.ROLLOUT_ID: ctx.rollout_id, sc.ATTEMPT_ID: ctx.attempt_id}
        agent = current_agent()
        if agent is not None:  # agl.agent_scope: spans started inside belong to that agent
            ids[sc.AGENT_NAME] = agent
        span.set_attributes(ids)  # one call: each takes the span's lock and cleans its values
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
