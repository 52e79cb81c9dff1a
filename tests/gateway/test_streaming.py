"""Reassembling SSE streams: chunk boundaries anywhere, tool-call deltas merged, token ids concatenated."""

from __future__ import annotations

import orjson

from agl.gateway.streaming import assemble


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_chat_stream_with_split_boundaries_and_tool_calls() -> None:
    raw = sse(
        {"id": "c1", "model": "m", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "delta": {"role": "assistant"}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "Hel"}, "token_ids": [7],
                                  "logprobs": {"content": [{"token": "Hel", "logprob": -0.5}]}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"content": "lo"}, "token_ids": [8],
                                  "logprobs": {"content": [{"token": "lo", "logprob": -0.25}]}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "call_a", "function": {"name": "calc", "arguments": '{"x":'}}]}}]},
        {"id": "c1", "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}}]},
        {"id": "c1", "model_version": "v9", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"id": "c1", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}},
    )  # fmt: skip
    pieces = [raw[i : i + 7] for i in range(0, len(raw), 7)]  # boundaries fall inside lines
    body = assemble(pieces, "chat.completions")
    (choice,) = body["choices"]
    assert choice["message"] == {
        "role": "assistant",
        "content": "Hello",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "calc", "arguments": '{"x":1}'}}
        ],
    }
    assert choice["token_ids"] == [7, 8] and body["prompt_token_ids"] == [1, 2]
    assert [x["logprob"] for x in choice["logprobs"]["content"]] == [-0.5, -0.25]
    assert choice["finish_reason"] == "tool_calls" and body["usage"]["total_tokens"] == 4
    assert body["model_version"] == "v9" and body["id"] == "c1"


def test_completion_stream_and_garbage_lines() -> None:
    raw = sse(
        {"id": "t", "choices": [{"index": 0, "text": "a", "token_ids": [1], "prompt_token_ids": [5, 6],
                                 "logprobs": {"token_logprobs": [-1.0]}}]},
        {"id": "t", "choices": [{"index": 0, "text": "b", "token_ids": [2], "logprobs": {"token_logprobs": [-2.0]},
                                 "finish_reason": "length"}]},
    ) + b": keep-alive comment\n\ndata: {broken\n\n"  # fmt: skip
    (choice,) = assemble([raw], "completions")["choices"]
    assert choice["text"] == "ab" and choice["token_ids"] == [1, 2] and choice["prompt_token_ids"] == [5, 6]
    assert choice["logprobs"] == {"token_logprobs": [-1.0, -2.0]} and choice["finish_reason"] == "length"


def test_responses_stream_uses_the_completed_event() -> None:
    final = {"id": "resp_1", "status": "completed", "output": []}
    raw = sse({"type": "response.created"}, {"type": "response.completed", "response": final})
    assert assemble([raw], "responses") == final
