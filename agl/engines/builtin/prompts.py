"""Render OpenAI chat messages with a model's chat template.

Messages are normalised first: content-part lists become text and tool-call ``arguments`` JSON strings
become objects (templates ``tojson`` them). A template that ignores ``tools`` gets them described in the
system message in the Hermes ``<tool_call>`` format, which :mod:`.tools` parses back.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from agl.errors import InvalidRequestError

_TOOLS_SYSTEM = (
    "You may call one or more functions. Function signatures are inside <tools></tools>:\n<tools>\n{tools}\n"
    "</tools>\nFor each call, reply with "
    '<tool_call>{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>'
)


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidRequestError(
                    f"{where}.content[{i}] must be a text part {{'type': 'text', 'text': ...}}; "
                    "this engine serves text-only models",
                    param=f"{where}.content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise InvalidRequestError(
        f"{where}.content must be a string or a list of text parts", param=f"{where}.content"
    )


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of ``messages`` with text content and tool-call arguments as objects."""
    out = []
    for i, message in enumerate(messages):
        msg = copy.deepcopy(message)
        # templates index message['content'] even on tool-call turns, where clients often leave it out
        msg["content"] = _text(msg.get("content"), f"messages[{i}]") or ""
        for j, call in enumerate(msg.get("tool_calls") or []):
            fn = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise InvalidRequestError(
                    f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': {{'name': str, "
                    f"'arguments': str}}}}, got {call!r:.200}",
                    param=f"messages[{i}].tool_calls",
                )
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError as exc:
                    raise InvalidRequestError(
                        f"messages[{i}].tool_calls arguments must be a JSON object string: {exc}",
                        param=f"messages[{i}].tool_calls",
                    ) from exc
        out.append(msg)
    return out


def _fold_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool calls as Hermes markup in its content, for templates that drop ``tool_calls``:
    the model then sees its own calls in the history, written as it was asked to write them."""
    calls = message.pop("tool_calls", None) or []
    blocks = []
    for call in calls:
        fn = call.get("function", call)
        args = json.dumps(fn.get("arguments", {}), ensure_ascii=False)
        blocks.append(f'<tool_call>{{"name": "{fn["name"]}", "arguments": {args}}}</tool_call>')
    if blocks:
        message["content"] = "\n".join(([message["content"]] if message["content"] else []) + blocks)
    return message


#: arguments render_chat_text sets itself: a request's chat_template_kwargs may not override them
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "tokenize", "add_generation_prompt"})


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Prompt token ids for ``messages`` with the generation prompt appended."""
    text = render_chat_text(tokenizer, messages, tools, template_kwargs=template_kwargs)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def render_chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """``messages`` rendered by the chat template, tools in the template's own format where it has one;
    ``template_kwargs`` (a request's ``chat_template_kwargs``, e.g. ``enable_thinking``) reach the template."""
    if not messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    clash = sorted(_RESERVED_KWARGS & set(template_kwargs or {}))
    if clash:
        raise InvalidRequestError(
            f"chat_template_kwargs may not set {', '.join(clash)}: the request's own fields decide those",
            param="chat_template_kwargs",
        )
    msgs = normalise_messages(messages)
    template = tokenizer.chat_template or ""
    if "tool_calls" not in template:
        msgs = [_fold_tool_calls(m) for m in msgs]
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if tools and "tools" in template:
        kwargs["tools"] = tools
    elif tools:
        described = _TOOLS_SYSTEM.format(tools="\n".join(json.dumps(t) for t in tools))
        if msgs[0].get("role") == "system":
            msgs[0]["content"] = f"{msgs[0]['content'] or ''}\n\n{described}"
        else:
            msgs.insert(0, {"role": "system", "content": described})
    try:
        text = tokenizer.apply_chat_template(
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # jinja errors name the template problem; the caller sent unusable messages
        raise InvalidRequestError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    return str(text)
