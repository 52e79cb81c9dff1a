"""Attempts: one try of a rollout by one worker."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import Field

from agl.schemas._base import WireModel
from agl.schemas.rollout import Rollout


class AttemptStatus(str, Enum):
    """Lifecycle of an attempt; ``timeout`` and ``unresponsive`` are set by the store's watchdog."""

    PREPARING = "preparing"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    TIMEOUT = "timeout"
    UNRESPONSIVE = "unresponsive"

    @property
    def is_terminal(self) -> bool:
        return self not in (AttemptStatus.PREPARING, AttemptStatus.RUNNING)


class Attempt(WireModel):
    """One try of a rollout; ``attempt_number`` counts from 1."""

    attempt_id: str
    rollout_id: str
    attempt_number: int
    worker_id: str | None = None
    status: AttemptStatus = AttemptStatus.PREPARING
    started_at: float
    ended_at: float | None = None
    last_heartbeat_at: float | None = None
    error: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class AttemptedRollout(WireModel):
    """A rollout handed to a worker together with the attempt it must report under."""

    rollout: Rollout
    attempt: Attempt
