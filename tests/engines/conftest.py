"""Shared fixtures: the tiny model, a served engine, and a tiny model taught one tool-call reply."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# plain chat dicts, as Engine.encode_chat and HF chat templates take them (SDK tests cast them)
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL_REPLY = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from agl.models import tiny_model

    return tiny_model(seed=0, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def tool_model_path(tiny_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model overfitted (a few seconds of Adam) to answer TOOL_MESSAGES with TOOL_REPLY."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Any, as Engine.tokenizer is: HF's stubs type chat messages as str-only dicts
    tok: Any = AutoTokenizer.from_pretrained(tiny_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    prompt = tok.apply_chat_template(TOOL_MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    c_ids = tok(TOOL_REPLY, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = torch.tensor([p_ids + c_ids])
    labels = ids.clone()
    labels[0, : len(p_ids)] = -100
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(300):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    out = tmp_path_factory.mktemp("tool-model")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
