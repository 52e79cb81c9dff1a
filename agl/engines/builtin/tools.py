"""Parse tool calls out of generated text into OpenAI ``tool_calls``.

Two shapes are recognised: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks (Hermes/Qwen
style, any number) and a reply that is only a JSON object or list of objects with ``name`` and ``arguments``
(or ``parameters``) naming one of the offered tools, which small models often emit without the tags.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass
class ParsedTools:
    """The text left once tool-call markup is removed (None if nothing is left) and the calls found."""

    content: str | None
    tool_calls: list[dict[str, Any]]


def _as_call(obj: Any, names: set[str] | None) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": arguments},
    }


def tool_names(tools: list[dict[str, Any]] | None) -> set[str]:
    """Names of the functions offered in an OpenAI ``tools`` list."""
    names: set[str] = set()
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None = None) -> ParsedTools:
    """Extract tool calls from ``text``; text without any stays content, with no calls."""
    calls: list[dict[str, Any]] = []
    if "<tool_call>" in text:
        for match in _BLOCK.finditer(text):
            try:
                call = _as_call(json.loads(match.group(1)), None)
            except json.JSONDecodeError:
                call = None
            if call is not None:
                calls.append(call)
        if calls:
            rest = _BLOCK.sub("", text).strip()
            return ParsedTools(rest or None, calls)
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    body = fenced.group(1) if fenced else stripped
    if body[:1] in "{[" and body:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return ParsedTools(text, [])
        names = tool_names(tools) if tools else None
        items = obj if isinstance(obj, list) else [obj]
        parsed = [_as_call(item, names) for item in items]
        if parsed and all(p is not None for p in parsed):
            return ParsedTools(None, [p for p in parsed if p is not None])
    return ParsedTools(text, [])
