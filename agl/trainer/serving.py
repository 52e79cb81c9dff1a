"""``agl.Serving``: how ``fit`` serves the algorithm's model (engine, gateway, sampling)."""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agl.errors import ConfigError

if TYPE_CHECKING:
    from agl.engines.launch import EngineSpec


@dataclass(frozen=True)
class Serving:
    """How ``fit`` serves the algorithm's model to the agents: the engine, the LLM gateway in front of it,
    and the sampling parameters agents get with the ``llm`` resource. ``Trainer(serving=agl.Serving(...))``.

    Args:
        engine: ``agl.engines.BuiltinEngine(options)`` (None: the built-in engine with no options) or
            ``agl.engines.VllmEngine(replicas=..., ...)`` (vLLM replicas behind the gateway).
        sampling: the ``sampling_parameters`` of the LLM resource agents get (the policy's own); temperature
            0.7 by default, as the recipes train (at 1.0 SmolLM2 failed every rollout of the calc demo's first step).
        host, port: where the gateway binds (``0.0.0.0`` for runners on other machines; port 0: a free one).
        public_host: the host name remote runners use; defaults to ``host``, or this machine's name
            when that is a wildcard address.
        token: required on model calls; agents get it as ``llm.api_key``. A gateway bound beyond
            loopback without one gets a generated token (printed once), so it is never open there.
        admin_token: guards ``/admin/*`` and ``/metrics``; a random one when not given (``fit``
            itself pauses and flushes the gateway in process, without HTTP).
    """

    engine: EngineSpec | None = None
    sampling: dict[str, Any] = dataclasses.field(default_factory=lambda: {"temperature": 0.7})
    host: str = "127.0.0.1"
    port: int = 0
    public_host: str | None = None
    token: str | None = dataclasses.field(default=None, repr=False)
    admin_token: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, Mapping):
            raise ConfigError(
                f"Serving.sampling must be a mapping such as {{'temperature': 0.7}}, got {self.sampling!r}"
            )
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ConfigError(f"Serving.port must be 0 (a free one) to 65535, got {self.port!r}")
        object.__setattr__(self, "sampling", dict(self.sampling))

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach ``host``."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name: assume it resolves beyond loopback
            return False


__all__ = ["Serving"]
