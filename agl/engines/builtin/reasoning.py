"""Reasoning models' thinking, split off a chat completion's text into ``message.reasoning_content``.

Only for models that think: the chat template mentions ``<think>`` and the tokenizer has ``<think>`` and
``</think>`` as single tokens that decoded text keeps (as Qwen3's). Only the returned message changes;
``token_ids`` stay the whole generated sequence. The split matches how Qwen3's template renders a turn
back (``<think>\\n{reasoning}\\n</think>\\n\\n{content}``): newlines around the thinking and before the
answer are dropped. A completion that never closes its ``</think>`` (cut by ``max_tokens``) is all
reasoning with empty content. A completion starts inside a block when its prompt leaves one open.
"""

from __future__ import annotations

from typing import Any

from agl.adapter.thinking import THINK_CLOSE, THINK_OPEN, think_token_ids


def reasoning_tags(tokenizer: Any) -> tuple[int, int] | None:
    """The think tags' ids when this model thinks (see the module docstring), else None."""
    if THINK_OPEN not in str(getattr(tokenizer, "chat_template", None) or ""):
        return None
    ids = think_token_ids(tokenizer)
    if ids is None or tokenizer.decode(list(ids), skip_special_tokens=True) != THINK_OPEN + THINK_CLOSE:
        return None
    return ids


def opens_thinking(prompt_ids: list[int], tags: tuple[int, int]) -> bool:
    """Whether the prompt ends inside a ``<think>`` block (a template that opens it for the model)."""
    open_id, close_id = tags
    last_open = max((i for i, t in enumerate(prompt_ids) if t == open_id), default=-1)
    last_close = max((i for i, t in enumerate(prompt_ids) if t == close_id), default=-1)
    return last_open > last_close


def _held(text: str) -> str:
    """Reasoning text safe to send while more may come: not a partial ``</think>``, no trailing newlines."""
    for n in range(min(len(THINK_CLOSE) - 1, len(text)), 0, -1):
        if THINK_CLOSE.startswith(text[-n:]):
            text = text[:-n]
            break
    return text.rstrip("\n")


def split_reasoning(text: str, inside: bool = False, final: bool = True) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a completion's text (``reasoning`` None when it does not think).

    ``inside``: the prompt left a block open. ``final=False`` splits a text still growing: what it returns
    only ever grows as the text does, so a stream can send the difference.
    """
    if not inside:
        stripped = text.lstrip()
        if stripped.startswith(THINK_OPEN):
            text = stripped[len(THINK_OPEN) :]
        elif not final and THINK_OPEN.startswith(stripped):
            return None, ""  # "" or "<thi": not known yet whether a block opens
        else:
            return None, text
    end = text.find(THINK_CLOSE)
    if end < 0:
        reasoning = text.lstrip("\n")
        return (reasoning.rstrip("\n") if final else _held(reasoning)), ""
    return text[:end].strip("\n"), text[end + len(THINK_CLOSE) :].lstrip("\n")


def split_reply(
    tags: tuple[int, int] | None, prompt_ids: list[int], content: str | None
) -> tuple[str | None, str | None]:
    """``(reasoning, content)`` of a finished reply to ``prompt_ids``: the thinking split off when the
    model thinks (``tags``, from :func:`reasoning_tags`), else ``(None, content)``."""
    if tags is None or content is None:
        return None, content
    return split_reasoning(content, opens_thinking(prompt_ids, tags))


def reasoning_token_count(tags: tuple[int, int] | None, token_ids: list[int], reasoning: str | None) -> int:
    """How many of a completion's tokens are thinking: through its ``</think>``, or all of them when
    the block never closed (cut by ``max_tokens``)."""
    if tags is None or reasoning is None:
        return 0
    close_id = tags[1]
    return token_ids.index(close_id) + 1 if close_id in token_ids else len(token_ids)


class ReasoningStream:
    """Splits a streamed completion's text deltas into reasoning and content deltas."""

    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """The new ``(reasoning, content)`` text after ``delta``; ``final`` on the last one flushes."""
        self.text += delta
        reasoning, content = split_reasoning(self.text, self.inside, final)
        new_r = (reasoning or "")[self.sent_reasoning :]
        new_c = content[self.sent_content :]
        self.sent_reasoning += len(new_r)
        self.sent_content += len(new_c)
        return new_r, new_c


__all__ = [
    "ReasoningStream",
    "opens_thinking",
    "reasoning_tags",
    "reasoning_token_count",
    "split_reasoning",
    "split_reply",
]
