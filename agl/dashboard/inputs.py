"""What the dashboard's API reads from a request (query parameters, JSON bodies), and the errors it answers
with: a bad field is a 422 naming it; an endpoint the dashboard called on the user's behalf that failed, a 502.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.requests import Request

from agl.schemas import RolloutStatus


class BadRequest(Exception):
    """A query parameter or body field the API cannot use; answered 422 naming the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


class BadGateway(Exception):
    """A model endpoint called for the user (a replay) failed; answered 502 with what it said."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def statuses(request: Request) -> list[RolloutStatus] | None:
    """The ``status`` filter: rollout statuses, comma-separated (None: any)."""
    raw = request.query_params.get("status")
    if not raw:
        return None
    known = {s.value: s for s in RolloutStatus}
    unknown = [s for s in raw.split(",") if s not in known]
    if unknown:
        raise BadRequest("status", f"unknown status {unknown}; use any of {sorted(known)}, comma-separated")
    return [known[s] for s in raw.split(",")]


def flagged(request: Request) -> bool:
    """The ``flagged`` filter: ``1`` lists only the rollouts a person flagged."""
    raw = request.query_params.get("flagged") or "0"
    if raw not in ("0", "1"):
        raise BadRequest("flagged", f"flagged must be 1 (flagged rollouts only) or 0, got {raw!r}")
    return raw == "1"


def query_float(request: Request, name: str) -> float | None:
    """A numeric filter from the query string (None when absent); anything but a finite number is a 422."""
    raw = (request.query_params.get(name) or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if value != value or value in (float("inf"), float("-inf")):
        raise BadRequest(name, f"{name} must be a number, got {raw!r}")
    return value


def query_count(request: Request, name: str, high: int = 10**15) -> int | None:
    """A count filter from the query string (None when absent); anything but a whole number within
    ``[0, high]`` is a 422."""
    raw = (request.query_params.get(name) or "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) > high:
        raise BadRequest(name, f"{name} must be a whole number from 0 to {high}, got {raw!r}")
    return int(raw)


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object. Only ``application/json`` is read: a form another site posts cannot
    send it without the browser asking first (so a page elsewhere cannot act for an open dashboard)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise BadRequest("body", f"send the body as JSON (Content-Type: application/json), got {kind!r}")
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise BadRequest("body", f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body", f"the body must be a JSON object, got {type(body).__name__}")
    return body


def text(body: dict[str, Any], name: str, *, required: bool = False) -> str | None:
    """Body field ``name`` as a non-empty string (None when absent or empty and not required)."""
    value = body.get(name)
    if value is None or value == "":
        if required:
            raise BadRequest(name, f"{name} is required")
        return None
    if not isinstance(value, str):
        raise BadRequest(name, f"{name} must be a string, got {type(value).__name__}")
    return value


def number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    """Body field ``name`` as a finite number within ``[low, high]`` (None when absent)."""
    value = body.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(name, f"{name} must be a number, got {value!r}")
    if not low <= value <= high:
        raise BadRequest(name, f"{name} must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    """Body field ``name`` as an integer within ``[low, high]`` (None when absent)."""
    value = body.get(name)
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(name, f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise BadRequest(name, f"{name} must be between {low} and {high}, got {value}")
    return value
