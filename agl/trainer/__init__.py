"""The Trainer: wiring only. ``dev`` for a quick debug loop, ``fit`` to train; ``Serving`` says how the model is served."""

from typing import TYPE_CHECKING, Any

from agl.trainer.serving import Serving
from agl.trainer.trainer import Trainer

if TYPE_CHECKING:
    from agl.trainer.trainer import GatewaySettings as GatewaySettings

__all__ = ["Serving", "Trainer"]


def __getattr__(name: str) -> Any:
    if name == "GatewaySettings":  # deprecated: warns, and is Serving
        from agl.trainer.trainer import gateway_settings_alias

        return gateway_settings_alias()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
