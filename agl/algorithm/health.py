"""Why a run is not learning, said as it happens: rollouts that fail, and rewards that give no signal.

Failed rollouts are counted per step, per failure class (``infra``, ``agent``, ``reward``: :mod:`agl.failures`),
with the first one's error (from its attempt, or its exception span).
When every rollout of the first step or of the baseline evaluation fails, training stops with that error
(:func:`check_not_all_failed`) rather than running steps that train nothing. :class:`LearningCheck` warns
once per run when the rewards cannot teach anything: every group scored alike, or nothing scored at all.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl import semconv as sc
from agl.errors import RolloutsFailedError
from agl.failures import FAILURE_CLASSES, FailureClass, stored_class
from agl.schemas import Attempt, AttemptStatus, Rollout, RolloutStatus, Span
from agl.store.base import LightningStore

log = logging.getLogger(__name__)

ERROR_CHARS = 160  # the first error as the console line shows it; the exception keeps more
ZERO_VARIANCE_SHARE = 0.9  # a step with at least this share of flat groups trains (almost) nothing


@dataclass(frozen=True)
class Failure:
    """One rollout that yielded no reward: its class (:mod:`agl.failures`), error and attempts made."""

    rollout: Rollout
    failure_class: FailureClass
    error: str
    attempts: int


@dataclass(frozen=True)
class Failures:
    """How many of ``total`` rollouts did not succeed, the first one's error (``Type: message``), the
    count per failure class, and each failed rollout's :class:`Failure`."""

    failed: int
    total: int
    first_error: str | None = None
    by_class: Mapping[FailureClass, int] = field(default_factory=dict)
    details: tuple[Failure, ...] = field(default=(), compare=False, repr=False)

    @property
    def all_failed(self) -> bool:
        return self.total > 0 and self.failed == self.total

    def __add__(self, other: Failures) -> Failures:
        """Both sets of rollouts counted together; the first error stays the earliest."""
        classes = {*self.by_class, *other.by_class}
        return Failures(
            self.failed + other.failed,
            self.total + other.total,
            self.first_error or other.first_error,
            {c: self.by_class.get(c, 0) + other.by_class.get(c, 0) for c in classes},
            self.details + other.details,
        )

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """``failed_rollouts``, ``rollouts`` and ``failed_<class>`` per class (with ``prefix``, e.g.
        ``val_``) for a metrics row."""
        classes = {f"{prefix}failed_{c}": float(self.by_class.get(c, 0)) for c in FAILURE_CLASSES}
        return {
            f"{prefix}failed_rollouts": float(self.failed),
            f"{prefix}rollouts": float(self.total),
            **classes,
        }

    def console(self) -> dict[str, str]:
        """The first error, cut to one short line, under the key the console line shows (``first_error``)."""
        return {"first_error": shorten(self.first_error)} if self.failed and self.first_error else {}


def shorten(text: str | None, limit: int = ERROR_CHARS) -> str:
    """The first line of ``text``, cut to ``limit`` characters."""
    lines = (text or "").strip().splitlines()
    line = lines[0] if lines else ""
    return line if len(line) <= limit else line[: limit - 3].rstrip() + "..."


async def rollout_failures(
    store: LightningStore, rollouts: Sequence[Rollout], spans: Mapping[str, Sequence[Span]]
) -> Failures:
    """Count the rollouts that did not succeed, class each (:func:`rollout_failure`), keep the first's error."""
    details = [
        await rollout_failure(store, r, spans.get(r.rollout_id, ()))
        for r in rollouts
        if r.status != RolloutStatus.SUCCEEDED
    ]
    if not details:
        return Failures(0, len(rollouts))
    by_class = {c: n for c in FAILURE_CLASSES if (n := sum(d.failure_class == c for d in details))}
    return Failures(len(details), len(rollouts), details[0].error, by_class, tuple(details))


async def rollout_failure(store: LightningStore, rollout: Rollout, spans: Sequence[Span]) -> Failure:
    """Why ``rollout`` yielded no reward, from its latest attempt.

    The class is the one the runner stored with the attempt; an attempt the store's watchdog ended
    (timeout, unresponsive: the runner or its node was lost), a rollout cancelled or still unfinished
    when the wait for it ended is ``infra``; a failed attempt without a stored class is ``agent``.
    The error is the failed attempt's (the runner stores ``Type: message``), else the rollout's last
    exception span, else its status.
    """
    attempts = sorted(
        (await store.query_attempts(rollout_id=rollout.rollout_id)).items, key=lambda a: a.attempt_number
    )
    latest = attempts[-1] if attempts else None
    return Failure(rollout, _class_of(rollout, latest), _error_of(rollout, attempts, spans), len(attempts))


def _class_of(rollout: Rollout, latest: Attempt | None) -> FailureClass:
    stored = None if latest is None else stored_class(latest.metadata)
    if stored is not None:
        return stored
    if not rollout.status.is_terminal or rollout.status == RolloutStatus.CANCELLED:
        return "infra"
    if latest is not None and latest.status in (AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE):
        return "infra"
    return "agent"


def _error_of(rollout: Rollout, attempts: Sequence[Attempt], spans: Sequence[Span]) -> str:
    errors = [a.error for a in attempts if a.error]
    if errors:
        return errors[-1]
    raised = [s for s in spans if s.name == sc.SPAN_EXCEPTION]
    if raised:
        attrs = raised[-1].attributes
        return f"{attrs.get(sc.EXCEPTION_TYPE)}: {attrs.get(sc.EXCEPTION_MESSAGE)}"
    if not rollout.status.is_terminal:
        return f"rollout not finished in time (status {rollout.status.value}): are runners serving the store?"
    if attempts and attempts[-1].status in (AttemptStatus.TIMEOUT, AttemptStatus.UNRESPONSIVE):
        return f"attempt {attempts[-1].status.value}: its runner stopped reporting"
    return f"rollout {rollout.status.value} without a recorded error"


def check_not_all_failed(failures: Failures, where: str, *, stop: bool, option: str) -> None:
    """Raise :class:`RolloutsFailedError` when every rollout of ``where`` failed and ``stop`` is set.

    ``option`` names the setting that keeps going instead (e.g. ``GRPOConfig(stop_on_all_failed=False)``).
    """
    if not (stop and failures.all_failed):
        return
    raise RolloutsFailedError(
        f"all {failures.total} rollouts of {where} failed; the first error: "
        f"{shorten(failures.first_error, 600).rstrip('.')}. Nothing can be learned from failed rollouts. "
        "Check what the agent needs to reach the model: its client's api_key (llm.api_key when fit's "
        "gateway has a token, else any non-empty string), base_url=llm.endpoint and model=llm.model; "
        "`agl.Trainer().dev(agent, tasks, resources)` runs a few tasks and shows each error. "
        f"To train on through failures, set {option}."
    )


ADVICE = (
    "GRPO learns only from groups whose rollouts score differently. What to try: a warm start on a few solved examples (GRPOConfig(warm_start=agl.WarmStart(conversations))) "
    "so that some rollouts score; a higher sampling temperature in the agent's model call, for more varied "
    "replies; a reward with partial credit (for the right format, or a near answer) instead of exact match; "
    "a larger group (GRPOConfig(group_size=16)), so that a rare success lands in a group; or a teacher "
    "sharing the student's tokenizer to distill from (GRPOConfig(teacher=agl.Teacher(path=...))), whose "
    "per-token signal needs no reward spread."
)


FIX_FAILURES = (
    "Fix the rollouts' error first: each step's console line shows the first one, and "
    "`agl.Trainer().dev(agent, tasks, resources)` runs a few tasks with their errors and span trees."
)


class LearningCheck:
    """Warns once per run when GRPO cannot learn: groups without reward variance, or no reward at all.

    GRPO trains only on groups whose rollouts scored differently; when (almost) every group scored alike,
    steps train (almost) nothing and the run idles without error. The warning names the cause and
    what to try. ``distilling``: a teacher's per-token advantage trains every group, so ties and rewards of
    0 are no cause (only failed rollouts are).
    """

    def __init__(self, zero_variance_share: float = ZERO_VARIANCE_SHARE, *, distilling: bool = False) -> None:
        self.zero_variance_share = zero_variance_share
        self.distilling = distilling
        self.warned = False
        self.said_solved = False
        self.low, self.high = math.inf, -math.inf  # the lowest and highest rollout reward so far

    def at_start(self, val_reward: float, phases: Mapping[str, float], failures: Failures) -> None:
        """Check the held-out reward GRPO starts from (after the warm start, when there is one)."""
        if failures.all_failed:
            self._warn(f"all {failures.total} rollouts of the baseline evaluation failed", FIX_FAILURES)
            return
        if math.isnan(val_reward) or val_reward != 0.0 or self.distilling:
            return
        cause = "the held-out reward is 0.000 before the first GRPO step"
        base, warm = phases.get("base"), phases.get("after_warm_start")
        if base is not None and warm is not None and base > warm:
            cause += (
                f"; the warm start lowered it from {base:.3f}: check that its examples answer in the form "
                "the reward accepts"
            )
        cause += ", so every group may score alike and give GRPO nothing to learn from"
        self._warn(cause, ADVICE, "may not learn")

    def after_step(self, step: int, row: Mapping[str, Any], *, first: bool) -> None:
        """Check a step's metrics row (``groups``, ``zero_variance_groups``, ``reward_mean``, failures)."""
        groups, flat = row.get("groups", 0.0), row.get("zero_variance_groups", 0.0)
        if row.get("groups_with_signal"):  # refill drew other tasks in place of the flat groups: it trained
            flat = 0.0
        if self.distilling:  # the teacher's advantage trained the flat groups, and rollouts scoring 0
            flat, first = 0.0, False
        rollouts, failed = row.get("rollouts", 0.0), row.get("failed_rollouts", 0.0)
        low, high = row.get("reward_min", math.nan), row.get("reward_max", math.nan)
        if not (math.isnan(low) or math.isnan(high)):
            self.low, self.high = min(self.low, low), max(self.high, high)
        # every rollout got the best reward of the run, which was once lower: the tasks look solved
        solved = low == high == self.high and self.low < self.high
        if rollouts and failed == rollouts:
            self._warn(
                f"all {int(rollouts)} rollouts of step {step} failed, so it trained nothing", FIX_FAILURES
            )
        elif groups and flat == groups and rollouts > failed and solved:
            if not self.said_solved:  # success, not a fault: said once, and it does not use up the warning
                self.said_solved = True
                log.info(
                    "GRPO step %d: every rollout got the best reward of this run (%.3f), so "
                    "the step trained nothing: these tasks look solved. Harder tasks would give GRPO more to "
                    "learn.",
                    step,
                    high,
                )
        elif groups and flat / groups >= self.zero_variance_share:
            self._warn(
                f"in step {step}, {int(flat)} of {int(groups)} groups gave every rollout the same reward "
                f"(mean reward {row.get('reward_mean', 0.0):.3f}), so the step trained "
                f"{'nothing' if not row.get('samples') else 'almost nothing'}",
                ADVICE,
            )
        elif first and rollouts > failed and row.get("reward_mean") == 0.0:
            self._warn(f"every rollout of step {step} scored 0", ADVICE)

    def _warn(self, cause: str, advice: str, verdict: str = "is not learning") -> None:
        if self.warned:
            return
        self.warned = True
        log.warning("GRPO %s: %s. %s", verdict, cause, advice)


__all__ = [
    "Failure",
    "Failures",
    "LearningCheck",
    "RolloutsFailedError",
    "check_not_all_failed",
    "rollout_failure",
    "rollout_failures",
]
