"""The calls every runner makes per rollout, answered without FastAPI's per-request machinery.

FastAPI resolves dependencies, validates and serializes through several layers on each request,
about 130 µs a call: a fifth of the server's CPU when runners keep it busy. A hot route
parses with the same wire model, runs the same call and writes the same body and errors. FastAPI
still declares these routes, so they stay in ``/openapi.json``; a test checks both paths answer alike.
Two differences, both lenient: a body sent without a JSON Content-Type is still read, and bad JSON is
reported without FastAPI's byte offset as the field.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, TypeAdapter, ValidationError

from agl import errors
from agl.store._http_errors import agl_error, validation_error

# (path parameters, parsed body or None, Idempotency-Key or None) -> the answer
HotCall = Callable[[dict[str, str], Any, "str | None"], Awaitable[Any]]
_MISSING_BODY = [{"type": "missing", "loc": ("body",), "msg": "Field required"}]


@dataclass(frozen=True)
class HotRoute:
    method: str
    path: str  # ``{name}`` marks a path parameter, as in FastAPI
    body: type[BaseModel] | None
    answer: TypeAdapter[Any]
    call: HotCall
    #: a faster parser of valid bodies: the body, or None to validate with ``body`` (which names problems)
    fast_parse: Callable[[bytes], BaseModel | None] | None = None


class HotRoutes:
    """Matches a request to a hot route, then parses, calls and answers it as plain ASGI."""

    def __init__(self, routes: Sequence[HotRoute]) -> None:
        self._exact: dict[tuple[str, str], HotRoute] = {}
        self._patterns: list[tuple[str, re.Pattern[str], HotRoute]] = []
        for route in routes:
            if "{" in route.path:
                regex = re.compile(re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(route.path)))
                self._patterns.append((route.method, regex, route))
            else:
                self._exact[(route.method, route.path)] = route

    def match(self, scope: dict[str, Any]) -> tuple[HotRoute, dict[str, str]] | None:
        method, path = scope["method"], scope["path"]
        route = self._exact.get((method, path))
        if route is not None:
            return route, {}
        for wanted, regex, route in self._patterns:
            if wanted == method and (found := regex.fullmatch(path)) is not None:
                return route, found.groupdict()
        return None

    async def serve(
        self, route: HotRoute, params: dict[str, str], scope: dict[str, Any], receive: Any, send: Any
    ) -> None:
        raw = await _read_body(receive)
        try:
            body = None
            if route.body is not None:
                if not raw:
                    raise _Invalid(_MISSING_BODY)
                body = _fast_parse(route, raw)
                if body is None:
                    body = route.body.model_validate_json(raw)
            answer = await route.call(params, body, _header(scope, b"idempotency-key"))
        except ValidationError as exc:
            status, problem = validation_error(exc.errors())
        except _Invalid as exc:
            status, problem = validation_error(exc.problems)
        except errors.AglError as exc:
            status, problem = agl_error(exc)
        else:
            await _respond(send, 200, route.answer.dump_json(answer))
            return
        await _respond(send, status, orjson.dumps(problem))


class _Invalid(Exception):
    def __init__(self, problems: list[dict[str, Any]]) -> None:
        self.problems = problems


def _fast_parse(route: HotRoute, raw: bytes) -> BaseModel | None:
    """The route's fast parse of the body, or None: none, declined, or (a bug) failed, when the model
    parses it instead, so that an answer never depends on the shortcut."""
    if route.fast_parse is None:
        return None
    try:
        return route.fast_parse(raw)
    except Exception:
        return None


async def _read_body(receive: Any) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key == name:
            return bytes(value).decode("latin-1")
    return None


async def _respond(send: Any, status: int, payload: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
