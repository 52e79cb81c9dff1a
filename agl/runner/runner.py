"""The Runner: claims rollouts from a store, runs the agent on each inside its rollout context, reports back.

Concurrency model: one asyncio loop; up to ``max_concurrency`` attempts at once, each an asyncio task
with its own ``contextvars`` context; sync agents run on a thread pool. Each attempt has a heartbeat
task; a heartbeat that finds the attempt superseded or the rollout cancelled cancels the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from agl.agent.base import LitAgent, scoped_llm
from agl.agent.clients import shared_pool_scope
from agl.emit import emit_exception, emit_reward
from agl.errors import AglError, StaleAttemptError, StoreUnavailableError
from agl.failures import METADATA_KEY, FailureClass, classify_exception
from agl.runner.client_caches import release_client_caches
from agl.schemas import (
    LLM,
    AttemptedRollout,
    AttemptStatus,
    Resource,
    ResourcesVersion,
    Rollout,
    RolloutCreate,
    RolloutStatus,
    Span,
    new_id,
)
from agl.store.base import LightningStore
from agl.tracer.context import RolloutContext, rollout_context, suppressed
from agl.tracer.writer import GaveUp, SpanTally, SpanWriter, StoreOutage, WriterStats

log = logging.getLogger(__name__)

Hook = Callable[..., Awaitable[None] | None]


@dataclass
class RunnerHooks:
    """Callbacks around each attempt; each gets ``(ctx)`` (``on_rollout_end`` also the outcome) and may be async."""

    on_rollout_start: Hook | None = None
    on_trace_start: Hook | None = None
    on_trace_end: Hook | None = None
    on_rollout_end: Hook | None = None


@dataclass
class AttemptOutcome:
    """How one attempt ended, as the runner reported it to the store."""

    rollout_id: str
    attempt_id: str
    status: AttemptStatus
    reward: float | None = None
    error: str | None = None
    spans: int = 0
    #: why a failed attempt yielded no reward (``agl.failures``); None when it succeeded
    failure_class: FailureClass | None = None


@dataclass
class _Stats:
    finished: int = 0
    outcomes: list[AttemptOutcome] = field(default_factory=list)
    #: the span writer's counters (written, dropped, failed, store errors)
    spans: WriterStats = field(default_factory=WriterStats)

    @property
    def span_export_errors(self) -> int:
        """Failed ``add_spans`` calls, each retry counted."""
        return self.spans.store_errors

    @property
    def spans_lost(self) -> int:
        """Spans given up on: rejected by the store, or unreachable past ``report_timeout_s``."""
        return self.spans.failed + self.spans.dropped


async def _call_hook(hook: Hook | None, *args: Any) -> None:
    if hook is None:
        return
    try:
        result = hook(*args)
        if asyncio.iscoroutine(result):
            await result
    except Exception:
        log.exception("runner hook %r failed; continuing", hook)


class Runner:
    """Runs an agent over the rollouts of a store.

    Args:
        agent: a ``LitAgent`` (``@agl.rollout`` functions are ones).
        store: any LightningStore, in-process or remote.
        max_concurrency: attempts run at once in this process.
        heartbeat_interval_s: how often a running attempt tells the store it is alive.
        poll_interval_s: back-off between dequeues when the queue is empty.
        shutdown_grace_s: on SIGINT/SIGTERM, how long in-flight attempts may finish before they are failed.
        store_backoff_s, max_store_backoff_s: while the store is unreachable (past the client's own
            retries) the runner retries with exponential backoff from ``store_backoff_s`` up to
            ``max_store_backoff_s`` (with jitter), for as long as it takes; claiming resumes after.
        report_timeout_s: how long a finished attempt keeps trying to report its spans and status to
            an unreachable store before it gives them up.
        flush_every: an attempt's buffered spans go to the span writer once this many are waiting (and
            all of them when it ends); the writer batches them with other attempts' spans.
        host_info: more fields for the worker's ``host`` record in the store, beside hostname and pid
            (where it runs: ``RayLauncher`` adds the Ray node).
    """

    def __init__(
        self,
        agent: LitAgent,
        store: LightningStore,
        *,
        max_concurrency: int = 1,
        worker_id: str | None = None,
        heartbeat_interval_s: float = 5.0,
        poll_interval_s: float = 0.05,
        max_poll_interval_s: float = 1.0,
        shutdown_grace_s: float = 10.0,
        flush_every: int = 64,
        hooks: RunnerHooks | None = None,
        handle_signals: bool = True,
        store_backoff_s: float = 0.5,
        max_store_backoff_s: float = 30.0,
        report_timeout_s: float = 600.0,
        host_info: dict[str, Any] | None = None,
    ) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.agent = agent
        self.store = store
        self.max_concurrency = max_concurrency
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{new_id('w', 3)}"
        self.host_info = dict(host_info or {})
        self.heartbeat_interval_s = heartbeat_interval_s
        self.poll_interval_s = poll_interval_s
        self.max_poll_interval_s = max_poll_interval_s
        self.shutdown_grace_s = shutdown_grace_s
        self.flush_every = flush_every
        self.hooks = hooks or RunnerHooks()
        self.handle_signals = handle_signals  # off when an owner (Trainer.fit) handles Ctrl-C itself
        self._executor = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="agl-agent")
        self.report_timeout_s = report_timeout_s
        self.outage = StoreOutage(
            f"runner {self.worker_id}", backoff_s=store_backoff_s, max_backoff_s=max_store_backoff_s
        )
        #: every span of every attempt reaches the store through this writer
        self.spans = SpanWriter(store, outage=self.outage, deadline_s=report_timeout_s)
        self._stopping: asyncio.Event | None = None  # created on the running loop
        self._stop_requested = False  # a stop() before run() starts is honoured
        self._resources_cache: dict[str, ResourcesVersion] = {}
        self.stats = _Stats(spans=self.spans.stats)

    # ----- the claim loop ------------------------------------------------------------------
    async def run(
        self, max_rollouts: int | None = None, *, stop_when_idle: bool = False
    ) -> list[AttemptOutcome]:
        """Claim and run rollouts until stopped, ``max_rollouts`` are claimed, or (``stop_when_idle``) the queue is empty.

        Returns the outcomes of the attempts this call ran.
        """
        async with shared_pool_scope():  # agl.openai_client's connections, closed after the last runner here
            return await self._run(max_rollouts, stop_when_idle)

    async def _run(self, max_rollouts: int | None, stop_when_idle: bool) -> list[AttemptOutcome]:
        stopping = self._stopping = asyncio.Event()
        if self._stop_requested:
            stopping.set()
        first = len(self.stats.outcomes)
        if self.handle_signals:
            self._install_signal_handlers()
        slots = asyncio.Semaphore(self.max_concurrency)
        tasks: set[asyncio.Task[AttemptOutcome]] = set()
        claimed = 0
        delay = self.poll_interval_s
        try:
            await self._register()
            while not stopping.is_set() and (max_rollouts is None or claimed < max_rollouts):
                if not await self._acquire(slots):
                    break
                attempt = await self._dequeue()
                if attempt is None:
                    slots.release()
                    if stop_when_idle and not tasks:
                        break
                    await self._idle(delay)
                    delay = min(delay * 2, self.max_poll_interval_s)
                    continue
                delay = self.poll_interval_s
                claimed += 1
                task = asyncio.create_task(self._run_attempt(attempt))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: slots.release())
            await self._drain(tasks)
        finally:
            self._stop_requested = False
            if self.handle_signals:
                self._remove_signal_handlers()
            await self.spans.aclose()  # every attempt has waited for its spans: this only stops the task
            s = self.stats.spans
            log.info(
                "runner %s: spans written %d, failed %d, dropped %d; failed store writes %d",
                self.worker_id,
                s.written,
                s.failed,
                s.dropped,
                s.store_errors,
            )
        return self.stats.outcomes[first:]

    async def _register(self) -> None:
        host = {"hostname": socket.gethostname(), "pid": os.getpid(), **self.host_info}

        async def call() -> Any:
            with suppressed():
                return await self.store.update_worker(self.worker_id, host=host)

        with contextlib.suppress(GaveUp):
            await self.outage.call("registering the worker", call, stop=self._stopping)

    async def _idle(self, delay: float) -> None:
        """Wait ``delay`` between empty dequeues, less when the store signals a queued rollout or on stop."""
        assert self._stopping is not None
        waits = [
            asyncio.ensure_future(self._stopping.wait()),
            asyncio.ensure_future(self.store.wait_for_queued(delay)),
        ]
        _, pending = await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _dequeue(self) -> AttemptedRollout | None:
        """The next attempt; None when the queue is empty or the runner stopped during an outage."""

        async def call() -> AttemptedRollout | None:
            with suppressed():
                return await self.store.dequeue(self.worker_id)

        try:
            return await self.outage.call("claiming a rollout", call, stop=self._stopping)
        except GaveUp:
            return None

    async def _acquire(self, slots: asyncio.Semaphore) -> bool:
        """Take a concurrency slot; False (holding none) once the runner is stopping."""
        assert self._stopping is not None
        if not slots.locked():
            await slots.acquire()
        else:
            acquire = asyncio.ensure_future(slots.acquire())
            stop = asyncio.ensure_future(self._stopping.wait())
            await asyncio.wait({acquire, stop}, return_when=asyncio.FIRST_COMPLETED)
            stop.cancel()
            if not acquire.done():
                acquire.cancel()
                await asyncio.gather(acquire, return_exceptions=True)
            if not acquire.done() or acquire.cancelled():
                return False
        if self._stopping.is_set():
            slots.release()
            return False
        return True

    async def _drain(self, tasks: set[asyncio.Task[AttemptOutcome]]) -> None:
        """Let in-flight attempts finish; past the grace period (when stopping) cancel them."""
        if not tasks:
            return
        timeout = self.shutdown_grace_s if self._stopping is not None and self._stopping.is_set() else None
        _, pending = await asyncio.wait(set(tasks), timeout=timeout)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

    def stop(self) -> None:
        """Stop claiming; in-flight attempts get ``shutdown_grace_s`` to finish.

        Called before :meth:`run` has started (a trainer tearing down early), the next run returns at once.
        """
        self._stop_requested = True
        if self._stopping is not None:
            self._stopping.set()

    def run_sync(
        self, max_rollouts: int | None = None, *, stop_when_idle: bool = False
    ) -> list[AttemptOutcome]:
        """Blocking :meth:`run` for scripts."""
        return asyncio.run(self.run(max_rollouts, stop_when_idle=stop_when_idle))

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, sig)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: int) -> None:
        log.warning(
            "runner %s got signal %d: finishing in-flight attempts, claiming no more", self.worker_id, sig
        )
        self.stop()

    # ----- one attempt ---------------------------------------------------------------------
    async def step(
        self,
        rollout_input: Any,
        *,
        resources: dict[str, Resource] | None = None,
        resources_id: str | None = None,
        mode: str = "train",
    ) -> AttemptOutcome:
        """Run one rollout now, bypassing the queue (online use); returns its outcome.

        ``resources`` are stored as a new resources version for this rollout; ``resources_id`` names an
        existing one; with neither the rollout gets the store's latest version.
        """
        if resources is not None and resources_id is not None:
            raise ValueError("step() takes resources or resources_id, not both")
        with suppressed():
            if resources is not None:
                resources_id = (await self.store.add_resources(resources)).resources_id
            attempt = await self.store.start_rollout(
                RolloutCreate(input=rollout_input, mode=mode, resources_id=resources_id),
                worker_id=self.worker_id,
            )
        return await self._run_attempt(attempt)

    async def _resources(self, rollout: Rollout) -> ResourcesVersion | None:
        if rollout.resources_id is None:
            return None
        resources_id = rollout.resources_id
        cached = self._resources_cache.get(resources_id)
        if cached is None:

            async def call() -> ResourcesVersion:
                with suppressed():
                    return await self.store.get_resources(resources_id)

            cached = await self.outage.call("loading resources", call)
            self._resources_cache[resources_id] = cached
        return cached

    async def _run_attempt(self, claimed: AttemptedRollout) -> AttemptOutcome:
        rollout, attempt = claimed.rollout, claimed.attempt
        version = await self._resources(rollout)
        resources: dict[str, Resource] = {
            name: scoped_llm(r, rollout.rollout_id, attempt.attempt_id) if isinstance(r, LLM) else r
            for name, r in (version.resources if version else {}).items()
        }
        # an unnamed agent is known by its function's or class's name (the dashboard lists it)
        agent_name = self.agent.name or getattr(self.agent, "__name__", None) or type(self.agent).__name__
        ctx = RolloutContext(rollout=rollout, attempt=attempt, resources=version, agent_name=agent_name)
        await _call_hook(self.hooks.on_rollout_start, ctx)
        outcome = await self._execute(ctx, resources)
        release_client_caches()  # a framework's client for this rollout's URL is never used again
        self.stats.outcomes.append(outcome)
        self.stats.finished += 1
        await _call_hook(self.hooks.on_rollout_end, ctx, outcome)
        return outcome

    async def _execute(self, ctx: RolloutContext, resources: dict[str, Resource]) -> AttemptOutcome:
        rid, aid = ctx.rollout_id, ctx.attempt_id
        with rollout_context(ctx):
            agent_task = asyncio.ensure_future(self._traced(ctx, resources))
        heartbeat = asyncio.create_task(self._heartbeat(ctx, agent_task))
        tally, finished = SpanTally(), asyncio.Event()
        flusher = asyncio.create_task(self._flush_periodically(ctx, tally, finished))
        status, error, reward = AttemptStatus.SUCCEEDED, None, None
        failure: FailureClass | None = None
        try:
            result = await asyncio.wait_for(agent_task, ctx.rollout.retry.timeout_s)
            with rollout_context(ctx):
                reward = self._record_result(ctx, result)
        except asyncio.TimeoutError:
            status, error, failure = (
                AttemptStatus.TIMEOUT,
                f"the agent ran past timeout_s={ctx.rollout.retry.timeout_s}",
                "infra",
            )
        except asyncio.CancelledError:
            if not heartbeat.done() and ctx.superseded is None:
                status, error = AttemptStatus.FAILED, "runner shut down before the agent finished"
            else:
                status, error = AttemptStatus.FAILED, ctx.superseded or "cancelled"
            failure = "infra"
        except Exception as exc:
            status, error = AttemptStatus.FAILED, f"{type(exc).__name__}: {exc}"
            failure = classify_exception(exc)
            with rollout_context(ctx):
                emit_exception(exc)
        finally:
            heartbeat.cancel()
            finished.set()  # the flusher ends after the hand-over in progress, so no span is dropped
        await asyncio.gather(flusher, return_exceptions=True)
        spans = await self._flush(ctx, tally)
        if ctx.superseded is None:

            async def report() -> Any:
                with suppressed():
                    return await self.store.update_attempt(
                        rid, aid, status=status, error=error, metadata=failed_as
                    )

            failed_as = None if failure is None else {METADATA_KEY: failure}

            try:
                await self.outage.call(f"reporting attempt {aid}", report, deadline_s=self.report_timeout_s)
            except StaleAttemptError as exc:
                log.info("attempt %s was superseded before it reported: %s", aid, exc)
            except (AglError, GaveUp):
                log.exception("could not report attempt %s of rollout %s as %s", aid, rid, status.value)
        return AttemptOutcome(
            rid, aid, status, reward=reward, error=error, spans=spans, failure_class=failure
        )

    async def _traced(self, ctx: RolloutContext, resources: dict[str, Resource]) -> Any:
        await _call_hook(self.hooks.on_trace_start, ctx)
        try:
            return await self.agent.execute(ctx.rollout, resources, self._executor)
        finally:
            await _call_hook(self.hooks.on_trace_end, ctx)

    @staticmethod
    def _record_result(ctx: RolloutContext, result: Any) -> float | None:
        """A returned number becomes the final reward span; returned spans are stored as they are."""
        if result is None:
            return ctx.last_reward
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            emit_reward(float(result))
            return float(result)
        if isinstance(result, list) and all(isinstance(s, Span) for s in result):
            for span in result:
                ctx.buffer.add(
                    span.model_copy(update={"rollout_id": ctx.rollout_id, "attempt_id": ctx.attempt_id})
                )
            return ctx.last_reward
        raise TypeError(
            f"an agent returns None, a float reward or a list of spans, not {type(result).__name__}"
        )

    async def _heartbeat(self, ctx: RolloutContext, agent_task: asyncio.Future[Any]) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            try:
                with suppressed():
                    rollout = await self.store.heartbeat(ctx.rollout_id, ctx.attempt_id)
            except StaleAttemptError as exc:
                ctx.superseded = str(exc)
                agent_task.cancel()
                return
            except StoreUnavailableError as exc:
                self.outage.failed(f"heartbeating attempt {ctx.attempt_id}", exc)
                continue
            except AglError:
                log.warning("heartbeat for attempt %s failed; will retry", ctx.attempt_id, exc_info=True)
                continue
            self.outage.succeeded()
            if rollout.status == RolloutStatus.CANCELLED:
                ctx.superseded = "rollout cancelled"
                agent_task.cancel()
                return

    async def _flush_periodically(
        self, ctx: RolloutContext, tally: SpanTally, finished: asyncio.Event
    ) -> None:
        """While the attempt runs, hand its buffered spans to the writer once ``flush_every`` are waiting."""
        while not finished.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(finished.wait(), 0.2)
            if not finished.is_set() and len(ctx.buffer) >= self.flush_every:
                await self.spans.put(ctx.buffer.take(), tally)

    async def _flush(self, ctx: RolloutContext, tally: SpanTally) -> int:
        """Hand the attempt's last spans to the writer and wait until all its spans are stored or given up.

        The writer rides out a store outage for up to ``report_timeout_s``; returns the spans stored.
        """
        await self.spans.put(ctx.buffer.take(), tally)
        await self.spans.flush()
        if tally.failed:
            log.error("gave up storing %d spans of attempt %s; they are lost", tally.failed, ctx.attempt_id)
        return tally.written

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
