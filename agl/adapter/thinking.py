"""Reasoning models' ``<think>...</think>`` blocks in token ids: finding the tags and masking them out of the loss.

Samples hold only token ids, so the tags' ids come from the tokenizer (:func:`think_token_ids`, which GRPO
calls when the policy loads) and :func:`mask_thinking` works on ids alone. Token ids never change: masking
only sets ``loss_mask`` to 0, so the sequence the model saw is the sequence it trains on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agl.adapter.trajectory import Sample

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def think_token_ids(tokenizer: Any) -> tuple[int, int] | None:
    """``(open_id, close_id)`` when ``<think>`` and ``</think>`` are each one token of ``tokenizer``, else None."""
    ids = []
    for tag in (THINK_OPEN, THINK_CLOSE):
        encoded = tokenizer(tag, add_special_tokens=False)["input_ids"]
        if len(encoded) != 1 or tokenizer.convert_ids_to_tokens(encoded[0]) != tag:
            return None
        ids.append(int(encoded[0]))
    return ids[0], ids[1]


def mask_thinking(sample: Sample, open_id: int, close_id: int) -> tuple[Sample, int]:
    """``sample`` with the model's own thinking tokens (``<think>`` through ``</think>``, both included)
    out of the loss, and how many trained tokens that took out.

    The whole sequence is scanned, so a completion that starts inside a block its prompt opened
    (templates that put ``<think>`` in the generation prompt) is masked up to its ``</think>``.
    """
    mask = list(sample.loss_mask)
    inside, masked = False, 0
    for i, token in enumerate(sample.input_ids):
        if token == open_id:
            inside = True
        if inside and mask[i]:
            mask[i], masked = 0, masked + 1
        if token == close_id:
            inside = False
    if not masked:
        return sample, 0
    return dataclasses.replace(sample, loss_mask=tuple(mask)), masked


__all__ = ["THINK_CLOSE", "THINK_OPEN", "mask_thinking", "think_token_ids"]
