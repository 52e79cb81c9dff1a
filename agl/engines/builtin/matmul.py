"""Few-row products for decoding: ``W @ x.T`` wherever the CPU's BLAS runs it faster than ``x @ W.T``.

A decode step multiplies one row per running sequence by every weight matrix, so its speed is how fast the
BLAS streams the weights. On some CPUs the usual ``F.linear`` does that badly for a handful of rows (MKL on
an AMD EPYC, for one: ``W @ x.T`` runs SmolLM2's output head at 8 rows, and so a whole decode step, much
faster), on others not, so the engine times both on the model's largest linear layer at load and
keeps the faster. Prefill, and batches of more than :data:`MAX_ROWS` rows, keep ``F.linear``.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

MAX_ROWS = 32  # past this the transposed product stops winning (measured at 1-128 rows)
_PROBE_ROWS = 8
_PROBE_REPEATS = 5
_MIN_GAIN = 1.25  # switch only on a clear win: the probe is a few milliseconds, on a possibly busy CPU


def _weight_major_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if rows == 0 or rows > MAX_ROWS or torch.is_grad_enabled():
        return F.linear(x, self.weight, self.bias)
    out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).t()).t()
    if self.bias is not None:
        out = out + self.bias
    return out.contiguous().view(*x.shape[:-1], self.out_features)


def _best_ms(fn: Callable[[], Any]) -> float:
    fn()  # warm the caches and any lazy kernel choice
    best = float("inf")
    for _ in range(_PROBE_REPEATS):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def weight_major_gain(layer: torch.nn.Linear, rows: int = _PROBE_ROWS) -> float:
    """How many times faster ``W @ x.T`` is than ``F.linear`` on ``layer`` for ``rows`` rows (> 1: faster)."""
    weight = layer.weight
    x = torch.randn(rows, layer.in_features, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        plain = _best_ms(lambda: F.linear(x, weight))
        transposed = _best_ms(lambda: torch.mm(weight, x.t()).t().contiguous())
    return plain / transposed


def use_weight_major_decode(model: torch.nn.Module) -> bool:
    """Route the few-row products of every plain ``nn.Linear`` of ``model`` through ``W @ x.T`` when that
    is clearly faster on this CPU; returns whether it switched. No effect with gradients on, or on CUDA."""
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not linears or linears[0].weight.device.type != "cpu":
        return False
    largest = max(linears, key=lambda m: m.weight.numel())
    if weight_major_gain(largest) < _MIN_GAIN:
        return False
    for layer in linears:
        # on the instance, so LoRA merges (which put these same modules back) keep it
        layer.forward = types.MethodType(_weight_major_forward, layer)  # type: ignore[method-assign]
    return True


__all__ = ["MAX_ROWS", "use_weight_major_decode", "weight_major_gain"]
