"""The running batch: left-padded sequences sharing one KV cache, stepped token by token.

New sequences are prefilled on their own and merged into the running batch by left-padding the shorter
cache; finished rows are dropped and all-padding columns trimmed, so each sequence finishes independently
(continuous batching). Everything here runs on the engine's worker thread.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agl.engines.builtin.lean_decode import DecodeStep
from agl.engines.builtin.prefix_cache import PrefixCache
from agl.engines.builtin.sampling import SamplingParams, sample_step


@dataclass(eq=False)
class Sequence:
    """One choice being generated: exact prompt and completion ids, raw logprobs, text so far."""

    request: Any
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    generator: torch.Generator
    version: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    streamed_tokens: int = 0
    streamed_chars: int = 0


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes: keys and values of every layer's key/value heads."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(2 * config.num_hidden_layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size())


def cache_tokens(seqs: list[Sequence]) -> int:
    """The most KV-cache tokens ``seqs`` can come to in one left-padded batch: rows x the longest
    prompt plus max_tokens (every row is padded to the widest)."""
    if not seqs:
        return 0
    return len(seqs) * max(len(s.prompt_ids) + s.max_tokens for s in seqs)


def _map_cache(cache: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    for layer in cache.layers:
        layer.keys = fn(layer.keys)
        layer.values = fn(layer.values)


def _pad_left(t: torch.Tensor, amount: int, dim: int) -> torch.Tensor:
    if amount == 0:
        return t
    shape = list(t.shape)
    shape[dim] = amount
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class RunningBatch:
    """Rows of ``seqs`` with their KV cache, attention mask, next positions and next input tokens."""

    def __init__(
        self,
        model: Any,
        pad_id: int,
        on_token: Callable[[Sequence], None],
        prefix_cache: PrefixCache | None = None,
        decode_step: DecodeStep | None = None,
    ) -> None:
        self.model = model
        self.pad_id = pad_id
        self.on_token = on_token  # called after each appended token: sets finish_reason and text
        self.prefix_cache = prefix_cache  # finished rows go in; new prompts skip the prefix they share
        self.decode_step = decode_step  # the lean one-token step (see .lean_decode), else the model's forward
        # transformers >= 5.2x names the argument ``cache``; older releases ``past_key_values``
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.seqs: list[Sequence] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device  # type: ignore[no-any-return]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        step = sample_step(
            logits,
            [s.params.temperature for s in seqs],
            [s.params.top_p for s in seqs],
            [s.generator for s in seqs],
            [s.params.top_logprobs for s in seqs],
        )
        for i, seq in enumerate(seqs):
            seq.token_ids.append(step.token_ids[i])
            seq.logprobs.append(step.logprobs[i])
            seq.top.append(step.top[i])
            self.on_token(seq)
        return torch.tensor(step.token_ids, device=logits.device)

    def add(self, new: list[Sequence]) -> None:
        """Prefill ``new`` (sampling their first token) and merge them into the batch."""
        from transformers import DynamicCache

        # equal prompts (a request's n choices, a GRPO group's rollouts) are prefilled once and copied
        distinct: dict[tuple[int, ...], int] = {}
        rows = [distinct.setdefault(tuple(s.prompt_ids), len(distinct)) for s in new]
        prompts = list(distinct)
        cache = DynamicCache(config=self.model.config)
        hits = [
            self.prefix_cache.lookup(list(p)) if self.prefix_cache is not None else (None, 0) for p in prompts
        ]
        reused = [n for _, n in hits]
        # each row: [its cached prefix, right-aligned in the widest] [its remaining prompt, right-aligned]
        cached_w = max(reused)
        width = max(len(p) - n for p, n in zip(prompts, reused, strict=True))
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), cached_w + width), dtype=torch.long)
        for row, (prompt, n) in enumerate(zip(prompts, reused, strict=True)):
            rest = prompt[n:]
            ids[row, width - len(rest) :] = torch.tensor(rest)
            mask[row, cached_w - n : cached_w] = 1
            mask[row, cached_w + width - len(rest) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        offset = torch.tensor(reused, device=self.device).unsqueeze(1)
        positions = (mask[:, cached_w:].cumsum(-1) - 1).clamp(min=0) + offset
        if cached_w:
            self._fill(cache, hits, cached_w)
        width += cached_w
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: cache},
        )
        logits = out.logits[:, -1, :]
        if len(prompts) < len(new):
            index = torch.tensor(rows, device=ids.device)
            cache.batch_select_indices(index)
            logits, mask, positions = logits[index], mask[index], positions[index]
        pending = self._sample(new, logits)
        next_pos = positions[:, -1] + 1
        if not self.seqs:
            self.seqs, self.cache, self.mask, self.positions, self.pending = (
                new,
                cache,
                mask,
                next_pos,
                pending,
            )
            return
        assert self.mask is not None and self.positions is not None and self.pending is not None
        old_w, new_w = self.mask.shape[1], width
        total = max(old_w, new_w)
        layers: list[Any] = list(cache.layers)
        for old_layer, new_layer in zip(self.cache.layers, layers, strict=True):
            for name in ("keys", "values"):
                merged = [_pad_left(getattr(old_layer, name), total - old_w, 2)]
                merged.append(_pad_left(getattr(new_layer, name), total - new_w, 2))
                setattr(old_layer, name, torch.cat(merged))
        self.mask = torch.cat([_pad_left(self.mask, total - old_w, 1), _pad_left(mask, total - new_w, 1)])
        self.positions = torch.cat([self.positions, next_pos])
        self.pending = torch.cat([self.pending, pending])
        self.seqs = self.seqs + new

    def _fill(self, cache: Any, hits: list[tuple[Any, int]], width: int) -> None:
        """Put each row's reused keys and values, right-aligned, into the empty ``cache`` (``width`` wide)."""
        kv = next(e.kv for e, n in hits if n)
        layers, _, heads, _, dim = kv.shape
        full = kv.new_zeros((layers, 2, len(hits), heads, width, dim), device=self.device)
        for row, (entry, n) in enumerate(hits):
            if n:
                full[:, :, row, :, width - n :] = entry.kv[:, :, :, :n].to(self.device)
        for layer in range(layers):
            cache.update(full[layer, 0], full[layer, 1], layer)

    def _keep(self, done: list[int]) -> None:
        """Hand the finished rows' keys and values (prompt and completion but the unfed last token) to the
        prefix cache."""
        assert self.prefix_cache is not None and self.mask is not None
        for i in done:
            seq = self.seqs[i]
            ids = seq.prompt_ids + seq.token_ids[:-1]
            cols = self.mask[i].nonzero().squeeze(1)
            if seq.finish_reason == "abort" or int(cols.numel()) != len(ids):
                continue
            kv = torch.stack(
                [
                    torch.stack([layer.keys[i][:, cols], layer.values[i][:, cols]])
                    for layer in self.cache.layers
                ]
            )
            self.prefix_cache.put(ids, kv)

    def decode(self) -> None:
        """Feed every row its pending token and sample the next one."""
        assert self.mask is not None and self.positions is not None and self.pending is not None
        self.mask = torch.cat([self.mask, self.mask.new_ones((self.mask.shape[0], 1))], dim=1)
        if self.decode_step is not None:
            logits = self.decode_step(self.pending, self.positions, self.mask, self.cache)
        else:
            out = self.model(
                input_ids=self.pending.unsqueeze(1),
                attention_mask=self.mask,
                position_ids=self.positions.unsqueeze(1),
                use_cache=True,
                **{self.cache_arg: self.cache},
            )
            logits = out.logits[:, -1, :]
        self.positions = self.positions + 1
        self.pending = self._sample(self.seqs, logits)

    def prune(self) -> list[Sequence]:
        """Drop finished rows (returned) and the cache columns that are padding for every remaining row."""
        done = [s for s in self.seqs if s.finish_reason is not None]
        if not done:
            return []
        if self.prefix_cache is not None:
            self._keep([i for i, s in enumerate(self.seqs) if s.finish_reason is not None])
        keep = [i for i, s in enumerate(self.seqs) if s.finish_reason is None]
        self.seqs = [self.seqs[i] for i in keep]
        if not keep:
            self.cache = self.mask = self.positions = self.pending = None
            return done
        assert self.mask is not None and self.positions is not None and self.pending is not None
        index = torch.tensor(keep, device=self.mask.device)
        self.mask, self.positions, self.pending = self.mask[index], self.positions[index], self.pending[index]
        lead = int(self.mask.shape[1] - self.mask.sum(dim=1).max().item())
        self.mask = self.mask[:, lead:]
        _map_cache(self.cache, lambda t: t[index, :, lead:])
        return done
