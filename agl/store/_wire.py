"""Request bodies of the store's HTTP API: one pydantic model per route that takes a body."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

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


class PageQuery(WireModel):
    limit: int = Field(100, ge=1, le=10_000)
    cursor: str | None = None


class WorkerPatch(_JsonChecked):
    status: WorkerStatus | None = None
    host: dict[str, Any] | None = None


class WorkerQuery(WireModel):
    status: list[WorkerStatus] | None = None
    limit: int = Field(100, ge=1, le=10_000)
    cursor: str | None = None
