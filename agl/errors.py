"""The one exception tree of agl.

    AglError
    ├── StoreError
    │   ├── NotFoundError          an id the store does not know
    │   ├── InvalidTransitionError a status change the state machine forbids
    │   ├── ConflictError          a write that clashes with stored state
    │   │   └── StaleAttemptError  an update from an attempt that no longer owns its rollout
    │   ├── InvalidSpanError       a span that fails validation
    │   ├── UnauthorizedError      a missing or wrong token (remote stores)
    │   └── StoreUnavailableError  the backend or server cannot be reached
    ├── GatewayError
    ├── JudgeError                 a reward judge gave no usable scores for a group (``agl.rewards.Judge``)
    ├── TeacherError               a distillation teacher could not score a step's tokens
    ├── AgentError
    │   ├── NoActiveRolloutError   an emitter called outside a rollout
    │   ├── RolloutsFailedError    every rollout of the first step (or the baseline) failed: nothing to learn
    │   └── RewardError            the reward could not be computed (a rollout failure of class ``reward``)
    └── ConfigError                bad arguments or a missing optional dependency
        └── InvalidRequestError    a bad field in a model request (``param`` names it)

Every error carries the ``rollout_id`` and ``attempt_id`` it concerns, when there is one.
"""

from __future__ import annotations

from pathlib import Path


class AglError(Exception):
    """Root of every error agl raises on purpose."""

    def __init__(self, message: str, *, rollout_id: str | None = None, attempt_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id


class StoreError(AglError):
    """A LightningStore operation could not be carried out."""


class NotFoundError(StoreError):
    """The store has no object with the given id."""


class InvalidTransitionError(StoreError):
    """The requested status change is not allowed by the state machine."""


class ConflictError(StoreError):
    """The write clashes with what is stored (duplicate id, different content)."""


class StaleAttemptError(ConflictError):
    """An attempt that was superseded (timed out, unresponsive, retried) tried to change its rollout."""


class InvalidSpanError(StoreError):
    """A span failed validation; nothing of the batch was stored."""


class UnauthorizedError(StoreError):
    """The remote store refused the request: missing or wrong bearer token."""


class StoreUnavailableError(StoreError):
    """The store backend or server could not be reached after retries."""


class GatewayError(AglError):
    """The LLM gateway could not serve or record a call."""


class JudgeError(AglError):
    """A reward judge gave no usable scores (bad replies after its retries, or an unreachable endpoint):
    the rollouts it judged get no reward, never a reward of 0."""

    def __init__(
        self,
        message: str,
        *,
        group_id: str | None = None,
        replies: list[str] | None = None,
        **kwargs: str | None,
    ) -> None:
        super().__init__(message, **kwargs)
        self.group_id = group_id
        self.replies = list(replies or [])  # the judge's raw reply of every try


class TeacherError(AglError):
    """A distillation teacher's endpoint failed to score a step's tokens (unreachable, an error status, or
    a reply without ``prompt_logprobs``): the step stops rather than train without its teacher."""


class AgentError(AglError):
    """The agent or its runner was used incorrectly."""


class NoActiveRolloutError(AgentError):
    """An emitter was called outside of a rollout and no local-only span was requested."""


class RolloutsFailedError(AgentError):
    """Every rollout of the first step (or of the baseline evaluation) failed: training would learn nothing."""


class RewardError(AgentError):
    """The reward function failed: raise it (``raise agl.RewardError(...) from exc``) around the reward
    computation so the rollout's failure is classed ``reward``, not ``agent``, and never trains."""


class ConfigError(AglError):
    """Invalid configuration, or an optional dependency is missing."""


def install_command(extra: str) -> str:
    """The pip command that installs agl's ``extra``: from the index, or, when agl runs from a clone (an
    editable install), from that clone, where ``pip install 'agl[...]'`` would fetch another agl."""
    clone = Path(__file__).resolve().parents[1]
    if (clone / "pyproject.toml").is_file():
        return f"pip install -e '{clone}[{extra}]'"
    return f"pip install 'agl[{extra}]'"


def missing_extra(package: str, extra: str) -> ConfigError:
    """The error to raise when an optional dependency is not installed."""
    return ConfigError(f"{package} is not installed; install it with `{install_command(extra)}`.")


class InvalidRequestError(ConfigError):
    """A request to a model engine or server has a bad field; ``param`` names it (OpenAI error ``param``)."""

    def __init__(self, message: str, *, param: str | None = None, **kwargs: str | None) -> None:
        super().__init__(message, **kwargs)
        self.param = param
