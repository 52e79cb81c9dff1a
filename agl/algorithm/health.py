"""Why a run is not learning, said as it happens: rollouts that fail, and rewards that give no signal.

Failed rollouts are counted per step with the first one's error (from its attempt, or its exception span).
When every rollout of the first step or of the baseline evaluation fails, training stops with that error
(:func:`check_not_all_failed`) rather than running steps that train nothing. :class:`LearningCheck` warns
once per run when the rewards cannot teach anything: every group scored alike, or nothing scored at all.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agl import semconv as sc
from agl.errors import AgentError
from agl.schemas import Rollout, RolloutStatus, Span
from agl.store.base import LightningStore

log = logging.getLogger(__name__)

ERROR_CHARS = 160  # the first error as the console line shows it; the exception keeps more
ZERO_VARIANCE_SHARE = 0.9  # a step with at least this share of flat groups trains (almost) nothing


class RolloutsFailedError(AgentError):
    """Every rollout of the first step (or of the baseline evaluation) failed: training would learn nothing."""


@dataclass(frozen=True)
class Failures:
    """How many of ``total`` rollouts did not succeed, and the first one's error (``Type: message``)."""

    failed: int
    total: int
    first_error: str | None = None

    @property
    def all_failed(self) -> bool:
        return self.total > 0 and self.failed == self.total

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """``failed_rollouts`` and ``rollouts`` (with ``prefix``, e.g. ``val_``) for a metrics row."""
        return {f"{prefix}failed_rollouts": float(self.failed), f"{prefix}rollouts": float(self.total)}

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
    """Count the rollouts that did not succeed and find the first one's error.

    The error is the failed attempt's (the runner stores ``Type: message``), else the rollout's last
    exception span, else its status (e.g. still running when the wait for it ended).
    """
    failed = [r for r in rollouts if r.status != RolloutStatus.SUCCEEDED]
    if not failed:
        return Failures(0, len(rollouts))
    first = failed[0]
    return Failures(
        len(failed), len(rollouts), await _error_of(store, first, spans.get(first.rollout_id, ()))
    )


async def _error_of(store: LightningStore, rollout: Rollout, spans: Sequence[Span]) -> str:
    attempts = (await store.query_attempts(rollout_id=rollout.rollout_id)).items
    errors = [a.error for a in sorted(attempts, key=lambda a: a.attempt_number) if a.error]
    if errors:
        return errors[-1]
    raised = [s for s in spans if s.name == sc.SPAN_EXCEPTION]
    if raised:
        attrs = raised[-1].attributes
        return f"{attrs.get(sc.EXCEPTION_TYPE)}: {attrs.get(sc.EXCEPTION_MESSAGE)}"
    if not rollout.status.is_terminal:
        return f"rollout not finished in time (status {rollout.status.value}): are runners serving the store?"
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
    "a larger group (GRPOConfig(group_size=16)), so that a rare success lands in a group."
)


FIX_FAILURES = (
    "Fix the rollouts' error first: each step's console line shows the first one, and "
    "`agl.Trainer().dev(agent, tasks, resources)` runs a few tasks with their errors and span trees."
)


class LearningCheck:
    """Warns once per run when GRPO cannot learn: groups without reward variance, or no reward at all.

    GRPO trains only on groups whose rollouts scored differently; when (almost) every group scored alike,
    steps train (almost) nothing and the run idles without error. The warning names the cause and
    what to try.
    """

    def __init__(self, zero_variance_share: float = ZERO_VARIANCE_SHARE) -> None:
        self.zero_variance_share = zero_variance_share
        self.warned = False
        self.said_solved = False
        self.low, self.high = math.inf, -math.inf  # the lowest and highest rollout reward so far

    def at_start(self, val_reward: float, phases: Mapping[str, float], failures: Failures) -> None:
        """Check the held-out reward GRPO starts from (after the warm start, when there is one)."""
        if failures.all_failed:
            self._warn(f"all {failures.total} rollouts of the baseline evaluation failed", FIX_FAILURES)
            return
        if math.isnan(val_reward) or val_reward != 0.0:
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


__all__ = ["Failures", "LearningCheck", "RolloutsFailedError", "check_not_all_failed", "rollout_failures"]
