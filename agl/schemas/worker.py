"""Workers: the runner processes that claim rollouts."""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import Field

from agl.schemas._base import WireModel


class WorkerStatus(str, Enum):
    IDLE = "idle"
    BUSY = "busy"
    OFFLINE = "offline"


class Worker(WireModel):
    """A runner as the store last saw it."""

    worker_id: str
    status: WorkerStatus = WorkerStatus.IDLE
    last_heartbeat_at: float | None = None
    current_rollout_id: str | None = None
    current_attempt_id: str | None = None
    host: dict[str, Any] = Field(default_factory=dict)
