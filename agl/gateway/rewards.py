"""Rewards that arrive later: ``POST /v1/agl/rewards`` on the gateway, and :func:`post_reward` to call it.

A reward names its target by one of ``response_id`` (the completion id the client saw: a per-call reward,
as ``agl.emit_reward(..., response_id=...)``), ``rollout_id`` or ``session_id`` (the rollout's final
reward), minutes or days after the calls. It is recorded as ``agl.emit_reward`` records one: an
``agl.reward`` span on the target rollout's latest attempt, which the adapters and SFT's ``min_reward``
read. A final reward (by session or rollout id) also finishes an online rollout (``succeeded``), so
``SFTConfig(from_store=...)``, which reads succeeded rollouts, trains on it; the conversation's later calls
are still recorded on it. It is idempotent: the span id is derived from the ``idempotency_key`` (body field or
``Idempotency-Key`` header) or, without one, from (target, ``name``), so the same reward posted twice,
or retried after a lost reply, is stored once (the answer says ``"duplicate": true``).

Response ids are found in a bounded index of the calls this gateway recorded, else among the
``reward_scan_rollouts`` most recently created online rollouts in the store; older ones are posted by
session or rollout id. The reward is written before the answer: an unreachable store gets 503 with
``Retry-After`` (retrying is safe).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from agl import semconv as sc
from agl.errors import (
    ConflictError,
    GatewayError,
    InvalidRequestError,
    InvalidTransitionError,
    NotFoundError,
)
from agl.gateway.online import ONLINE_MODE, OnlineRollouts, session_rollout_id
from agl.gateway.validation import HTTPError
from agl.schemas import AttemptStatus, Span
from agl.store.base import LightningStore

REWARDS_PATH = "/v1/agl/rewards"
TARGETS = ("response_id", "rollout_id", "session_id")
_FIELDS = frozenset({*TARGETS, "reward", "name", "idempotency_key", "tags"})
#: how long a reward waits for recent calls (or a session's new rollout) to reach the store
_SETTLE_S = 5.0


@dataclass(frozen=True)
class RewardPost:
    """A checked reward: its value, name, target field and id, and the key that makes it idempotent."""

    reward: float
    name: str
    target: str
    target_id: str
    key: str
    tags: tuple[str, ...] = ()

    @property
    def span_id(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()[:16]


def _unprocessable(message: str, param: str) -> HTTPError:
    return HTTPError(422, message, param=param, code="invalid_value")


def parse_reward(raw: bytes, idempotency_header: str | None = None) -> RewardPost:
    """The reward a request body posts; 422 naming the field for anything wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise HTTPError(400, f"the request body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise HTTPError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise _unprocessable(f"unknown field {unknown[0]!r}; a reward takes {sorted(_FIELDS)}", unknown[0])
    value = body.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _unprocessable(f"'reward' must be a finite number, got {value!r}", "reward")
    name = body.get("name", "reward")
    if not isinstance(name, str) or not name:
        raise _unprocessable(f"'name' must be a non-empty string, got {name!r}", "name")
    given = [t for t in TARGETS if body.get(t) is not None]
    if len(given) != 1:
        which = "none" if not given else " and ".join(given)
        raise _unprocessable(
            f"give exactly one target of response_id, rollout_id or session_id; got {which}",
            given[1] if len(given) > 1 else "response_id",
        )
    target, target_id = given[0], body[given[0]]
    if not isinstance(target_id, str) or not target_id or "\x00" in target_id:
        raise _unprocessable(f"'{target}' must be a non-empty string, got {target_id!r}", target)
    key = body.get("idempotency_key", idempotency_header)
    if key is not None and (not isinstance(key, str) or not key):
        raise _unprocessable(f"'idempotency_key' must be a non-empty string, got {key!r}", "idempotency_key")
    tags = body.get("tags") or []
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise _unprocessable(f"'tags' must be a list of strings, got {tags!r}", "tags")
    return RewardPost(
        float(value), name, target, target_id, key or f"{target}\x00{target_id}\x00{name}", tuple(tags)
    )


def reward_span(post: RewardPost, rollout_id: str, attempt_id: str) -> Span:
    """The reward's span, made by ``agl.emit_reward`` itself, placed on the target's attempt."""
    from agl.emit import emit_reward

    response_id = post.target_id if post.target == "response_id" else None
    made = emit_reward(
        post.reward, primary_key=post.name, response_id=response_id, tags=post.tags, local=True
    )
    trace_id = hashlib.md5(f"{rollout_id}/{attempt_id}".encode()).hexdigest()  # the gateway's calls' trace
    return made.model_copy(
        update={
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "span_id": post.span_id,
            "trace_id": trace_id,
        }
    )


class Rewards:
    """Finds a reward's rollout and writes its span (see the module docstring).

    Args:
        settle: returns once calls finished so far are recorded (the gateway's flush).
        index_size: response ids remembered; ``scan_rollouts``: online rollouts searched beyond them.
    """

    def __init__(
        self,
        store: LightningStore,
        online: OnlineRollouts,
        settle: Callable[[], Awaitable[None]],
        *,
        index_size: int,
        scan_rollouts: int,
    ) -> None:
        self.store, self.online, self._settle = store, online, settle
        self.index_size, self.scan_rollouts = index_size, scan_rollouts
        self._responses: OrderedDict[str, tuple[str, str]] = OrderedDict()
        self.recorded = 0
        self.duplicates = 0

    def remember(self, span: Span) -> None:
        """Index a recorded call's response id (called as its span is built)."""
        response_id = span.attributes.get(sc.LLM_RESPONSE_ID)
        if isinstance(response_id, str) and response_id and self.index_size:
            self._responses[response_id] = (span.rollout_id, span.attempt_id)
            if len(self._responses) > self.index_size:
                self._responses.popitem(last=False)

    async def post(self, post: RewardPost) -> dict[str, Any]:
        """Record ``post``; the answer names where it went and whether it was a duplicate."""
        rollout_id, attempt_id = await self._target(post)
        span = reward_span(post, rollout_id, attempt_id)
        try:
            stored = await self.store.add_spans([span])
        except NotFoundError:
            raise HTTPError(
                404, f"rollout {rollout_id!r} is gone from the store", param=post.target, code="not_found"
            ) from None
        self.recorded += bool(stored)
        self.duplicates += not stored
        finished = post.target != "response_id" and await self._finish(rollout_id, attempt_id)
        return {
            "recorded": bool(stored),
            "duplicate": not stored,
            "finished": finished,
            "rollout_id": rollout_id,
            "attempt_id": attempt_id,
            "span_id": span.span_id,
            "name": post.name,
            "reward": post.reward,
        }

    async def _finish(self, rollout_id: str, attempt_id: str) -> bool:
        """Mark an unfinished online rollout succeeded (it has its final reward); True if this did."""
        rollout = await self.store.get_rollout(rollout_id)
        if rollout.mode != ONLINE_MODE or rollout.status.is_terminal:
            return False
        try:
            await self.store.update_attempt(rollout_id, attempt_id, status=AttemptStatus.SUCCEEDED)
        except (InvalidTransitionError, ConflictError):  # finished meanwhile (two rewards at once)
            return False
        return True

    async def _target(self, post: RewardPost) -> tuple[str, str]:
        if post.target == "response_id":
            found = await self._response(post.target_id)
            if found is None:
                raise HTTPError(
                    404,
                    f"unknown response_id {post.target_id!r}: no recorded call answered with it (recent "
                    f"calls and the last {self.scan_rollouts} online rollouts were searched); post by "
                    "session_id or rollout_id instead",
                    param="response_id",
                    code="response_not_found",
                )
            return found
        if post.target == "session_id":
            conversation = self.online.known(post.target_id)
            if conversation is not None:
                await _wait(conversation.ready.wait())
                if conversation.attempt_id is not None:
                    return conversation.rollout_id, conversation.attempt_id
            return await self._latest(session_rollout_id(post.target_id), post)
        return await self._latest(post.target_id, post)

    async def _latest(self, rollout_id: str, post: RewardPost) -> tuple[str, str]:
        try:
            attempts = (await self.store.query_attempts(rollout_id=rollout_id, limit=1000)).items
        except NotFoundError:
            attempts = []
        if not attempts:
            raise HTTPError(
                404,
                f"unknown {post.target} {post.target_id!r}: the store holds no rollout for it",
                param=post.target,
                code=f"{post.target.removesuffix('_id')}_not_found",
            )
        return rollout_id, max(attempts, key=lambda a: a.attempt_number).attempt_id

    async def _response(self, response_id: str) -> tuple[str, str] | None:
        found = self._responses.get(response_id)
        if found is None:
            await _wait(self._settle())  # a call answered a moment ago may still be on its way
            found = self._responses.get(response_id)
        return found or await self._scan(response_id)

    async def _scan(self, response_id: str) -> tuple[str, str] | None:
        """The call that answered ``response_id`` among the most recently created online rollouts."""
        cursor, seen = None, 0
        while seen < self.scan_rollouts:
            page = await self.store.query_rollouts(
                mode=ONLINE_MODE,
                descending=True,
                limit=min(100, self.scan_rollouts - seen),
                cursor=cursor,
            )
            for rollout in page.items:
                span_cursor = None
                while True:
                    spans = await self.store.query_spans(
                        rollout_id=rollout.rollout_id, name=sc.SPAN_LLM_CALL, cursor=span_cursor
                    )
                    for span in spans.items:
                        if span.attributes.get(sc.LLM_RESPONSE_ID) == response_id:
                            return span.rollout_id, span.attempt_id
                    span_cursor = spans.next_cursor
                    if span_cursor is None:
                        break
            seen += len(page.items)
            cursor = page.next_cursor
            if cursor is None:
                break
        return None


async def _wait(awaitable: Awaitable[Any]) -> None:
    """Wait for ``awaitable`` at most a few seconds (an unreachable store then answers for itself)."""
    try:
        await asyncio.wait_for(awaitable, _SETTLE_S)
    except asyncio.TimeoutError:
        pass


def post_reward(
    url: str,
    reward: float,
    *,
    response_id: str | None = None,
    rollout_id: str | None = None,
    session_id: str | None = None,
    name: str = "reward",
    idempotency_key: str | None = None,
    token: str | None = None,
    timeout_s: float = 30.0,
) -> dict[str, Any]:
    """Post a late reward to the gateway at ``url`` (``http://host:port``) for one target; see
    :mod:`agl.gateway.rewards`. ``token``: the reward (or admin) token, by default
    ``AGL_GATEWAY_REWARD_TOKEN``. Returns the gateway's answer (``recorded``, ``duplicate``, ``rollout_id``).

    Raises:
        InvalidRequestError: the gateway refused the reward (``param`` names the field, e.g. an unknown
            ``response_id``).
        GatewayError: the gateway is unreachable, refused the token, or its store is down (retry: it is
            idempotent).
    """
    import httpx

    body: dict[str, Any] = {"reward": reward, "name": name}
    for field, value in (
        ("response_id", response_id),
        ("rollout_id", rollout_id),
        ("session_id", session_id),
    ):
        if value is not None:
            body[field] = value
    if idempotency_key is not None:
        body["idempotency_key"] = idempotency_key
    token = token or os.environ.get("AGL_GATEWAY_REWARD_TOKEN")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    target = url.rstrip("/").removesuffix("/v1") + REWARDS_PATH
    try:
        answer = httpx.post(target, content=orjson.dumps(body), headers=headers, timeout=timeout_s)
    except httpx.HTTPError as exc:
        raise GatewayError(f"could not post the reward to {target}: {exc}") from exc
    if answer.status_code == 200:
        return dict(answer.json())
    try:
        error = answer.json()["error"]
        message, param = str(error["message"]), error.get("param")
    except (ValueError, KeyError, TypeError):
        message, param = answer.text[:500], None
    if answer.status_code in (400, 404, 422):
        raise InvalidRequestError(f"the gateway refused the reward: {message}", param=param)
    raise GatewayError(f"the gateway answered {answer.status_code} to the reward: {message}")
