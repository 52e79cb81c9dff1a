"""SFT data: select good rollouts, build token-level samples (engine ids from spans, or chat-template
rendering when ids are absent); the OpenAI chat JSONL writer and reader live in :mod:`agl.algorithm.chat_jsonl`."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from agl.adapter import Sample, filter_calls, final_reward, llm_calls, to_messages, to_samples
from agl.algorithm.chat_jsonl import export_jsonl as export_jsonl
from agl.algorithm.chat_jsonl import import_jsonl as import_jsonl
from agl.algorithm.chat_jsonl import request_tools as request_tools
from agl.schemas import Rollout, RolloutStatus, Span


def select_rollouts(
    rollouts: Sequence[Rollout],
    spans: dict[str, list[Span]],
    *,
    min_reward: float | None = None,
    top_k_per_task: int | None = None,
) -> list[Rollout]:
    """Succeeded rollouts with reward >= ``min_reward``, and/or the ``top_k_per_task`` best per group/input."""
    scored = [
        (r, final_reward(spans.get(r.rollout_id, [])) or 0.0)
        for r in rollouts
        if r.status == RolloutStatus.SUCCEEDED
    ]
    if min_reward is not None:
        scored = [(r, s) for r, s in scored if s >= min_reward]
    if top_k_per_task is not None:
        by_task: dict[str, list[tuple[Rollout, float]]] = defaultdict(list)
        for r, s in scored:
            by_task[r.group_id or json.dumps(r.input, sort_keys=True, default=str)].append((r, s))
        scored = [
            pair for group in by_task.values() for pair in sorted(group, key=lambda p: -p[1])[:top_k_per_task]
        ]
    return [r for r, _ in scored]


def samples_from_spans(
    rollouts: Sequence[Rollout], spans: dict[str, list[Span]], *, agent: str | None = None
) -> list[Sample]:
    """Token-level samples from the engine's own ids (trajectory-merged, model tokens masked in).

    ``agent``: only that agent's calls (by ``agl.agent_scope`` name, agent endpoint or enclosing span name).
    """
    out: list[Sample] = []
    for r in rollouts:
        calls = filter_calls(llm_calls(spans[r.rollout_id]), agent, spans[r.rollout_id])
        made, _ = to_samples(calls, final_reward(spans[r.rollout_id]) or 0.0, group_id=r.group_id)
        out += made
    return out


def _assistant_text(
    tokenizer: Any, messages: list[dict[str, Any]], k: int, tools: list[dict[str, Any]] | None
) -> str:
    """What the model must emit for assistant turn ``messages[k]``: its text, or its tool calls.

    Tool calls take the chat template's own markup where the template renders ``tool_calls`` (Qwen's
    ``<tool_call>\n{...}\n</tool_call>``, say), so that the model learns the form its template, its
    parsers and later turns' prompts expect; otherwise Hermes ``<tool_call>`` blocks, as the engine asks.
    """
    from agl.engines.builtin.prompts import render_chat_text

    message = messages[k]
    calls = message.get("tool_calls") or []
    if not calls:
        return str(message.get("content") or "")
    eos = tokenizer.eos_token
    if "tool_calls" in (tokenizer.chat_template or "") and eos:
        before = render_chat_text(tokenizer, messages[:k], tools)
        whole = render_chat_text(tokenizer, messages[: k + 1], tools, add_generation_prompt=False)
        turn = whole[len(before) :] if whole.startswith(before) else ""
        if eos in turn:  # the turn up to its end-of-turn token, which the caller appends as an id
            return turn[: turn.index(eos)]
    blocks = []
    for call in calls:
        fn = call.get("function", call)
        args = fn.get("arguments")
        args = json.loads(args) if isinstance(args, str) else args
        blocks.append("<tool_call>" + json.dumps({"name": fn["name"], "arguments": args}) + "</tool_call>")
    return "\n".join(blocks)


def samples_from_messages(
    tokenizer: Any, conversations: Sequence[list[dict[str, Any]]], tools: list[dict[str, Any]] | None = None
) -> list[Sample]:
    """One sample per assistant turn: the prompt rendered exactly as the built-in engine renders it at
    inference, then the turn's tokens and the end-of-turn token (the only tokens with loss)."""
    from agl.engines.builtin.prompts import render_chat

    eos = tokenizer.eos_token_id
    out: list[Sample] = []
    for n, messages in enumerate(conversations):
        for k, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            prompt = render_chat(tokenizer, list(messages[:k]), tools)
            target = tokenizer.encode(
                _assistant_text(tokenizer, messages, k, tools), add_special_tokens=False
            ) + ([eos] if eos is not None else [])
            out.append(
                Sample(
                    rollout_id=f"conversation-{n}",
                    group_id=None,
                    input_ids=tuple(prompt + target),
                    loss_mask=tuple([0] * len(prompt) + [1] * len(target)),
                    old_logprobs=None,
                    reward=1.0,
                )
            )
    return out


def tools_from_spans(
    rollouts: Sequence[Rollout], spans: dict[str, list[Span]]
) -> list[list[dict[str, Any]] | None]:
    """Each rollout's declared tools (its last model call's request ``tools``), None where it declared none."""
    return [request_tools(spans[r.rollout_id]) for r in rollouts]


def conversations_from_spans(
    rollouts: Sequence[Rollout], spans: dict[str, list[Span]]
) -> list[list[dict[str, Any]]]:
    """The selected rollouts' conversations (messages adapter), for export or template-rendered SFT."""
    return [to_messages(llm_calls(spans[r.rollout_id])) for r in rollouts]
