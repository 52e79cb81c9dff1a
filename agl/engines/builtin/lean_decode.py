"""A lean decode step for Llama-family models: one new token per row through the model's own modules.

At a few rows on a CPU, the generic forward of a Hugging Face model spends about as long on its per-call
machinery (building the 4-D mask, output capture, keyword checks and wrappers at every layer) as on the matrix
products themselves. This step calls the same modules, weights and rotary embedding in the same order and
skips the rest. It is used only for the model types below and only after it has matched the model's own forward
on a padded two-row batch at load; anything else keeps the generic forward.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# architectures whose decoder layer is: norm, attention (q/k/v/o, rotary), residual, norm, gated MLP, residual
SUPPORTED_TYPES = frozenset({"llama", "qwen2"})

DecodeStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _plain_layers(model: Any) -> bool:
    """Whether every decoder layer has exactly the parts this step calls (no extra norms, no LoRA wrappers)."""
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, n) for n in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return False
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        parts += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, torch.nn.Linear) for p in parts):
            return False
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")) or getattr(attn, "sliding_window", None):
            return False
    return True


def make_decode_step(model: Any) -> DecodeStep:
    """The lean step for ``model``: ``step(tokens [B], positions [B], mask [B, T], cache) -> logits [B, V]``.

    ``mask`` covers the cache's T-1 columns plus the new token; ``cache`` is the model's DynamicCache, which
    the step extends by one column per layer, as the generic forward does.
    """
    config = model.config
    inner = model.model
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    groups = heads // kv_heads
    act = inner.layers[0].mlp.act_fn

    def step(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        rows = tokens.shape[0]
        x = inner.embed_tokens.forward(tokens.unsqueeze(1))  # [B, 1, H]
        cos, sin = inner.rotary_emb.forward(x, positions.unsqueeze(1))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, 1, D]: one position per row
        keep = mask.bool()[:, None, None, :]  # shared by every head
        for layer, kv in zip(inner.layers, cache.layers, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            h = layer.input_layernorm.forward(x)
            q = attn.q_proj.forward(h).view(rows, 1, heads, -1).transpose(1, 2)
            k = attn.k_proj.forward(h).view(rows, 1, kv_heads, -1).transpose(1, 2)
            v = attn.v_proj.forward(h).view(rows, 1, kv_heads, -1).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            keys, values = kv.update(k, v)
            # a single query per row: the heads sharing a key/value head become that head's query rows
            q = q.reshape(rows, kv_heads, groups, q.shape[-1])
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=keep, scale=attn.scaling)
            x = x + attn.o_proj.forward(out.reshape(rows, 1, -1))
            h = layer.post_attention_layernorm.forward(x)
            x = x + mlp.down_proj.forward(act(mlp.gate_proj.forward(h)) * mlp.up_proj.forward(h))
        x = inner.norm.forward(x)
        return model.lm_head.forward(x[:, -1, :])  # type: ignore[no-any-return]

    return step


def _agrees(model: Any, step: DecodeStep) -> tuple[bool, float]:
    """Decode one token of a padded two-row batch both ways; whether the logits agree (and the worst gap)."""
    from transformers import DynamicCache

    # transformers >= 5.2x names the argument ``cache``; older releases ``past_key_values``
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    device = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    ids = torch.randint(0, min(vocab, 1000), (2, 6), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # the second row is left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = []
    with torch.inference_mode():
        for lean in (False, True):
            cache = DynamicCache(config=model.config)
            model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                **{cache_arg: cache},
            )
            token, pos = ids[:, -1], positions[:, -1] + 1
            full = torch.cat([mask, mask.new_ones((2, 1))], dim=1)
            if lean:
                logits.append(step(token, pos, full, cache).float())
            else:
                out = model(
                    input_ids=token.unsqueeze(1),
                    attention_mask=full,
                    position_ids=pos.unsqueeze(1),
                    use_cache=True,
                    **{cache_arg: cache},
                )
                logits.append(out.logits[:, -1, :].float())
    gap = float((logits[0] - logits[1]).abs().max())
    scale = float(logits[0].abs().max()) or 1.0
    # the same operations in the same order: only a different attention kernel's rounding may differ
    tolerance = 1e-4 if next(model.parameters()).dtype == torch.float32 else 2e-2
    return gap <= tolerance * scale, gap


def lean_decode_step(model: Any) -> DecodeStep | None:
    """The lean step for ``model`` when its type is supported and it matches the generic forward, else None."""
    if getattr(model.config, "model_type", None) not in SUPPORTED_TYPES or not _plain_layers(model):
        return None
    step = make_decode_step(model)
    try:
        ok, gap = _agrees(model, step)
    except Exception:  # an unexpected variant of a supported type: keep the generic forward
        logger.warning("lean decode step failed its check; using the model's own forward", exc_info=True)
        return None
    if not ok:
        logger.warning(
            "lean decode step differs from the model's forward (max logit gap %.3g); not used", gap
        )
        return None
    return step


__all__ = ["SUPPORTED_TYPES", "lean_decode_step", "make_decode_step"]
