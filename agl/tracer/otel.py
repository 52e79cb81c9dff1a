"""The OpenTelemetry side of the tracer: one TracerProvider whose processor files spans under their rollout.

``RolloutSpanProcessor`` notes the active rollout when a span starts and, when it ends, converts it
to an ``agl.schemas.Span`` (canonical LLM keys added) in that rollout's buffer. It never blocks or
raises into the agent: a failure is logged once and counted. A span it files keeps its attributes in a
``PlainAttributes``: the SDK's store, with a quicker bulk set that also checks them for the conversion.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Collection, Mapping
from itertools import chain
from typing import TYPE_CHECKING, Any, TypeVar, cast

import orjson
from opentelemetry.attributes import BoundedAttributes
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
_GIVEN = _FLAT | {list}  # what a bulk set may hand over for the quick path
_TEXT = frozenset({str})
_is_list = list.__instancecheck__
_is_tuple = tuple.__instancecheck__
_is_float = float.__instancecheck__
_INF = float("inf")


def _finite(values: Collection[Any]) -> bool:
    """True unless a float among ``values`` is NaN or an infinity (an overflowing sum says False too: slower only)."""
    total = sum(filter(_is_float, values), 0.0)
    return -_INF < total < _INF


def _json_keeps(given: Mapping[str, Any], kinds: set[type], items: list[Any], item_kinds: set[type]) -> bool:
    """True when JSON keeps ``given`` exactly, the exact types of its values (``kinds``) and of its lists' and
    tuples' ``items`` (``item_kinds``) checked: no NaN or infinity, and orjson (in C) takes it, so no integer
    beyond 64 bits and no unpaired surrogate."""
    if float in kinds and not _finite(given.values()) or float in item_kinds and not _finite(items):
        return False
    try:
        orjson.dumps(given)
    except orjson.JSONEncodeError:
        return False
    return True


def _plain_json(held: Mapping[str, Any]) -> bool:
    """True when ``held`` has exact str keys and exact str, int, float or bool values or tuples of them, all
    kept exactly by JSON (``check_json`` takes them): what :class:`PlainAttributes` keeps track of."""
    values = held.values()
    kinds = set(map(type, values))
    if not kinds <= _FLAT or not set(map(type, held)) <= _TEXT:
        return False
    items = list(chain.from_iterable(filter(_is_tuple, values))) if tuple in kinds else []
    item_kinds = set(map(type, items))
    return item_kinds <= _SCALARS and _json_keeps(held, kinds, items, item_kinds)


def _json_copy(held: Mapping[str, Any]) -> dict[str, Any]:
    """Flat attributes as JSON values: a new dict, tuples as lists."""
    return {k: list(v) if v.__class__ is tuple else v for k, v in held.items()}


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
    return _json_copy(plain)


#: the SDK internals ``PlainAttributes`` builds on; a release without them keeps the SDK's own class
_SDK_FITS = all(hasattr(BoundedAttributes, name) for name in ("_set_items", "_setitem_locked"))
_INSTANCE_FIELDS = {"_dict", "_lock", "_immutable", "max_value_len", "maxlen"}


class PlainAttributes(BoundedAttributes):
    """A span's ``BoundedAttributes`` with a quicker bulk set for plain values; what it stores is the SDK's.

    The SDK cleans each value with a recursive Python call (half the CPU of a span of 80 attributes);
    a dict of exact text, numbers, bools and flat lists of them needs none of it, so such a set stores
    the same values (lists become tuples) in the same order at C speed; anything else goes to the SDK.
    While ``plain`` (what it holds passes :func:`_plain_json`), :meth:`json` needs no look at the values.
    """

    #: True while what it holds passes :func:`_plain_json`
    plain: bool
    #: keys that hold or held a tuple: while ``plain``, every key holding one is among them
    sequences: set[str]

    def __init__(
        self,
        maxlen: int | None = None,
        attributes: Mapping[str, Any] | None = None,
        immutable: bool = True,
        max_value_len: int | None = None,
    ) -> None:
        self.plain, self.sequences = True, set()
        super().__init__(maxlen, attributes, immutable, max_value_len)

    @classmethod
    def adopt(cls, attributes: Any) -> None:
        """Make the SDK's ``attributes`` of a span just started one of these (the same object, its class swapped)."""
        if (
            attributes.__class__ is BoundedAttributes
            and _SDK_FITS
            and vars(attributes).keys() >= _INSTANCE_FIELDS
        ):
            held = attributes._dict
            plain = _plain_json(held)
            attributes.__class__ = cls
            adopted = cast("PlainAttributes", attributes)
            adopted.plain = plain
            adopted.sequences = {k for k, v in held.items() if v.__class__ is tuple}

    def json(self) -> dict[str, Any] | None:
        """What it holds as JSON values (a new dict, tuples as lists) when ``plain``, else None."""
        if not self.plain:
            return None
        out = dict(self._dict)
        for key in self.sequences:
            value = out.get(key)
            if value.__class__ is tuple:
                out[key] = list(value)
        return out

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        if self.plain and not (value.__class__ in _SCALARS and _plain_json({key: value})):
            self.plain = False

    def _set_items(self, attributes: Mapping[str, Any]) -> None:
        if (
            attributes.__class__ is not dict
            or self._immutable
            or self.max_value_len is not None  # text may need cutting
            or self.maxlen == 0
        ):
            self._sdk_set_items(attributes)
            return
        values = attributes.values()
        kinds = set(map(type, values))
        items: list[Any] = []
        if list in kinds:
            items.extend(chain.from_iterable(filter(_is_list, values)))
        if tuple in kinds:
            items.extend(chain.from_iterable(filter(_is_tuple, values)))
        item_kinds = set(map(type, items))
        if (
            not kinds <= _GIVEN
            or not item_kinds <= _SCALARS
            or not set(map(type, attributes)) <= _TEXT
            or "" in attributes
        ):
            self._sdk_set_items(attributes)
            return
        if self.plain and not _json_keeps(attributes, kinds, items, item_kinds):  # while the values are hot
            self.plain = False
        sequences = []
        if list in kinds or tuple in kinds:
            given, attributes = attributes, dict(attributes)
            for key, value in given.items():
                if value.__class__ is list:
                    attributes[key] = tuple(value)
                    sequences.append(key)
                elif value.__class__ is tuple:
                    sequences.append(key)
        # as the SDK's: the oldest key goes first when full, a key set again moves to the end
        with self._lock:
            held = self._dict
            if (self.maxlen is None or len(held) + len(attributes) <= self.maxlen) and held.keys().isdisjoint(
                attributes
            ):
                held.update(attributes)
            else:
                for key, value in attributes.items():
                    self._setitem_locked(key, value)
            self.sequences.update(sequences)

    def _sdk_set_items(self, attributes: Mapping[str, Any]) -> None:
        self.plain = False
        super()._set_items(attributes)


_resource_checked: Any = None  # the last resource whose attributes passed _flat_json


def _resource_json(resource: Any) -> dict[str, Any] | None:
    """Resource attributes as :func:`_flat_json` gives them, checked once per resource: a provider has one, and
    a resource never changes."""
    global _resource_checked
    if resource is _resource_checked:
        return _json_copy(_plain(resource.attributes))
    flat = _flat_json(resource.attributes)
    if flat is not None:
        _resource_checked = resource
    return flat


def _bare(span: ReadableSpan) -> bool:
    """True when the span has no events and no links: the SDK's lists counted, not copied (``span.events``)."""
    events = span._events if hasattr(span, "_events") else span.events
    links = span._links if hasattr(span, "_links") else span.links
    return not events and not links


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
    flat = raw.json() if raw.__class__ is PlainAttributes else None  # checked as they were set
    if flat is None:
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
    resource = _resource_json(span.resource)
    fast = fast and resource is not None and _bare(span)
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
        PlainAttributes.adopt(getattr(span, "_attributes", None))
        span.set_attributes(ids)  # one call: each takes the span's lock
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
