"""Production calls that no trainer queued: each conversation becomes one rollout of mode ``online``.

A call names its conversation with the ``x-agl-session-id`` header or the OpenAI ``user`` field (the
Anthropic ``metadata.user_id``); a call with neither is a conversation of its own. The rollout id is
made here at once (a session's id is derived from the session id, so a restarted gateway, or a reward
posted days later, finds the same rollout), and the rollout itself is written by a background task that
rides out an unreachable store: a call never waits for it. Its calls' records wait beside it (bounded by
``queue_size``, beyond which they are dropped and counted) and go to the span writer once it exists.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from agl import semconv as sc
from agl.errors import ConflictError
from agl.gateway.recording import CallRecord
from agl.schemas import RolloutCreate, new_id
from agl.store.base import LightningStore
from agl.tracer.writer import GaveUp, StoreOutage

logger = logging.getLogger(__name__)

ONLINE_MODE = sc.ROLLOUT_MODE_ONLINE
SESSION_HEADER = b"x-agl-session-id"
#: rollout metadata keys of an online rollout
SESSION_KEY = "agl.session_id"
SOURCE_KEY = "agl.gateway"


def session_rollout_id(session_id: str) -> str:
    """The rollout id of a session: the same for every gateway, so any of them finds it again."""
    return "ro-online-" + hashlib.sha256(session_id.encode()).hexdigest()[:24]


def session_of(headers: dict[bytes, bytes], raw: bytes) -> str | None:
    """A call's session id: the ``x-agl-session-id`` header, else the body's ``user`` (or Anthropic's
    ``metadata.user_id``); None when it names none. The body is parsed only when it holds such a key."""
    given = headers.get(SESSION_HEADER)
    if given:
        return given.decode("latin-1")
    if b'"user' not in raw:
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict):
        return None
    user = body.get("user")
    if user is None and isinstance(body.get("metadata"), dict):
        user = body["metadata"].get("user_id")
    return user if isinstance(user, str) and user else None


@dataclass(eq=False)
class Conversation:
    """One online rollout: its id at once, its attempt id once the store holds it."""

    rollout_id: str
    session_id: str | None
    attempt_id: str | None = None
    failed: bool = False
    waiting: list[CallRecord] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class OnlineRollouts:
    """Conversation -> online rollout (a bounded cache of sessions), and the task that writes the rollouts.

    Args:
        submit: hands a call record whose rollout exists to the span writer.
        outage: the span writer's, so one outage is logged once and backs off alike.
    """

    def __init__(
        self,
        store: LightningStore,
        submit: Callable[[CallRecord], bool],
        outage: StoreOutage,
        *,
        cache_size: int,
        queue_size: int,
        deadline_s: float,
    ) -> None:
        self.store, self._submit, self.outage = store, submit, outage
        self.cache_size, self.queue_size, self.deadline_s = cache_size, queue_size, deadline_s
        self._sessions: OrderedDict[str, Conversation] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[Conversation] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self.waiting = 0  # call records waiting for their rollout
        self.created = 0
        self.dropped = 0
        self.failed = 0

    def conversation(self, session_id: str | None) -> Conversation:
        """The session's rollout (made, and queued for the store, on its first call); no store call here."""
        if session_id is not None:
            known = self._sessions.get(session_id)
            if known is not None and not known.failed:
                self._sessions.move_to_end(session_id)
                return known
        made = Conversation(session_rollout_id(session_id) if session_id else new_id("ro"), session_id)
        if session_id is not None and self.cache_size:
            self._sessions[session_id] = made
            while len(self._sessions) > self.cache_size:
                self._sessions.popitem(last=False)  # its rollout id is derived: a later call finds it again
        self._ensure().put_nowait(made)
        return made

    def record(self, conversation: Conversation, record: CallRecord) -> None:
        """Record a finished call of ``conversation``: now if its rollout exists, else once it does."""
        if conversation.attempt_id is not None:
            record.attempt_id = conversation.attempt_id
            self._submit(record)
        elif self.waiting >= self.queue_size:
            self.dropped += 1
        else:
            self.waiting += 1
            conversation.waiting.append(record)

    def known(self, session_id: str) -> Conversation | None:
        return self._sessions.get(session_id)

    async def flush(self) -> None:
        """Return once every rollout queued so far is written (or given up on)."""
        if self._queue is not None and self._loop is asyncio.get_running_loop():
            await self._ensure().join()

    async def aclose(self, timeout_s: float) -> None:
        """Write what is queued for at most ``timeout_s``; calls still waiting then count failed."""
        if self._task is None:
            return
        try:
            await asyncio.wait_for(self.flush(), timeout_s)
        except asyncio.TimeoutError:
            logger.error("gateway: %d online calls not stored %.0fs into closing", self.waiting, timeout_s)
        self._stop.set()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self._task = None
        self.failed += self.waiting
        self.waiting = 0

    def _ensure(self) -> asyncio.Queue[Conversation]:
        """The running loop's queue, with its task running (started on first use, restarted if it died)."""
        loop = asyncio.get_running_loop()
        if self._queue is None or self._loop is not loop:
            self._loop, self._queue, self._task = loop, asyncio.Queue(), None
        if self._task is None or self._task.done():
            self._stop = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(self._queue), name="agl-online")
        return self._queue

    async def _run(self, queue: asyncio.Queue[Conversation]) -> None:
        while True:
            conversation = await queue.get()
            try:
                await self._create(conversation)
            except Exception:  # a bug here must not stop the task that writes every later rollout
                logger.exception("gateway: creating online rollout %s failed", conversation.rollout_id)
                self._give_up(conversation)
            finally:
                conversation.ready.set()
                queue.task_done()

    async def _create(self, conversation: Conversation) -> None:
        try:
            attempt_id = await self.outage.call(
                f"creating online rollout {conversation.rollout_id}",
                lambda: self._start(conversation),
                deadline_s=self.deadline_s,
                stop=self._stop,
            )
        except GaveUp as exc:
            logger.error("gateway: online rollout %s not created: %s", conversation.rollout_id, exc)
            self._give_up(conversation)
            return
        conversation.attempt_id = attempt_id
        self.created += 1
        waiting, conversation.waiting = conversation.waiting, []
        self.waiting -= len(waiting)
        for record in waiting:
            record.attempt_id = attempt_id
            self._submit(record)

    def _give_up(self, conversation: Conversation) -> None:
        conversation.failed = True  # the session's next call queues its rollout again
        self.failed += len(conversation.waiting)
        self.waiting -= len(conversation.waiting)
        conversation.waiting = []

    async def _start(self, conversation: Conversation) -> str:
        """Create the rollout and its attempt; one made before (by an earlier gateway, or a reply lost to
        an outage) is joined at its latest attempt."""
        metadata: dict[str, Any] = {SOURCE_KEY: ONLINE_MODE}
        if conversation.session_id is not None:
            metadata[SESSION_KEY] = conversation.session_id
        request = RolloutCreate(rollout_id=conversation.rollout_id, mode=ONLINE_MODE, metadata=metadata)
        try:
            return (await self.store.start_rollout(request)).attempt.attempt_id
        except ConflictError:
            attempts = (await self.store.query_attempts(rollout_id=conversation.rollout_id, limit=1000)).items
            if not attempts:
                raise
            return max(attempts, key=lambda a: a.attempt_number).attempt_id
