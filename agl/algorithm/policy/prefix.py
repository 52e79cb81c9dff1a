"""Shared prompt prefixes: one forward pass of a prompt for all the samples of a batch that start with it.

A GRPO group is several completions of one prompt, and an agent's samples share its system prompt and
tools. The trainer runs such a prefix once, keeps its keys and values (with their autograd graph), and
runs each sample's remainder against them: the same log-probs and gradients as whole samples (a causal
model's prefix states do not depend on what follows), on fewer token positions. A prefix stops before
the first token that carries loss, so no loss token is predicted from a shared position.

Only plain forward passes take this path: activation checkpointing would replay layers that write the
cache, and sliding-window or non-SDPA attention layouts are left to the whole-sample path.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from agl.adapter.trajectory import Sample

MIN_SHARED_TOKENS = 16  # shorter common prefixes save less than the second forward pass costs
_ATTENTION = ("sdpa", "eager")  # layouts whose masks take the hole a shorter prefix leaves


class PrefixRows(NamedTuple):
    """A micro-batch's prefixes: ``length[b]`` tokens of row b equal the first ``length[b]`` tokens of
    row ``source[b]`` and are computed once there (0: row b runs whole)."""

    length: torch.Tensor  # (B,)
    source: torch.Tensor  # (B,)


@dataclass(frozen=True)
class SharedPrefixes:
    """For each sample of a batch, its family (the index of the sample whose prefix it uses; itself when
    it shares none) and the family's shared length (0: none)."""

    family: tuple[int, ...]
    length: tuple[int, ...]

    @classmethod
    def none(cls, n: int) -> SharedPrefixes:
        return cls(tuple(range(n)), (0,) * n)

    @classmethod
    def find(cls, samples: Sequence[Sample], min_tokens: int = MIN_SHARED_TOKENS) -> SharedPrefixes:
        """Families of samples with a common prefix of at least ``min_tokens`` loss-free positions.

        Samples sorted by their tokens put common prefixes side by side; a sample joins the family before
        it when the tokens saved do not drop (a shorter common prefix over more samples), else it starts
        a new one.
        """
        caps = [_shareable(s) for s in samples]
        order = sorted(range(len(samples)), key=lambda i: samples[i].input_ids)
        family, length = list(range(len(samples))), [0] * len(samples)
        members: list[int] = []
        shared = 0

        def close() -> None:
            if len(members) > 1:
                for i in members:
                    family[i], length[i] = members[0], shared

        for i in order:
            if members:
                common = min(shared, caps[i], _common(samples[members[-1]].input_ids, samples[i].input_ids))
                if common >= min_tokens and len(members) * common >= (len(members) - 1) * shared:
                    members.append(i)
                    shared = common
                    continue
                close()
            members, shared = [i], caps[i]
        close()
        return cls(tuple(family), tuple(length))

    def order(self, indices: Sequence[int], lengths: Sequence[int]) -> list[int]:
        """``indices`` with each family together (so a micro-batch holds whole families), then the samples
        that share nothing; shortest first within each."""
        return sorted(
            indices,
            key=lambda i: (self.length[i] == 0, self.family[i] if self.length[i] else 0, lengths[i], i),
        )

    def cost(self, group: Sequence[int], lengths: Sequence[int]) -> int:
        """Token positions a micro-batch of ``group`` computes: each family's prefix once, padded suffixes."""
        suffix = max(lengths[i] - self.length[i] for i in group)
        prefixes = {self.family[i]: self.length[i] for i in group if self.length[i]}
        return len(group) * suffix + len(prefixes) * max(prefixes.values(), default=0)

    def rows(self, group: Sequence[int]) -> PrefixRows | None:
        """The micro-batch's :class:`PrefixRows` (rows in ``group`` order), or None when it shares nothing."""
        if not any(self.length[i] for i in group):
            return None
        first: dict[int, int] = {}
        source = [first.setdefault(self.family[i], row) for row, i in enumerate(group)]
        return PrefixRows(torch.tensor([self.length[i] for i in group]), torch.tensor(source))


def shares(model: Any) -> bool:
    """Whether ``model``'s attention lets a cached prefix stand in for the prefix's positions."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in _ATTENTION:
        return False
    layer_types = getattr(config, "layer_types", None) or ()
    windowed = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    return not windowed and all(t == "full_attention" for t in layer_types)


def shared_hidden(
    model: Any, input_ids: torch.Tensor, attention: torch.Tensor, prefixes: PrefixRows
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's outputs at each row's positions past its prefix, and where they go.

    Returns ``(out, columns)``: ``out[b, j]`` is the output at position ``length[b] + j`` of row b (B, S, ...)
    and ``columns`` (B, S) that position (>= the row's length on padding).
    """
    from transformers import DynamicCache

    length, source = prefixes.length.to(input_ids.device), prefixes.source.to(input_ids.device)
    width = input_ids.shape[1]
    families = torch.unique(source[length > 0])  # rows that hold a prefix
    span = int(length.max())
    prefix_ids = input_ids[families, :span]
    prefix_mask = (torch.arange(span, device=input_ids.device) < length[families].unsqueeze(1)).long()
    rows_len = attention.sum(-1)
    suffix = int((rows_len - length).max())
    columns = length.unsqueeze(1) + torch.arange(suffix, device=input_ids.device)  # (B, S)
    suffix_ids = input_ids.gather(1, columns.clamp(max=width - 1))
    # one embedding lookup for both passes: its backward is a dense (vocabulary x hidden) gradient
    # (SmolLM2: 113 MB zeroed) per lookup
    embedded = model.get_input_embeddings()(torch.cat([prefix_ids.reshape(-1), suffix_ids.reshape(-1)]))
    prefix_embeds, suffix_embeds = embedded.split([prefix_ids.numel(), suffix_ids.numel()])
    cache = DynamicCache(config=model.config)
    arg = _cache_argument(model)
    model(
        inputs_embeds=prefix_embeds.view(*prefix_ids.shape, -1),
        attention_mask=prefix_mask,
        use_cache=True,
        **{arg: cache},
    )
    # each row reads its family's keys and values; rows without a prefix read none of them (masked)
    slot = torch.zeros(int(source.max()) + 1, dtype=torch.long, device=input_ids.device)
    slot[families] = torch.arange(len(families), device=input_ids.device)
    cache.batch_select_indices(slot[source])
    inside = columns < rows_len.unsqueeze(1)
    seen = (torch.arange(span, device=input_ids.device) < length.unsqueeze(1)).long()
    out = model(
        inputs_embeds=suffix_embeds.view(*suffix_ids.shape, -1),
        attention_mask=torch.cat([seen, inside.long()], dim=1),
        position_ids=columns,
        use_cache=True,
        **{arg: cache},
    )
    if cache.get_seq_length() != span + suffix:  # a layer ran without the cache: its outputs are wrong
        raise RuntimeError(
            "the model did not extend the shared-prefix cache; train with share_prefixes=False"
        )
    return out.logits, columns


def _cache_argument(model: Any) -> str:
    """transformers >= 5.2x names the cache argument ``cache``; older releases ``past_key_values``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # a PEFT wrapper
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


def _shareable(sample: Sample) -> int:
    """Positions before the first loss token's predecessor: a prefix this long predicts no loss token."""
    first = next((t for t, m in enumerate(sample.loss_mask) if m), len(sample.input_ids))
    return max(first - 1, 0)


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
