"""Why a rollout yielded no reward: ``infra``, ``agent`` or ``reward``, decided once and stored with its attempt.

``infra``: the model could not be reached or served (gateway or engine error, connection refused, a
5xx or 429 reply), an attempt timed out, the runner or its node was lost, the store was unreachable.
``agent``: the user's code raised (a framework limit such as a recursion limit included).
``reward``: the reward itself failed: an :class:`agl.RewardError` (raised by the user around the reward
computation, or by ``emit_reward`` for a reward that is not a finite number).

The runner stores the class in the failed attempt's ``metadata["failure_class"]``; attempts that end
without a runner's report (the store's watchdog times them out or finds them unresponsive) are ``infra``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Literal, get_args

from agl.errors import GatewayError, RewardError, StoreUnavailableError

FailureClass = Literal["infra", "agent", "reward"]
FAILURE_CLASSES: tuple[FailureClass, ...] = get_args(FailureClass)
#: the attempt metadata key that holds the class
METADATA_KEY = "failure_class"

# exception types (by class name, so neither openai nor httpx is imported) that mean the model or the
# network failed, not the agent: openai's and httpx's connection and timeout errors
_INFRA_NAMES = frozenset(
    {
        "APIConnectionError",
        "APITimeoutError",
        "InternalServerError",
        "RateLimitError",
        "ConnectError",
        "ConnectTimeout",
        "ReadTimeout",
        "WriteTimeout",
        "PoolTimeout",
        "ReadError",
        "WriteError",
        "RemoteProtocolError",
        "NetworkError",
        "TimeoutException",
        "ServerDisconnectedError",
        "ClientConnectorError",
    }
)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during (``__cause__``, ``__context__``)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _is_infra(exc: BaseException) -> bool:
    if isinstance(exc, (GatewayError, StoreUnavailableError, ConnectionError, TimeoutError)):
        return True
    names = {t.__name__ for t in type(exc).__mro__}
    if names & _INFRA_NAMES:
        return True
    status = getattr(exc, "status_code", None)  # an HTTP error reply (openai's APIStatusError)
    return "APIStatusError" in names and isinstance(status, int) and (status >= 500 or status == 429)


def classify_exception(exc: BaseException) -> FailureClass:
    """The class of an exception a rollout ended with: a :class:`RewardError` anywhere in its chain is
    ``reward``; a connection, timeout, gateway or store error is ``infra``; anything else is ``agent``."""
    chain = list(_chain(exc))
    if any(isinstance(e, RewardError) for e in chain):
        return "reward"
    if any(_is_infra(e) for e in chain):
        return "infra"
    return "agent"


def stored_class(metadata: Mapping[str, Any]) -> FailureClass | None:
    """The class a runner stored in an attempt's metadata, if it stored a known one."""
    value = metadata.get(METADATA_KEY)
    return value if value in FAILURE_CLASSES else None


__all__ = ["FAILURE_CLASSES", "METADATA_KEY", "FailureClass", "classify_exception", "stored_class"]
