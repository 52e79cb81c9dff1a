"""SFT: select rollouts, build masked samples, train, push weights; iterated as rejection-sampling fine-tuning,
or offline on rollouts already in a store (``SFTConfig(from_store=...)``, :func:`train_from_store`)."""

from agl.algorithm.sft.algorithm import SFT, train_from_store
from agl.algorithm.sft.config import SFTConfig
from agl.algorithm.sft.offline import samples_from_store
from agl.algorithm.sft.samples import (
    conversations_from_spans,
    export_jsonl,
    samples_from_messages,
    samples_from_spans,
    select_rollouts,
    tools_from_spans,
)

__all__ = [
    "SFT",
    "SFTConfig",
    "conversations_from_spans",
    "export_jsonl",
    "samples_from_messages",
    "samples_from_spans",
    "samples_from_store",
    "select_rollouts",
    "tools_from_spans",
    "train_from_store",
]
