"""The active rollout, carried in a ContextVar, and the buffer its spans collect in.

Concurrency model: each rollout runs in its own ``contextvars`` context, so emitters and
instrumentation in concurrent rollouts (tasks or threads) never mix. The buffer is thread-safe;
the runner flushes it into the store while the rollout runs and once more when it ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from agl.errors import NoActiveRolloutError
from agl.schemas import Attempt, ResourcesVersion, Rollout, Span

log = logging.getLogger(__name__)


class SpanBuffer:
    """Finished spans of one attempt waiting to be written to the store, bounded in size.

    An entry may be a zero-argument callable that builds the span: instrumentation hands over raw
    OpenTelemetry spans that way, so their conversion runs at flush time, off the agent's call path.
    """

    def __init__(self, max_spans: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span | Callable[[], Span]] = []
        self.max_spans = max_spans
        self.dropped = 0

    def add(self, span: Span | Callable[[], Span]) -> None:
        with self._lock:
            if len(self._spans) >= self.max_spans:
                if self.dropped == 0:
                    log.warning("span buffer full (%d spans); dropping new spans", self.max_spans)
                self.dropped += 1
                return
            self._spans.append(span)

    def take(self) -> list[Span]:
        with self._lock:
            pending, self._spans = self._spans, []
        spans = []
        for item in pending:
            if isinstance(item, Span):
                spans.append(item)
                continue
            try:
                spans.append(item())
            except Exception:  # telemetry must never break the agent
                if self.dropped == 0:
                    log.exception(
                        "could not convert a traced span; dropping it (further drops are only counted)"
                    )
                self.dropped += 1
        return spans

    def __len__(self) -> int:
        with self._lock:
            return len(self._spans)


@dataclass
class RolloutContext:
    """What code running inside a rollout may know about it."""

    rollout: Rollout
    attempt: Attempt
    resources: ResourcesVersion | None = None
    buffer: SpanBuffer = field(default_factory=SpanBuffer)
    trace_id: str | None = None
    agent_name: str | None = None
    #: the primary value of the last reward the agent emitted (``agl.emit_reward``); a None return reports it
    last_reward: float | None = None
    #: set by the runner when the attempt was superseded or its rollout cancelled: why it stopped the agent
    superseded: str | None = None

    @property
    def rollout_id(self) -> str:
        return self.rollout.rollout_id

    @property
    def attempt_id(self) -> str:
        return self.attempt.attempt_id


_current: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar("agl_rollout", default=None)
_agent: contextvars.ContextVar[str | None] = contextvars.ContextVar("agl_agent", default=None)


def current_agent() -> str | None:
    """The agent named by the innermost ``agl.agent_scope`` around the calling code, if any."""
    return _agent.get()


@contextlib.contextmanager
def agent_context(name: str) -> Iterator[None]:
    """Make ``name`` the current agent inside the block (``agl.agent_scope`` adds its span)."""
    token = _agent.set(name)
    try:
        yield
    finally:
        _agent.reset(token)


def current_rollout(required: bool = True) -> RolloutContext | None:
    """The rollout the calling code runs in; raises NoActiveRolloutError if none and ``required``."""
    ctx = _current.get()
    if ctx is None and required:
        raise NoActiveRolloutError(
            "no rollout is active here: emitters work inside an agent run by agl (Runner, Trainer.dev); "
            "pass local=True to record a local-only span instead"
        )
    return ctx


@contextlib.contextmanager
def suppressed() -> Iterator[None]:
    """Instrumentation off inside the block: agl's own store calls must never be traced as agent work."""
    try:
        from opentelemetry.instrumentation.utils import suppress_instrumentation
    except ImportError:  # opentelemetry-instrumentation absent: set the API's key directly
        from opentelemetry import context as otel_context

        token = otel_context.attach(otel_context.set_value(otel_context._SUPPRESS_INSTRUMENTATION_KEY, True))
        try:
            yield
        finally:
            otel_context.detach(token)
        return
    with suppress_instrumentation():
        yield


@contextlib.contextmanager
def rollout_context(ctx: RolloutContext) -> Iterator[RolloutContext]:
    """Make ``ctx`` the active rollout for the code inside the block."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)
