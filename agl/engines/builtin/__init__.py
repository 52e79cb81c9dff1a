"""The built-in engine: continuous batching over a local HF causal LM, served over the OpenAI protocol."""

from __future__ import annotations

from agl.engines.builtin.engine import Choice, Engine, Generation, StreamDelta
from agl.engines.builtin.sampling import SamplingParams
from agl.engines.builtin.tools import ParsedTools, parse_tool_calls

__all__ = [
    "Choice",
    "Engine",
    "Generation",
    "ParsedTools",
    "SamplingParams",
    "StreamDelta",
    "parse_tool_calls",
]
