"""Request bodies of the store's HTTP API: one pydantic model per route that takes a body."""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import Field, ValidationError, ValidationInfo, field_validator

from agl.schemas import AttemptStatus, Resource, RolloutCreate, RolloutStatus, Span, WireModel, WorkerStatus
from agl.schemas._base import check_json, check_no_nul
from agl.schemas.span import MAX_SEQUENCE_ID
from agl.store._logic import sequence_id_problem

API_PREFIX = "/v1/agl"
MAX_WAIT_S = 30.0


class _NoNul(WireModel):
    """A body whose ids end up in text columns, which PostgreSQL refuses with a NUL inside."""

    @field_validator("worker_id", "resources_id", "parent_id", check_fields=False)
    @classmethod
    def _no_nul(cls, v: str | None, info: ValidationInfo) -> str | None:
        return check_no_nul(v, info.field_name or "id")


class EnqueueRequest(WireModel):
    rollouts: list[RolloutCreate] = Field(min_length=1, max_length=10_000)


class DequeueRequest(_NoNul):
    worker_id: str = Field(min_length=1)


class StartRequest(_NoNul):
    rollout: RolloutCreate
    worker_id: str | None = None


class _JsonChecked(WireModel):
    """A body whose free-form ``metadata`` / ``host`` must be JSON every backend stores and reads back."""

    @field_validator("metadata", "host", check_fields=False)
    @classmethod
    def _storable(cls, v: Any, info: ValidationInfo) -> Any:
        return check_json(v, info.field_name or "metadata")


class RolloutPatch(_JsonChecked):
    status: RolloutStatus | None = None
    metadata: dict[str, Any] | None = None


class RolloutQuery(WireModel):
    status: list[RolloutStatus] | None = None
    mode: str | None = None
    group_id: str | None = None
    rollout_ids: list[str] | None = None
    order_by: Literal["created_at", "updated_at", "rollout_id"] = "created_at"
    descending: bool = False
    limit: int = Field(100, ge=1, le=10_000)
    cursor: str | None = None


class WaitRequest(WireModel):
    rollout_ids: list[str] = Field(min_length=1, max_length=100_000)
    timeout_s: float | None = Field(None, ge=0)


class AttemptPatch(_JsonChecked):
    status: AttemptStatus | None = None
    error: str | None = None
    metadata: dict[str, Any] | None = None


class AttemptQuery(WireModel):
    rollout_id: str | None = None
    status: list[AttemptStatus] | None = None
    worker_id: str | None = None
    limit: int = Field(100, ge=1, le=10_000)
    cursor: str | None = None


class SpansRequest(WireModel):
    spans: list[Span] = Field(max_length=100_000)

    @field_validator("spans")
    @classmethod
    def _sequence_ids_fit(cls, spans: list[Span]) -> list[Span]:
        for index, span in enumerate(spans):
            if span.sequence_id is not None and span.sequence_id > MAX_SEQUENCE_ID:
                raise ValueError(f"spans.{index}.{sequence_id_problem(span.sequence_id)}")
        return spans


class _ParsedSpan(Span):
    """A span of a body orjson parsed: its attributes and resource need no ``check_json`` (see
    :func:`parse_spans_request`)."""

    @field_validator("attributes", "resource")
    @classmethod
    def _json_values(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        return v


class _ParsedSpansRequest(SpansRequest):
    spans: list[_ParsedSpan] = Field(max_length=100_000)  # type: ignore[assignment]


#: a body's nesting below which no span's attributes or resource nest deeper than ``check_json`` allows:
#: ``{"spans": [{"attributes": {`` opens four levels, and check_json accepts 63 more
_MAX_BODY_DEPTH = 4 + 63
_BIG = float(
    2**63
)  # no float from orjson is this large but where the JSON says 1e19 (or an integer that long)


def parse_spans_request(raw: bytes) -> SpansRequest | None:
    """``SpansRequest.model_validate_json(raw)`` in half the time when the body is valid; else None
    (the caller then validates it the usual way, which names the problem).

    What ``check_json`` rejects in attributes cannot come out of orjson: it refuses NaN, infinities,
    lone surrogates and a number that overflows a double, and has no other types than JSON's. What
    remains is checked here: nesting, and integers beyond 64 bits, which orjson reads as floats (so
    a body with a float of that size goes the usual way).
    """
    try:
        data = orjson.loads(raw)
        if not _plain(data, _MAX_BODY_DEPTH):
            return None
        parsed = _ParsedSpansRequest.model_validate(data)
    except (orjson.JSONDecodeError, ValidationError):
        return None
    spans: list[Span] = list(parsed.spans)
    for span in spans:
        span.__class__ = Span  # what it is, validated: the subclass only skipped a check; a copy costs more
    return SpansRequest.model_construct(parsed.model_fields_set, spans=spans)


def _plain(value: Any, limit: int) -> bool:
    """True when no container in ``value`` is ``limit`` levels deep (``value`` itself is level 1) and
    no float is as large as 2**63."""
    if type(value) is not dict and type(value) is not list:
        return True  # not a body at all: validation says so
    level = [value]
    for _ in range(limit):
        nested = []
        for container in level:
            for item in container.values() if type(container) is dict else container:
                kind = type(item)
                if kind is dict or kind is list:
                    nested.append(item)
                elif kind is float and not -_BIG < item < _BIG:
                    return False
        if not nested:
            return True
        level = nested
    return False


class StoredSpan(WireModel):
    """What ``POST /spans`` answers per newly stored span (duplicates are left out)."""

    attempt_id: str
    span_id: str
    sequence_id: int

    @classmethod
    def of(cls, span: Span) -> StoredSpan:
        return cls(attempt_id=span.attempt_id, span_id=span.span_id, sequence_id=span.sequence_id or 0)


class DigestQuery(WireModel):
    rollout_ids: list[str] | None = None
    after: int = Field(0, ge=0)
    limit: int = Field(10_000, ge=1, le=10_000)


class SpanQuery(WireModel):
    rollout_id: str | None = None
    attempt_id: str | None = None
    name: str | None = None
    limit: int = Field(1000, ge=1, le=10_000)
    cursor: str | None = None


class ResourcesRequest(_JsonChecked, _NoNul):
    resources: dict[str, Resource]
    resources_id: str | None = None
    parent_id: str | None = None
    metadata: dict[str, Any] | None = None


class ResourcesQuery(WireModel):
    descending: bool = False
    limit: int = Field(100, ge=1, le=10_000)
    cursor: str | None = None


class WorkerPatch(_JsonChecked):
    status: WorkerStatus | None = None
    host: dict[str, Any] | None = None


class WorkerQuery(WireModel):
    status: list[WorkerStatus] | None = None
    limit: int = Field(100, ge=1, le=10_000)
    cursor: str | None = None
