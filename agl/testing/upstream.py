"""An in-memory OpenAI-compatible upstream for the gateway's transport seam: test a gateway without a model.

    up = InMemoryUpstream()
    gateway = Gateway(store, ["http://model/v1"], transport=up.transport)

Chat completions answer with the scripted replies (``up.script("hi")``) in order, then ``echo: <last user
text>``. Like vLLM, ``return_token_ids`` adds ``prompt_token_ids`` and per-choice ``token_ids``, and
``logprobs`` adds ``logprobs.content``, so the gateway records what training reads; ids are
:func:`token_ids` of the text, so tests can recompute them. ``stream`` is answered as SSE. Request bodies
land in ``up.requests``.
"""

from __future__ import annotations

import json
import zlib
from collections import deque
from typing import Any

import httpx


def token_ids(text: str) -> list[int]:
    """The upstream's deterministic tokenization: one id per whitespace-separated word."""
    return [zlib.crc32(word.encode()) % 50_000 + 100 for word in text.split()]


def _text(content: Any) -> str:
    if isinstance(content, list):  # content parts
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


class InMemoryUpstream:
    """``/v1/chat/completions``, ``/v1/models`` and ``/health`` served from memory through ``.transport``."""

    def __init__(self, model: str = "in-memory") -> None:
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self._replies: deque[str] = deque()
        self.transport = httpx.MockTransport(self._handle)

    def script(self, *replies: str) -> None:
        """Answer the next chat calls with these texts, in order, before echoing again."""
        self._replies.extend(replies)

    def _handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path.endswith(("/health", "/models")):
            return httpx.Response(
                200, json={"object": "list", "data": [{"id": self.model, "object": "model"}]}
            )
        if request.method != "POST" or not path.endswith("/chat/completions"):
            return httpx.Response(404, json={"error": {"message": f"{request.method} {path} is not served"}})
        body = json.loads(request.content)
        self.requests.append(body)
        messages = body.get("messages") or []
        user = next((_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        text = self._replies.popleft() if self._replies else f"echo: {user}"
        prompt_ids = token_ids(" ".join(f"<{m.get('role')}> {_text(m.get('content'))}" for m in messages))
        ids = token_ids(text)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if body.get("return_token_ids"):
            choice["token_ids"] = ids
        if body.get("logprobs"):
            lps: list[dict[str, Any]] = [
                {"token": w, "logprob": -0.1, "bytes": None, "top_logprobs": []} for w in text.split()
            ]
            choice["logprobs"] = {"content": lps}
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        head: dict[str, Any] = {
            "id": f"chatcmpl-{len(self.requests)}",
            "created": 0,
            "model": body.get("model"),
        }
        if body.get("return_token_ids"):
            head["prompt_token_ids"] = prompt_ids
        message = {"role": "assistant", "content": text}
        if not body.get("stream"):
            reply = {**head, "object": "chat.completion", "choices": [{**choice, "message": message}]}
            return httpx.Response(200, json={**reply, "usage": usage})
        chunk = {**head, "object": "chat.completion.chunk", "choices": [{**choice, "delta": message}]}
        events = [chunk]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})
