"""The rollout and attempt state machines, as data, and the pure decisions built on them.

Every status change in every backend goes through :func:`transition`; no other module compares
status strings. Policy for superseded attempts: once an attempt is terminal (succeeded, failed,
timeout, unresponsive) it never changes again. A late status update or heartbeat from it raises
:class:`~agl.errors.StaleAttemptError` and changes nothing; its late spans are still stored, under
their own attempt id, for forensics, but they move no status.
"""

from __future__ import annotations

from typing import TypeVar

from agl.errors import InvalidTransitionError
from agl.schemas import Attempt, AttemptStatus, RetryConfig, RolloutStatus

R = RolloutStatus
A = AttemptStatus

ROLLOUT_TRANSITIONS: dict[RolloutStatus, frozenset[RolloutStatus]] = {
    R.QUEUING: frozenset({R.PREPARING, R.CANCELLED}),
    R.PREPARING: frozenset({R.RUNNING, R.SUCCEEDED, R.FAILED, R.REQUEUING, R.CANCELLED}),
    R.RUNNING: frozenset({R.SUCCEEDED, R.FAILED, R.REQUEUING, R.CANCELLED}),
    R.REQUEUING: frozenset({R.PREPARING, R.FAILED, R.CANCELLED}),
    R.SUCCEEDED: frozenset(),
    R.FAILED: frozenset(),
    R.CANCELLED: frozenset(),
}

ATTEMPT_TRANSITIONS: dict[AttemptStatus, frozenset[AttemptStatus]] = {
    A.PREPARING: frozenset({A.RUNNING, A.SUCCEEDED, A.FAILED, A.TIMEOUT, A.UNRESPONSIVE}),
    A.RUNNING: frozenset({A.SUCCEEDED, A.FAILED, A.TIMEOUT, A.UNRESPONSIVE}),
    A.SUCCEEDED: frozenset(),
    A.FAILED: frozenset(),
    A.TIMEOUT: frozenset(),
    A.UNRESPONSIVE: frozenset(),
}

S = TypeVar("S", RolloutStatus, AttemptStatus)


def transition(current: S, target: S, *, rollout_id: str, attempt_id: str | None = None) -> S:
    """Return ``target`` if the table allows ``current -> target`` (or they are equal), else raise."""
    if current == target:
        return target
    table: dict = ROLLOUT_TRANSITIONS if isinstance(current, RolloutStatus) else ATTEMPT_TRANSITIONS
    if target not in table[current]:
        what = f"attempt {attempt_id}" if isinstance(current, AttemptStatus) else f"rollout {rollout_id}"
        allowed = ", ".join(sorted(s.value for s in table[current])) or "nothing (it is final)"
        raise InvalidTransitionError(
            f"{what} cannot go from {current.value} to {target.value}; from {current.value} it may go to {allowed}",
            rollout_id=rollout_id,
            attempt_id=attempt_id,
        )
    return target


def rollout_status_for_attempt(
    status: AttemptStatus, attempt_number: int, retry: RetryConfig
) -> RolloutStatus:
    """The rollout status implied by its latest attempt reaching ``status``: retries decided here."""
    if status == A.PREPARING:
        return R.PREPARING
    if status == A.RUNNING:
        return R.RUNNING
    if status == A.SUCCEEDED:
        return R.SUCCEEDED
    if status.value in retry.retry_on and attempt_number < retry.max_attempts:
        return R.REQUEUING
    return R.FAILED


def watchdog_verdict(attempt: Attempt, retry: RetryConfig, now: float) -> AttemptStatus | None:
    """``timeout`` or ``unresponsive`` if a live attempt has overrun its limits at ``now``, else None."""
    if attempt.status.is_terminal:
        return None
    return overrun(
        attempt.started_at, attempt.last_heartbeat_at, retry.timeout_s, retry.heartbeat_timeout_s, now
    )


def overrun(
    started_at: float,
    last_heartbeat_at: float | None,
    timeout_s: float | None,
    heartbeat_timeout_s: float | None,
    now: float,
) -> AttemptStatus | None:
    """The watchdog's verdict from the fields it reads (the SQL stores read them without the models)."""
    if timeout_s is not None and now - started_at > timeout_s:
        return A.TIMEOUT
    if heartbeat_timeout_s is not None and now - (last_heartbeat_at or started_at) > heartbeat_timeout_s:
        return A.UNRESPONSIVE
    return None
