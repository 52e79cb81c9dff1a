"""Which precision the matmuls of training and generation run in: fp32, or bf16.

``"auto"`` is bf16 on a CPU with native bf16 (AVX512-BF16 or AMX), fp32 elsewhere (and on CUDA, not measured
there yet). ``"bf16"`` runs the policy's matmuls under ``torch.autocast`` (fp32 weights, optimizer state and
log-softmax kept) and serves the built-in engine a bf16 copy of the weights. On the calc demo and the SQL
recipe, 3 seeds each, bf16 ended GRPO as high or higher than fp32 at about half to three quarters of the CPU
and less memory (``benchmarks/demo_precision.py``, ``benchmarks/recipe_variants.py``), so it is the default
where it is fast. What it costs: a short warm start's small weight updates fall below a bf16 weight's
rounding step, so the warm-started model *served in bf16* scores lower than in fp32, though its fp32 weights
hold what it learned (``benchmarks/serving_precision.py``); GRPO then trains from the bf16 model, and an SFT
run, whose product is such a short fine-tune, defaults to fp32 (``SFTConfig.precision``). The engine
and the policy resolve a precision the same way, so sampling and training logprobs agree. The environment
variable ``AGL_PRECISION`` (``fp32`` or ``bf16``) sets what ``"auto"`` means for a whole run.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from pathlib import Path
from typing import Literal

import torch

from agl.errors import ConfigError

Precision = Literal["auto", "fp32", "bf16"]
PRECISIONS = ("auto", "fp32", "bf16")
_NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 dot products in hardware (Linux ``/proc/cpuinfo`` flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line for line in text.splitlines() if line.startswith("flags")), "").split()
    return any(flag in flags for flag in _NATIVE_BF16_FLAGS)


def check_precision(precision: str, field: str = "precision") -> None:
    if precision not in PRECISIONS:
        raise ConfigError(f"{field} must be one of {list(PRECISIONS)}, got {precision!r}")


def resolve_precision(precision: str, device: str | torch.device) -> Literal["fp32", "bf16"]:
    """``"auto"`` -> ``AGL_PRECISION`` if set, else ``"bf16"`` on a CPU with native bf16, else ``"fp32"``."""
    check_precision(precision)
    cpu = torch.device(device).type == "cpu"
    if precision == "auto":
        chosen = os.environ.get("AGL_PRECISION", "").strip().lower()
        if chosen not in ("", "fp32", "bf16"):
            raise ConfigError(f"AGL_PRECISION must be 'fp32' or 'bf16', got {chosen!r}")
        if not chosen:  # emulated bf16 (no native instructions) is slower than fp32
            chosen = "bf16" if cpu and cpu_has_native_bf16() else "fp32"
    else:
        chosen = precision
    resolved: Literal["fp32", "bf16"] = "bf16" if chosen == "bf16" else "fp32"
    if resolved == "bf16" and cpu:
        bound_onednn_caches()
        if not cpu_has_native_bf16():
            _warn_emulated_bf16()
    return resolved


# compiled bf16 matmul kernels kept: oneDNN's cache is the process's, ideep's (torch's layer over it) a thread's
ONEDNN_CACHE_ENTRIES = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": 256, "LRU_CACHE_CAPACITY": 32}


@functools.cache
def bound_onednn_caches() -> None:
    """Keep fewer compiled bf16 matmul kernels: oneDNN and ideep (torch's bf16 matmuls on CPU) each cache
    one per matmul shape, up to 1,024, and a policy's micro-batch shapes change every step.

    With the defaults a SmolLM2 policy's memory in use climbed every step (steps on four threads in turn,
    as GRPO runs them); with these it levels off, no slower (``benchmarks/memory_table.py --in-use``). Both
    are read from the environment at oneDNN's first use, so this runs before any bf16 matmul, and a value the
    user set stays.
    """
    for name, entries in ONEDNN_CACHE_ENTRIES.items():
        os.environ.setdefault(name, str(entries))


@functools.cache
def _warn_emulated_bf16() -> None:
    warnings.warn(
        "bf16 was asked for on a CPU without native bf16 (no avx512_bf16 or amx_bf16 in /proc/cpuinfo): "
        "torch emulates it there, and a GRPO update runs far slower than in fp32; use "
        'precision="auto" (fp32 on this CPU) or unset AGL_PRECISION',
        RuntimeWarning,
        stacklevel=3,
    )


def autocast(
    precision: Literal["fp32", "bf16"], device: str | torch.device
) -> contextlib.AbstractContextManager:
    """A context in which matmuls run in bf16 (``precision="bf16"``) or nothing changes (``"fp32"``)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


__all__ = [
    "Precision",
    "autocast",
    "bound_onednn_caches",
    "check_precision",
    "cpu_has_native_bf16",
    "resolve_precision",
]
