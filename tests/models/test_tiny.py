"""The tiny model: deterministic by seed, cached, loadable by transformers, ChatML template with tools."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from agl.models import cache_root, tiny_model


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic_and_reused(tmp_path: Path) -> None:
    a = tiny_model(seed=3, cache_dir=tmp_path / "a")
    b = tiny_model(seed=3, cache_dir=tmp_path / "b")
    c = tiny_model(seed=4, cache_dir=tmp_path / "a")
    assert a.name == "tiny-s3"
    for name in ("tokenizer.json", "model.safetensors"):
        assert _digest(a / name) == _digest(b / name)
    assert _digest(a / "model.safetensors") != _digest(c / "model.safetensors")
    stamp = (a / "model.safetensors").stat().st_mtime_ns
    assert tiny_model(seed=3, cache_dir=tmp_path / "a") == a
    assert (a / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGL_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path / "models"


def test_loads_with_auto_classes_and_renders_tools(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model(cache_dir=tmp_path)
    # Any, as Engine.tokenizer is: HF's stubs type chat messages as str-only dicts
    tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    assert model.config.head_dim == 32 and model.config.num_hidden_layers == 2
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.generation_config.eos_token_id == tok.eos_token_id
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+3?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": {"x": 1}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "calculator"' in text
    assert '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n5<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    plain = tok.apply_chat_template(messages[1:2], tokenize=False, add_generation_prompt=False)
    assert plain == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n"
    ids = tok("12 + 7 = 19", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == "12 + 7 = 19"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok))


def test_thinking_variant_has_think_tokens_and_qwen3s_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from agl.models.qwen3 import QWEN3_CHAT_TEMPLATE

    path = tiny_model(cache_dir=tmp_path, thinking=True)
    assert path.name == "tiny-s0-think"
    tok: Any = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template == QWEN3_CHAT_TEMPLATE
    open_id, close_id = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert tok("<think>x</think>", add_special_tokens=False)["input_ids"][0] == open_id
    assert tok.decode([open_id, close_id], skip_special_tokens=True) == "<think></think>"  # kept in text
    question = [{"role": "user", "content": "hi"}]
    on = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(question, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert off == on + "<think>\n\n</think>\n\n"
    # Qwen3 drops an earlier turn's thinking, and keeps it on a turn after the last user query
    turn = {"role": "assistant", "content": "yes", "reasoning_content": "why"}
    earlier = tok.apply_chat_template([*question, turn, {"role": "user", "content": "ok"}], tokenize=False)
    latest = tok.apply_chat_template([*question, turn], tokenize=False)
    assert "<think>" not in earlier and "<|im_start|>assistant\nyes<|im_end|>" in earlier
    assert latest.endswith("<|im_start|>assistant\n<think>\nwhy\n</think>\n\nyes<|im_end|>\n")
