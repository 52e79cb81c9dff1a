"""agl: make any AI agent better by training it (GRPO, APO, SFT) with almost no change to its code.

The public names are listed in ``__all__`` and loaded lazily, so ``import agl`` stays fast; the
``TYPE_CHECKING`` imports below show type checkers the real objects behind them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Algorithm": "agl.algorithm",
    "ModelSpec": "agl.algorithm",
    "GRPO": "agl.algorithm.grpo",
    "GRPOConfig": "agl.algorithm.grpo",
    "WarmStart": "agl.algorithm.grpo",
    "SFT": "agl.algorithm.sft",
    "SFTConfig": "agl.algorithm.sft",
    "Teacher": "agl.algorithm.teacher",
    "TrainingContext": "agl.algorithm",
    "as_algorithm": "agl.algorithm",
    "APO": "agl.algorithm.apo",
    "APOConfig": "agl.algorithm.apo",
    "CommandAgent": "agl.agent",
    "LitAgent": "agl.agent",
    "Runner": "agl.runner",
    "Serving": "agl.trainer",
    "Trainer": "agl.trainer",
    "agent_scope": "agl.emit",
    "emit_annotation": "agl.emit",
    "emit_exception": "agl.emit",
    "emit_message": "agl.emit",
    "emit_object": "agl.emit",
    "emit_reward": "agl.emit",
    "instrument": "agl.tracer",
    "operation": "agl.emit",
    "post_reward": "agl.gateway.rewards",
    "rollout": "agl.agent",
    "openai_client": "agl.agent",
    "LLM": "agl.schemas",
    "Attempt": "agl.schemas",
    "AttemptStatus": "agl.schemas",
    "InMemoryLightningStore": "agl.store",
    "LightningStore": "agl.store",
    "LightningStoreClient": "agl.store.client",
    "PromptTemplate": "agl.schemas",
    "ResourcesVersion": "agl.schemas",
    "RetryConfig": "agl.schemas",
    "RewardError": "agl.errors",
    "Rollout": "agl.schemas",
    "RolloutStatus": "agl.schemas",
    "Span": "agl.schemas",
    "SqliteLightningStore": "agl.store",
    "SyncLightningStore": "agl.store",
    "open_store": "agl.store",
    "evaluate_models": "agl.trainer.evaluation",
}

# what type checkers see behind the lazy __getattr__ (tests/test_public_api.py keeps the three lists in step)
if TYPE_CHECKING:
    from agl import engines as engines
    from agl import errors as errors
    from agl import metrics as metrics
    from agl import models as models
    from agl import rewards as rewards
    from agl import sandbox as sandbox
    from agl import store as store
    from agl.agent import CommandAgent, LitAgent, openai_client, rollout
    from agl.algorithm import (
        Algorithm,
        ModelSpec,
        TrainingContext,
        as_algorithm,
    )
    from agl.algorithm.apo import APO, APOConfig
    from agl.algorithm.grpo import GRPO, GRPOConfig, WarmStart
    from agl.algorithm.sft import SFT, SFTConfig
    from agl.algorithm.teacher import Teacher
    from agl.emit import (
        agent_scope,
        emit_annotation,
        emit_exception,
        emit_message,
        emit_object,
        emit_reward,
        operation,
    )
    from agl.errors import RewardError
    from agl.gateway.rewards import post_reward
    from agl.runner import Runner
    from agl.schemas import (
        LLM,
        Attempt,
        AttemptStatus,
        PromptTemplate,
        ResourcesVersion,
        RetryConfig,
        Rollout,
        RolloutStatus,
        Span,
    )
    from agl.store import (
        InMemoryLightningStore,
        LightningStore,
        SqliteLightningStore,
        SyncLightningStore,
        open_store,
    )
    from agl.store.client import LightningStoreClient
    from agl.tracer.instrument import instrument
    from agl.trainer import Serving, Trainer
    from agl.trainer.evaluation import evaluate_models

__all__ = [
    "APO",
    "APOConfig",
    "Algorithm",
    "Attempt",
    "AttemptStatus",
    "CommandAgent",
    "GRPO",
    "GRPOConfig",
    "InMemoryLightningStore",
    "LLM",
    "LightningStore",
    "LightningStoreClient",
    "LitAgent",
    "ModelSpec",
    "PromptTemplate",
    "ResourcesVersion",
    "RetryConfig",
    "RewardError",
    "Rollout",
    "RolloutStatus",
    "Runner",
    "SFT",
    "SFTConfig",
    "Serving",
    "Span",
    "SqliteLightningStore",
    "SyncLightningStore",
    "Teacher",
    "Trainer",
    "TrainingContext",
    "WarmStart",
    "agent_scope",
    "as_algorithm",
    "emit_annotation",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "evaluate_models",
    "instrument",
    "open_store",
    "openai_client",
    "operation",
    "post_reward",
    "rollout",
]


_SUBMODULES = {
    "engines",
    "errors",
    "metrics",
    "models",
    "rewards",
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
