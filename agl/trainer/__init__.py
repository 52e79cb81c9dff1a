"""The Trainer: wiring only. ``dev`` for a quick debug loop, ``fit`` to train."""

from agl.trainer.trainer import Trainer

__all__ = ["Trainer"]
