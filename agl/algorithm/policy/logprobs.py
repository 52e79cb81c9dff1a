"""Per-token log-probs of a causal LM without holding a (tokens x vocabulary) logits tensor.

A HF model returns logits for every position: with SmolLM2's 49k vocabulary a 4,096-token micro-batch
is 0.8 GB of fp32 logits, and log-softmax, its gradient and the entropy each add a copy of that size.
Here the model runs with its output head bypassed and the head is applied to a chunk of positions at a
time, under activation checkpointing, so one chunk's logits exist at a time in the forward pass and in
the backward pass. Models that transform logits after the head (soft-capping, scaling) take the plain
path, as does a head that is not a plain ``nn.Linear`` (e.g. LoRA on the head).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from agl.algorithm.policy.prefix import PrefixRows, shared_hidden

# config attributes of HF models whose logits are changed after the output head
_AFTER_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
CHUNK_TOKENS = 1024


def token_logprobs(
    model: Any,
    input_ids: torch.Tensor,
    attention: torch.Tensor,
    chunk_tokens: int | None = CHUNK_TOKENS,
    *,
    recompute_head: bool = True,
    only: torch.Tensor | None = None,
    prefixes: PrefixRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T-1) log-probs of each next token, and the (B, T-1) entropy of the predicted distribution.

    ``chunk_tokens=None`` computes them from the model's full logits (the reference path);
    ``recompute_head=False`` keeps each chunk's logits for the backward pass instead of recomputing them
    (faster, for micro-batches small enough to hold them). ``only``: a (B, T-1) mask of the positions
    wanted (the loss's); the head runs on those alone, and the others come back as 0. ``prefixes``: run
    each shared prefix once (:mod:`agl.algorithm.policy.prefix`); positions inside one come back as 0.
    """
    head = model.get_output_embeddings()
    if chunk_tokens is None or not _head_is_last(model, head):
        full_taken, full_entropy = _from_full_logits(model, input_ids, attention)
        if only is None:
            return full_taken, full_entropy
        return full_taken * only, full_entropy * only
    columns = None
    with _bypassed(head):
        if prefixes is None:
            hidden = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1]  # (B, T-1, H)
            targets = input_ids[:, 1:]
        else:  # row b's outputs start at its prefix's end: columns[b, j] is where output j belongs
            hidden, columns = shared_hidden(model, input_ids, attention, prefixes)
            hidden, columns = hidden[:, :-1], columns[:, :-1]  # (B, S-1, H)
            limit = input_ids.shape[1] - 1
            targets = input_ids.gather(1, (columns + 1).clamp(max=limit))
            wanted = only if only is not None else attention[:, 1:] > 0
            only = wanted.gather(1, columns.clamp(max=limit - 1)) & (columns < limit)
    batch, width, size = hidden.shape
    flat, targets = hidden.reshape(-1, size), targets.reshape(-1)
    index = None
    if only is not None and bool(only.any()):
        # prompt and tool tokens carry no loss: the (positions x vocabulary) head is most of the step's
        # compute left for them, so it skips them
        index = only.reshape(-1).nonzero().squeeze(-1)
        flat, targets = flat.index_select(0, index), targets.index_select(0, index)
    needs_grad = torch.is_grad_enabled() and (flat.requires_grad or head.weight.requires_grad)
    recompute = recompute_head and needs_grad
    taken, entropy = [], []
    for start in range(0, flat.shape[0], chunk_tokens):
        part = (
            flat[start : start + chunk_tokens],
            targets[start : start + chunk_tokens],
            head.weight,
            head.bias,
        )
        if recompute:  # keep no logits for backward: recompute this chunk's when the gradient needs them
            chunk_taken, chunk_entropy = checkpoint(_chunk, *part, use_reentrant=False)
        else:
            chunk_taken, chunk_entropy = _chunk(*part)
        taken.append(chunk_taken)
        entropy.append(chunk_entropy)
    all_taken, all_entropy = torch.cat(taken), torch.cat(entropy)
    if index is not None:
        all_taken = all_taken.new_zeros(batch * width).index_copy(0, index, all_taken)
        all_entropy = all_entropy.new_zeros(batch * width).index_copy(0, index, all_entropy)
    taken_rows, entropy_rows = all_taken.view(batch, width), all_entropy.view(batch, width)
    if columns is None:
        return taken_rows, entropy_rows
    # back to whole-row positions; each row's columns are distinct, and those past the row fall off the end
    full = input_ids.shape[1] - 1
    place = taken_rows.new_zeros(batch, full + width)
    return (
        place.scatter(1, columns, taken_rows)[:, :full],
        place.scatter(1, columns, entropy_rows)[:, :full],
    )


def _chunk(
    hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden.to(weight.dtype), weight, bias).float()  # (n, V)
    normalizer = torch.logsumexp(logits, dim=-1)
    taken = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normalizer
    with torch.no_grad():
        entropy = normalizer - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return taken, entropy


def _from_full_logits(
    model: Any, input_ids: torch.Tensor, attention: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, :-1].float()  # (B, T-1, V)
    logp = torch.log_softmax(logits, dim=-1)
    taken = logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return taken, entropy


def _head_is_last(model: Any, head: Any) -> bool:
    """Whether the model's logits are exactly ``head(hidden)``: a plain linear head, nothing after it."""
    if type(head) is not torch.nn.Linear:
        return False
    config = getattr(model, "config", None)
    return not any(getattr(config, name, None) not in (None, 1, 1.0) for name in _AFTER_HEAD)


@contextlib.contextmanager
def _bypassed(head: torch.nn.Module) -> Iterator[None]:
    """Make ``head`` the identity for one forward pass, so the model returns its final hidden states."""
    own = head.__dict__.get("forward")  # hooks (accelerate) may have set one on the instance
    head.forward = lambda hidden: hidden  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own  # type: ignore[method-assign]
