"""Backend-independent pieces of the store: input coercion, record construction, equality checks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from agl.errors import ConflictError, InvalidSpanError, StoreError
from agl.schemas import (
    Attempt,
    AttemptStatus,
    Resource,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Span,
    new_id,
)
from agl.schemas._base import check_json
from agl.schemas.span import MAX_SEQUENCE_ID


def describe_validation_error(exc: ValidationError) -> str:
    """``field.path: message`` for each problem pydantic found, joined on one line."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def coerce_spans(spans: Sequence[Span | dict[str, Any]]) -> list[Span]:
    """Validate a batch; one bad span rejects the batch with a message naming it and its field."""
    out: list[Span] = []
    for index, span in enumerate(spans):
        if not isinstance(span, Span):
            try:
                span = Span.model_validate(span)
            except ValidationError as exc:
                raise InvalidSpanError(
                    f"span {index} of the batch is malformed: {describe_validation_error(exc)}"
                ) from exc
        if span.sequence_id is not None and span.sequence_id > MAX_SEQUENCE_ID:
            raise InvalidSpanError(f"span {index} of the batch: {sequence_id_problem(span.sequence_id)}")
        out.append(span)
    return out


def sequence_id_problem(value: int) -> str:
    return (
        f"sequence_id {value} is above {MAX_SEQUENCE_ID} (2**62), the most a client may choose, so "
        "that later ids of the rollout fit in 64 bits; leave it out and the store assigns one"
    )


def coerce_rollout_creates(requests: Sequence[RolloutCreate | dict[str, Any]]) -> list[RolloutCreate]:
    out: list[RolloutCreate] = []
    for index, req in enumerate(requests):
        if isinstance(req, RolloutCreate):
            out.append(req)
            continue
        try:
            out.append(RolloutCreate.model_validate(req))
        except ValidationError as exc:
            raise StoreError(
                f"rollout {index} of the batch is malformed: {describe_validation_error(exc)}"
            ) from exc
    return out


def checked_json(value: Any, field: str) -> Any:
    """``value`` when every backend can store it as JSON; else StoreError naming the field and problem."""
    if value is None:
        return value
    try:
        return check_json(value, field)
    except ValueError as exc:
        raise StoreError(str(exc)) from exc


_RESOURCES: TypeAdapter[dict[str, Resource]] = TypeAdapter(dict[str, Resource])


def coerce_resources(resources: Mapping[str, Resource | dict[str, Any]]) -> dict[str, Resource]:
    """Validate a named-resources mapping (dicts are parsed by their ``resource_type``)."""
    try:
        return _RESOURCES.validate_python(dict(resources))
    except ValidationError as exc:
        raise StoreError(f"resources are malformed: {describe_validation_error(exc)}") from exc


def new_rollout(req: RolloutCreate, resources_id: str | None, now: float, status: RolloutStatus) -> Rollout:
    return Rollout(
        rollout_id=req.rollout_id or new_id("ro"),
        input=req.input,
        mode=req.mode,
        status=status,
        resources_id=resources_id,
        group_id=req.group_id,
        metadata=dict(req.metadata),
        retry=req.retry,
        created_at=now,
        updated_at=now,
    )


def new_attempt(rollout: Rollout, worker_id: str | None, now: float) -> Attempt:
    return Attempt(
        attempt_id=new_id("at"),
        rollout_id=rollout.rollout_id,
        attempt_number=rollout.num_attempts + 1,
        worker_id=worker_id,
        status=AttemptStatus.PREPARING,
        started_at=now,
    )


def check_same_request(existing: Rollout, req: RolloutCreate) -> Rollout:
    """Idempotent re-enqueue: equal content returns the stored rollout; anything else is a conflict."""
    same = (
        existing.input == req.input
        and existing.mode == req.mode
        and existing.group_id == req.group_id
        and existing.retry == req.retry
        and (req.resources_id is None or req.resources_id == existing.resources_id)
    )
    if not same:
        raise ConflictError(
            f"rollout {existing.rollout_id} already exists with different content; "
            "choose a new rollout_id or resend the original request",
            rollout_id=existing.rollout_id,
        )
    return existing


def json_dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


def json_loads(text: str | bytes) -> Any:
    return orjson.loads(text)
