"""What ``fit`` keeps off the console: transformers' progress bars and warnings known to be harmless."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

#: (logger, message fragment) of warnings fit silences: each is expected and says nothing to act on
HARMLESS = (
    # activation checkpointing in training turns the KV cache off, as it must
    ("transformers.utils.generic", "is incompatible with gradient checkpointing"),
    ("transformers.modeling_layers", "is incompatible with gradient checkpointing"),
)


class _DropHarmless(logging.Filter):
    def __init__(self, fragment: str) -> None:
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Within: no transformers/hub progress bars ("Loading weights" for the engine and the policy, "Writing
    model shards") and none of the :data:`HARMLESS` warnings; every other warning still shows."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # an algorithm without a model: nothing to quiet
        yield
        return
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    filters = [(logging.getLogger(name), _DropHarmless(fragment)) for name, fragment in HARMLESS]
    for logger, flt in filters:
        logger.addFilter(flt)
    try:
        yield
    finally:
        for logger, flt in filters:
            logger.removeFilter(flt)
        if bars:
            hf_logging.enable_progress_bar()
