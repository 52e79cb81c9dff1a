"""Where built models are cached: ``$AGL_CACHE_DIR/models`` or ``~/.cache/agl/models``."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """The folder model folders go in: ``cache_dir`` if given, else env ``AGL_CACHE_DIR``/models, else ~/.cache."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("AGL_CACHE_DIR")
    if env:
        return Path(env) / "models"
    return Path.home() / ".cache" / "agl" / "models"


def build_once(target: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmpdir)`` and move the result to ``target`` atomically, unless ``target`` is complete.

    A ``.complete`` marker is written last, so a build killed half-way is redone rather than reused.
    """
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        (tmp / ".complete").write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            # another process finished the same build first: keep theirs
            if not (target / ".complete").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
