"""Upstream replicas: sticky routing per rollout, failure marking and background health probes.

Routing uses rendezvous (highest-random-weight) hashing of the rollout id over the healthy replicas that
serve the model, so a rollout keeps its replica (and the engine's prefix cache) while that replica is
healthy, and only the rollouts of a failed replica move. Calls without a rollout go to the least busy one.
A replica is marked unhealthy on a transport error or 5xx (when there is another to fail over to) and
comes back when the gateway's health probe succeeds.
"""

from __future__ import annotations

import logging
import zlib
from collections.abc import Sequence

from agl.gateway.config import UpstreamConfig

logger = logging.getLogger(__name__)


class Replica:
    """One upstream and its live state."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.healthy = True
        self.inflight = 0
        self.failures = 0
        self.calls = 0

    def serves(self, model: str | None, api: str | None = None) -> bool:
        if api is not None and self.config.apis is not None and api not in self.config.apis:
            return False
        return self.config.models is None or model is None or model in self.config.models

    def score(self, key: str) -> int:
        return zlib.crc32(f"{key}|{self.config.url}".encode())


class UpstreamPool:
    """The replicas of a gateway; ``candidates`` orders them for one call."""

    def __init__(self, upstreams: Sequence[UpstreamConfig]) -> None:
        self.replicas = [Replica(u) for u in upstreams]

    def models(self) -> list[str]:
        """Models named in the configuration (replicas serving any model add none)."""
        seen: dict[str, None] = {}
        for r in self.replicas:
            for m in r.config.models or []:
                seen[m] = None
        return list(seen)

    def candidates(self, model: str | None, key: str | None, api: str | None = None) -> list[Replica]:
        """Replicas serving ``model`` and ``api``, in the order to try them: healthy ones first (sticky by
        ``key``), unhealthy ones last."""
        pool = [r for r in self.replicas if r.serves(model, api)]
        # a replica naming the model wins over those serving any model (a teacher beside the policy);
        # a call naming no model goes to the catch-all ones
        named = [r for r in pool if r.config.models is not None and model in r.config.models]
        catch_all = [r for r in pool if r.config.models is None]
        pool = named or (catch_all if model is None and catch_all else pool)
        if key is not None:
            pool.sort(key=lambda r: r.score(key), reverse=True)
        else:
            pool.sort(key=lambda r: r.inflight)
        return [r for r in pool if r.healthy] + [r for r in pool if not r.healthy]

    def mark_failed(self, replica: Replica, reason: str) -> None:
        replica.failures += 1
        if replica.healthy and len(self.replicas) > 1:
            logger.warning("upstream %s marked unhealthy: %s", replica.config.backend, reason)
            replica.healthy = False

    def mark_ok(self, replica: Replica) -> None:
        if not replica.healthy:
            logger.info("upstream %s is healthy again", replica.config.backend)
        replica.healthy = True
