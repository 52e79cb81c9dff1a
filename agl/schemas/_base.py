"""Shared helpers for the wire models: id generation and the strict base model."""

from __future__ import annotations

import secrets
import time

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    """Base of every model that crosses a process boundary; unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False)


def new_id(prefix: str, nbytes: int = 6) -> str:
    """A short random id such as ``ro-3f9a1c2b7d4e``."""
    return f"{prefix}-{secrets.token_hex(nbytes)}"


def now_s() -> float:
    """Wall-clock seconds; the store's default clock."""
    return time.time()
