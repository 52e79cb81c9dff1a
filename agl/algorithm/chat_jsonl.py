"""OpenAI chat JSONL (``{"messages": [...], "tools": [...]}`` a line): the SFT and warm-start file format.

Light on purpose (no torch): the dashboard writes these files from a request, SFT and ``WarmStart`` read them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agl import semconv as sc
from agl.adapter import llm_calls, to_messages
from agl.errors import ConfigError
from agl.schemas import Span


def chat_line(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
    """One conversation as a JSONL line (no newline): its messages, and its tools where it declared some."""
    row: dict[str, Any] = {"messages": messages}
    if tools:
        row["tools"] = tools
    return json.dumps(row)


def export_jsonl(
    conversations: Sequence[list[dict[str, Any]]],
    path: str | Path,
    *,
    tools: Sequence[list[dict[str, Any]] | None] | None = None,
) -> int:
    """Write OpenAI fine-tuning JSONL (``{"messages": [...], "tools": [...]}`` per line, tool calls kept;
    ``tools[i]`` is conversation i's declared tools, left out where None); returns lines written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    declared = list(tools) if tools is not None else [None] * len(conversations)
    if len(declared) != len(conversations):
        raise ValueError(
            f"export_jsonl got {len(conversations)} conversations but {len(declared)} tool lists"
        )
    with path.open("w") as f:
        for messages, its_tools in zip(conversations, declared, strict=True):
            f.write(chat_line(messages, its_tools) + "\n")
    return len(conversations)


def import_jsonl(path: str | Path) -> tuple[list[list[dict[str, Any]]], list[dict[str, Any]] | None]:
    """Conversations and tools from OpenAI chat JSONL as :func:`export_jsonl` writes it (``{"messages": [...], "tools": [...]}`` lines).

    Raises:
        ConfigError: a line is no such object, or lines declare different tools.
    """
    conversations: list[list[dict[str, Any]]] = []
    tools: list[dict[str, Any]] | None = None
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n} is not JSON: {e}") from None
        if not isinstance(row, dict) or not isinstance(row.get("messages"), list):
            raise ConfigError(f'{path}:{n} must be an object with "messages": [...] (OpenAI chat format)')
        conversations.append(row["messages"])
        line_tools = row.get("tools") or None
        if line_tools is not None:
            if tools is not None and line_tools != tools:
                raise ConfigError(
                    f"{path}:{n} declares other tools than the lines before: a WarmStart renders one tool set"
                )
            tools = line_tools
    return conversations, tools


def request_tools(spans: Sequence[Span]) -> list[dict[str, Any]] | None:
    """The tools the agent declared in its last model call (the recorded request's ``tools``)."""
    calls = llm_calls(list(spans))
    for call in reversed(calls):
        request = call.attributes.get(sc.LLM_REQUEST)
        if isinstance(request, dict) and request.get("tools"):
            return list(request["tools"])
    return None


def conversation(spans: Sequence[Span]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A rollout's conversation (its last call's messages and reply, tool calls kept) and its declared
    tools: what SFT exports and a teacher's traces hold."""
    return to_messages(llm_calls(list(spans))), request_tools(spans)
