"""``POST /v1/embeddings`` on the built-in engine: the served model's own text embeddings.

An input's embedding is the model's last hidden layer (after the final norm), mean-pooled over its tokens
and L2-normalised: no second model to load or keep in step with training, and the vectors follow the
policy's weights. The size is the model's hidden size; ``dimensions`` cannot shorten it (a causal LM is not
trained for truncated embeddings), so any other value is refused.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from agl.errors import InvalidRequestError

MAX_INPUTS = 2048  # OpenAI's limit per request
_BATCH_TOKENS = 8192  # padded tokens per forward pass: bounds activation memory on long or many inputs


class EmbeddingsRequest(BaseModel):
    """``POST /v1/embeddings``; ``input`` is checked in :func:`token_inputs` so errors name the item."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: Any = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None


def token_inputs(given: Any, tokenize: Any, vocab_size: int, max_len: int) -> list[list[int]]:
    """The token ids of each input (strings are tokenized without special tokens); bad items raise."""
    if isinstance(given, str) or (isinstance(given, list) and given and all(_is_int(t) for t in given)):
        items: list[Any] = [given]
        names = ["input"]
    elif isinstance(given, list) and given:
        items, names = given, [f"input[{i}]" for i in range(len(given))]
    else:
        raise InvalidRequestError(
            f"input must be a string, a non-empty list of strings, or token ids, got {given!r:.80}",
            param="input",
        )
    if len(items) > MAX_INPUTS:
        raise InvalidRequestError(
            f"input has {len(items)} items; at most {MAX_INPUTS} per request", param="input"
        )
    out = []
    for item, where in zip(items, names, strict=True):
        if isinstance(item, str):
            ids = list(tokenize(item)) if item else []
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            ids = list(item)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{where}: token ids must be in [0, {vocab_size}), got {bad[:5]}", param=where
                )
        else:
            raise InvalidRequestError(
                f"{where} must be a string or a list of token ids, got {item!r:.80}", param=where
            )
        if not ids:
            raise InvalidRequestError(f"{where} is empty; send at least one token of text", param=where)
        if len(ids) > max_len:
            raise InvalidRequestError(
                f"{where} has {len(ids)} tokens, the model's context is {max_len}; shorten it", param=where
            )
        out.append(ids)
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pooled(model: Any, inputs: list[list[int]], pad_id: int) -> list[torch.Tensor]:
    """Mean-pooled, L2-normalised last hidden states of each input, in input order (float32).

    Inputs are sorted by length and right-padded in batches of at most ``_BATCH_TOKENS`` padded tokens;
    padding is masked out of attention and of the mean, so a vector does not depend on its batch-mates.
    """
    device = next(model.parameters()).device
    body = model.base_model  # the decoder without the LM head: no (tokens x vocabulary) logits
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
    out: list[torch.Tensor | None] = [None] * len(inputs)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * len(inputs[order[end]]) <= _BATCH_TOKENS:
            end += 1
        chunk = order[start:end]
        width = len(inputs[chunk[-1]])
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, i in enumerate(chunk):
            ids[row, : len(inputs[i])] = torch.tensor(inputs[i])
            mask[row, : len(inputs[i])] = 1
        hidden = body(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state  # (B, T, H)
        weights = mask.to(device=device, dtype=torch.float32).unsqueeze(-1)  # (B, T, 1)
        mean = (hidden.float() * weights).sum(dim=1) / weights.sum(dim=1)  # (B, H)
        vectors = torch.nn.functional.normalize(mean, dim=-1).cpu()
        for row, i in enumerate(chunk):
            out[i] = vectors[row]
        start = end
    return [v for v in out if v is not None]


def embeddings_body(
    vectors: list[torch.Tensor], encoding_format: str, model: str, tokens: int, model_version: str
) -> dict[str, Any]:
    """The OpenAI embeddings response; ``base64`` is little-endian float32, as the openai SDK decodes it."""
    data = []
    for index, vector in enumerate(vectors):
        value: Any = (
            base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
            if encoding_format == "base64"
            else vector.tolist()
        )
        data.append({"object": "embedding", "index": index, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "model_version": model_version,
    }
