"""SFT warm start before GRPO: a few masked-NLL steps on known-good conversations, on GRPO's own policy.

A small model that never produces the tool-call format gets no reward, so every GRPO group is flat;
a short supervised start gives GRPO something to sharpen. ``GRPOConfig(warm_start=WarmStart(...))``
runs it inside ``GRPO.run`` and reports held-out reward before and after it (``result["phases"]``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agl.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStart:
    """Conversations in OpenAI chat format (assistant turns, tool calls included, are trained on),
    the tools the agent declares (rendered into the prompt as at inference), and the SFT schedule.

    ``lr`` defaults to GRPO's; GRPO's own learning rate is restored afterwards.
    """

    conversations: Sequence[list[dict[str, Any]]]
    tools: list[dict[str, Any]] | None = None
    steps: int = 8
    batch_size: int = 8
    lr: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.conversations:
            raise ConfigError("WarmStart needs at least one conversation to train on")
        if self.steps < 1 or self.batch_size < 1:
            raise ConfigError(
                f"WarmStart steps and batch_size must be >= 1, got {self.steps}, {self.batch_size}"
            )
        if self.lr is not None and self.lr <= 0:
            raise ConfigError(f"WarmStart lr must be > 0, got {self.lr}")

    @classmethod
    def from_jsonl(cls, path: str | Path, **schedule: Any) -> WarmStart:
        """The conversations and tools of an OpenAI chat JSONL file (``{"messages": [...], "tools":
        [...]}`` per line, as ``OUT/teacher_traces.jsonl``), with ``schedule`` (steps, batch_size, lr, seed).

        Raises:
            ConfigError: the file holds no conversation, a malformed line, or lines with other tools.
        """
        from agl.algorithm.chat_jsonl import import_jsonl

        if "conversations" in schedule or "tools" in schedule:
            raise ConfigError("WarmStart.from_jsonl reads conversations and tools from the file")
        conversations, tools = import_jsonl(path)
        if not conversations:
            raise ConfigError(f"WarmStart.from_jsonl: {path} holds no conversation")
        return cls(conversations, tools, **schedule)


def train_warm_start(policy: Any, warm: WarmStart) -> list[dict[str, float]]:
    """Blocking: ``warm.steps`` SFT steps on ``policy`` (random batches of the conversations' turns)."""
    from agl.algorithm.sft.samples import samples_from_messages
    from agl.algorithm.teacher import sft_steps

    samples = samples_from_messages(policy.tokenizer, list(warm.conversations), warm.tools)
    if not samples:
        raise ConfigError("WarmStart conversations have no assistant turn to train on")
    return sft_steps(
        policy, samples, steps=warm.steps, batch_size=warm.batch_size, lr=warm.lr, seed=warm.seed
    )


__all__ = ["WarmStart", "train_warm_start"]
