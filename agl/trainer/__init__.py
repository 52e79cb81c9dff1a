"""The Trainer: wiring only. ``dev`` for a quick debug loop, ``fit`` to train; ``Serving`` says how the model is served."""

from agl.trainer.serving import Serving
from agl.trainer.trainer import Trainer

__all__ = ["Serving", "Trainer"]
