"""Rollouts: one run of the agent on one task input, queued, attempted, finished."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import Field, ValidationInfo, field_validator

from agl.schemas._base import WireModel, check_json, check_no_nul


class RolloutStatus(str, Enum):
    """Lifecycle of a rollout; transitions live in ``agl.store.states``."""

    QUEUING = "queuing"
    PREPARING = "preparing"
    RUNNING = "running"
    REQUEUING = "requeuing"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in (RolloutStatus.SUCCEEDED, RolloutStatus.FAILED, RolloutStatus.CANCELLED)

    @property
    def is_queued(self) -> bool:
        return self in (RolloutStatus.QUEUING, RolloutStatus.REQUEUING)


_FAILURE_KINDS = frozenset({"failed", "timeout", "unresponsive"})


class RetryConfig(WireModel):
    """How long an attempt may take and which failures earn another attempt."""

    max_attempts: int = Field(1, ge=1, description="Attempts before the rollout fails for good.")
    timeout_s: float | None = Field(None, gt=0, description="Wall-clock limit of one attempt.")
    heartbeat_timeout_s: float | None = Field(
        None, gt=0, description="An attempt with no heartbeat or span for this long is unresponsive."
    )
    retry_on: list[str] = Field(
        default_factory=lambda: ["timeout", "unresponsive"],
        description="Attempt failure kinds that requeue: any of failed, timeout, unresponsive.",
    )

    @field_validator("retry_on")
    @classmethod
    def _known_kinds(cls, value: list[str]) -> list[str]:
        if not _FAILURE_KINDS.issuperset(value):  # a set test: every rollout read runs it
            unknown = sorted(set(value) - _FAILURE_KINDS)
            raise ValueError(
                f"retry_on has unknown failure kinds {unknown}; use failed, timeout, unresponsive"
            )
        return value


class RolloutCreate(WireModel):
    """What a caller sends to enqueue or start a rollout; ``rollout_id`` makes retried writes idempotent."""

    input: Any = None
    mode: str = "train"
    resources_id: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    rollout_id: str | None = None

    @field_validator("input", "metadata")
    @classmethod
    def _storable(cls, v: Any, info: ValidationInfo) -> Any:
        """Rejected here, not at read time: an unreadable rollout would block dequeue for every worker."""
        return check_json(v, info.field_name or "value")

    @field_validator("rollout_id", "mode", "group_id", "resources_id")
    @classmethod
    def _no_nul(cls, v: str | None, info: ValidationInfo) -> str | None:
        return check_no_nul(v, info.field_name or "id")


class Rollout(WireModel):
    """A task as stored: its input, status and the resources version it runs with."""

    rollout_id: str
    input: Any = None
    mode: str = "train"
    status: RolloutStatus = RolloutStatus.QUEUING
    resources_id: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    retry: RetryConfig = Field(default_factory=RetryConfig)
    num_attempts: int = 0
    created_at: float
    updated_at: float
    started_at: float | None = None
    ended_at: float | None = None
