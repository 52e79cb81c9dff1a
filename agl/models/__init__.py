"""Local causal LMs for tests, demos and training: built or converted offline, cached as plain HF folders."""

from __future__ import annotations

from agl.models.cache import cache_root
from agl.models.qwen_coder import QWEN_CODER_GGUF_SHA256, qwen_coder
from agl.models.smollm2 import SMOLLM2_GGUF_SHA256, smollm2
from agl.models.tiny import tiny_model

__all__ = [
    "QWEN_CODER_GGUF_SHA256",
    "SMOLLM2_GGUF_SHA256",
    "cache_root",
    "qwen_coder",
    "smollm2",
    "tiny_model",
]
