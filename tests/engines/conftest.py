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
    from tests.support.overfit import overfit_replies

    return overfit_replies(
        tiny_path, tmp_path_factory.mktemp("tool-model"), [(TOOL_MESSAGES, TOOL_REPLY)], TOOLS
    )
