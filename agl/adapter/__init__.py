"""Adapters: spans to training data. Pure and deterministic: no I/O, no clock, never re-tokenizes."""

from agl.adapter.calls import filter_calls, llm_calls
from agl.adapter.messages import to_messages
from agl.adapter.rewards import call_rewards, final_reward
from agl.adapter.trajectory import MergeReport, Sample, to_samples

__all__ = [
    "MergeReport",
    "Sample",
    "call_rewards",
    "filter_calls",
    "final_reward",
    "llm_calls",
    "to_messages",
    "to_samples",
]
