"""How the store's HTTP API writes its errors: one status per ``agl.errors`` class, one body shape.

Every error body is ``{"error": {"type", "message", "field", "rollout_id", "attempt_id"}}``; the
client raises the class named by ``type`` again. Shared by the FastAPI routes and the hot routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agl import errors

ERROR_STATUS: list[tuple[type[errors.AglError], int]] = [
    (errors.NotFoundError, 404),
    (errors.StaleAttemptError, 409),
    (errors.ConflictError, 409),
    (errors.InvalidTransitionError, 409),
    (errors.InvalidSpanError, 422),
    (errors.UnauthorizedError, 401),
    (errors.StoreUnavailableError, 503),
    (errors.StoreError, 400),
    (errors.ConfigError, 400),
    (errors.AglError, 400),
]


def status_for(exc: errors.AglError) -> int:
    """The HTTP status of an agl error: the first table entry in its MRO wins."""
    for cls in type(exc).__mro__:
        for known, status in ERROR_STATUS:
            if cls is known:
                return status
    return 400


def error_body(type_name: str, message: str, **extra: Any) -> dict[str, Any]:
    return {
        "error": {"type": type_name, "message": message, **{k: v for k, v in extra.items() if v is not None}}
    }


def agl_error(exc: errors.AglError) -> tuple[int, dict[str, Any]]:
    """Status and body for an agl error raised by the store."""
    body = error_body(
        type(exc).__name__,
        exc.message,
        rollout_id=exc.rollout_id,
        attempt_id=exc.attempt_id,
        field=getattr(exc, "param", None),
    )
    return status_for(exc), body


def validation_error(problems: Sequence[Any]) -> tuple[int, dict[str, Any]]:
    """Status and body for pydantic's errors about a request body: 400 for bad JSON, else 422.

    Each problem's ``loc`` may start with ``"body"`` (FastAPI's form); the field named is the rest.
    Bad JSON names no field (FastAPI's ``loc`` holds a byte offset there, not a field).
    """
    if any(e.get("type") == "json_invalid" for e in problems):
        detail = next(e for e in problems if e.get("type") == "json_invalid")
        reason = (detail.get("ctx") or {}).get("error") or detail.get("msg")
        return 400, error_body("ValidationError", f"request body is not valid JSON: {reason}")
    fields = [".".join(str(part) for part in e.get("loc", ()) if part != "body") for e in problems]
    message = "; ".join(f"{f or '<body>'}: {e.get('msg')}" for f, e in zip(fields, problems, strict=True))
    return 422, error_body("ValidationError", message, field=(fields[0] or None) if fields else None)
