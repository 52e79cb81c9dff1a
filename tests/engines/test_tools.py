"""Tool-call parsing: <tool_call> blocks and bare JSON into OpenAI tool_calls."""

from __future__ import annotations

import json

from agl.engines.builtin.tools import parse_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "add"}},
]


def test_tagged_blocks() -> None:
    text = (
        'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content == "Let me check."
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "add"]
    assert json.loads(parsed.tool_calls[1]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in parsed.tool_calls)
    assert parsed.tool_calls[0]["id"] != parsed.tool_calls[1]["id"]


def test_bare_json_fenced_and_lists() -> None:
    one = parse_tool_calls('{"name": "add", "parameters": {"a": 1}}', TOOLS)
    assert one.content is None and json.loads(one.tool_calls[0]["function"]["arguments"]) == {"a": 1}
    fenced = parse_tool_calls(
        '```json\n[{"name": "add", "arguments": {}}, {"name": "get_weather", "arguments": {}}]\n```', TOOLS
    )
    assert len(fenced.tool_calls) == 2


def test_text_that_is_not_a_call_stays_content() -> None:
    for text in [
        "The answer is 4.",
        '{"name": "unknown_tool", "arguments": {}}',
        '{"answer": 4}',
        "<tool_call>{not json",
    ]:
        parsed = parse_tool_calls(text, TOOLS)
        assert parsed.tool_calls == [] and parsed.content == text
