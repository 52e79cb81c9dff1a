"""The Trainer: wiring only. ``dev`` for a quick debug loop, ``fit`` to train."""

from agl.trainer.trainer import GatewaySettings, Trainer

__all__ = ["GatewaySettings", "Trainer"]
