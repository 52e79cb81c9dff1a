"""Keys and values of finished sequences, kept so that a later prompt that starts the same way skips them.

An agent's next turn sends the whole conversation again: the previous prompt, the reply, a tool result. Its
longest common prefix with a finished sequence (or a sibling's shared system prompt and tools) is already
computed; only the rest is prefilled. Keys and values at a position depend only on the tokens up to it, so the
reuse is exact for the same weights: the engine clears the cache whenever its weights change.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class CachedPrefix:
    """A finished sequence's token ids and their keys and values, ``(layers, 2, kv_heads, tokens, head_dim)``."""

    ids: torch.Tensor
    kv: torch.Tensor


class PrefixCache:
    """Least-recently-used entries of finished sequences, up to ``max_tokens`` tokens in all.

    ``min_tokens``: a shorter common prefix is not worth the copy and is prefilled as usual.
    """

    def __init__(self, max_tokens: int, min_tokens: int = 16) -> None:
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self._entries: OrderedDict[int, CachedPrefix] = OrderedDict()
        self._tokens = 0
        self._next = 0
        self.hit_tokens = 0  # prompt tokens served from the cache so far

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self._tokens = 0

    def put(self, ids: list[int], kv: torch.Tensor) -> None:
        """Keep ``kv`` (contiguous, owned) for ``ids``; evicts the least recently used entries to fit."""
        n = len(ids)
        if n < self.min_tokens or n > self.max_tokens:
            return
        while self._tokens + n > self.max_tokens and self._entries:
            _, old = self._entries.popitem(last=False)
            self._tokens -= int(old.ids.numel())
        self._entries[self._next] = CachedPrefix(torch.tensor(ids, dtype=torch.long), kv)
        self._next += 1
        self._tokens += n

    def lookup(self, prompt: list[int]) -> tuple[CachedPrefix | None, int]:
        """The entry sharing the longest prefix with ``prompt``, and how many of its tokens to reuse.

        At most ``len(prompt) - 1``: the last prompt token is always computed, for the next token's logits.
        """
        if not self._entries or len(prompt) <= self.min_tokens:
            return None, 0
        query = torch.tensor(prompt, dtype=torch.long)
        best_key, best = None, 0
        for key, entry in self._entries.items():
            n = min(int(entry.ids.numel()), len(prompt) - 1)
            if n <= best:
                continue
            same = entry.ids[:n] == query[:n]
            common = n if bool(same.all()) else int(same.logical_not().nonzero()[0, 0])
            if common > best:
                best_key, best = key, common
        if best_key is None or best < self.min_tokens:
            return None, 0
        self._entries.move_to_end(best_key)
        self.hit_tokens += best
        return self._entries[best_key], best
