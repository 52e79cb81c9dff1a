"""SFT: select rollouts, build masked samples, train, push weights; iterated as rejection-sampling fine-tuning."""

from agl.algorithm.sft.algorithm import SFT, SFTConfig
from agl.algorithm.sft.samples import (
    conversations_from_spans,
    export_jsonl,
    samples_from_messages,
    samples_from_spans,
    select_rollouts,
)

__all__ = [
    "SFT",
    "SFTConfig",
    "conversations_from_spans",
    "export_jsonl",
    "samples_from_messages",
    "samples_from_spans",
    "select_rollouts",
]
