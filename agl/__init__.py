"""agl: make any AI agent better by training it (GRPO, APO, SFT) with almost no change to its code.

The public names are listed in ``__all__`` and loaded lazily, so ``import agl`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Algorithm": "agl.algorithm",
    "GRPO": "agl.algorithm.grpo",
    "GRPOConfig": "agl.algorithm.grpo",
    "WarmStart": "agl.algorithm.grpo",
    "SFT": "agl.algorithm.sft",
    "SFTConfig": "agl.algorithm.sft",
    "TrainingContext": "agl.algorithm",
    "as_algorithm": "agl.algorithm",
    "APO": "agl.algorithm.apo",
    "APOConfig": "agl.algorithm.apo",
    "CommandAgent": "agl.agent",
    "LitAgent": "agl.agent",
    "Runner": "agl.runner",
    "Trainer": "agl.trainer",
    "agent_scope": "agl.emit",
    "emit_annotation": "agl.emit",
    "emit_exception": "agl.emit",
    "emit_message": "agl.emit",
    "emit_object": "agl.emit",
    "emit_reward": "agl.emit",
    "instrument": "agl.tracer",
    "operation": "agl.emit",
    "rollout": "agl.agent",
    "LLM": "agl.schemas",
    "Attempt": "agl.schemas",
    "AttemptStatus": "agl.schemas",
    "InMemoryLightningStore": "agl.store",
    "LightningStore": "agl.store",
    "LightningStoreClient": "agl.store.client",
    "PromptTemplate": "agl.schemas",
    "ResourcesVersion": "agl.schemas",
    "RetryConfig": "agl.schemas",
    "Rollout": "agl.schemas",
    "RolloutStatus": "agl.schemas",
    "Span": "agl.schemas",
    "SqliteLightningStore": "agl.store",
    "SyncLightningStore": "agl.store",
    "open_store": "agl.store",
}

__all__ = sorted(_EXPORTS)


_SUBMODULES = {
    "engines",
    "errors",
    "metrics",
    "models",
    "sandbox",
    "store",
}  # reachable as agl.NAME without an import


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"agl.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
