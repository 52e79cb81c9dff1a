"""What the dashboard shows, as plain JSON: spans made readable, resources with secrets hidden, prompt diffs, metrics.

Pure functions over store objects, so the JSON API is tested without a browser and the page stays dumb.
"""

from __future__ import annotations

import csv
import difflib
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import orjson

from agl import semconv as sc
from agl.adapter.rewards import final_reward
from agl.schemas import LLMCall, ModelWeights, PromptTemplate, ResourcesVersion, Rollout, Span
from agl.store.read_model import AttemptDigest

#: attributes too bulky to ship to a browser; the view keeps their length instead
_BULKY = (
    sc.LLM_PROMPT_TOKEN_IDS,
    sc.LLM_COMPLETION_TOKEN_IDS,
    sc.LLM_LOGPROBS,
    sc.LLM_REQUEST,
    sc.LLM_RESPONSE,
)
_SECRET_KEYS = frozenset({"api_key", "authorization", "token", "password"})
MAX_METRIC_ROWS = 5000
#: the span :class:`agl.CommandAgent` writes for each run of its program
COMMAND_SPAN = "agl.command"


def redact(value: Any) -> Any:
    """``value`` with every secret-looking key's value replaced (resources may carry API keys)."""
    if isinstance(value, dict):
        return {k: ("***" if str(k).lower() in _SECRET_KEYS and v else redact(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def text_of(content: Any) -> str:
    """A chat message's content as text: OpenAI content parts joined, other parts named."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                parts.append(f"[{part.get('type', 'part')}]")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return orjson.dumps(content).decode()


def tool_calls_of(calls: Iterable[Any] | None) -> list[dict[str, Any]]:
    """OpenAI tool calls as ``{"id", "name", "arguments"}``."""
    out = []
    for call in calls or []:
        if not isinstance(call, dict):
            continue
        function = call.get("function") or {}
        out.append(
            {
                "id": call.get("id"),
                "name": function.get("name", call.get("name")),
                "arguments": function.get("arguments", call.get("arguments")),
            }
        )
    return out


def message_view(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the page shows it: role, content as text, tool calls, the tool a result answers."""
    view = {"role": message.get("role", "?"), "content": text_of(message.get("content"))}
    if message.get("tool_calls"):
        view["tool_calls"] = tool_calls_of(message["tool_calls"])
    if message.get("tool_call_id"):
        view["tool_call_id"] = message["tool_call_id"]
    if message.get("role") == "tool" and message.get("name"):
        view["tool_name"] = str(message["name"])
    return view


def _name_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each tool result named after the tool call it answers (a result carries only the call's id)."""
    names = {c["id"]: c["name"] for m in messages for c in m.get("tool_calls", []) if c.get("id")}
    for m in messages:
        if m["role"] == "tool" and "tool_name" not in m and m.get("tool_call_id") in names:
            m["tool_name"] = names[m["tool_call_id"]]
    return messages


def usage_of(usage: dict[str, Any] | None) -> dict[str, int | None]:
    """Token usage as prompt/completion/total, whichever API reported it (chat: ``prompt_tokens``;
    Responses: ``input_tokens``/``output_tokens``)."""
    u = usage or {}
    prompt = u.get("prompt_tokens", u.get("input_tokens"))
    completion = u.get("completion_tokens", u.get("output_tokens"))
    total = u.get("total_tokens")
    if total is None and isinstance(prompt, int) and isinstance(completion, int):
        total = prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


#: request fields shown as the call's settings (the messages are shown as the transcript)
_REQUEST_SKIP = frozenset({"messages", "input", "prompt", "model"})


def request_settings(request: Any) -> dict[str, Any]:
    """The request body without its messages: sampling settings, tools, response format."""
    if not isinstance(request, dict):
        return {}
    return {k: v for k, v in request.items() if k not in _REQUEST_SKIP}


def _count(value: Any) -> int | None:
    return len(value) if isinstance(value, list) else None


def _detail(span: Span) -> tuple[str, dict[str, Any]]:
    """The span's category and the few fields a person reads first."""
    a = span.attributes
    call = LLMCall.from_span(span)
    if call is not None:
        messages = _name_tool_results(
            [message_view(m) for m in call.request_messages or [] if isinstance(m, dict)]
        )
        if not messages and call.prompt is not None:
            messages = [{"role": "prompt", "content": call.prompt}]
        response = message_view(call.response_message) if call.response_message else None
        tool_calls = tool_calls_of(call.tool_calls) or (response or {}).get("tool_calls", [])
        settings = request_settings(a.get(sc.LLM_REQUEST))
        return "llm", {
            "model": call.model,
            "messages": messages,
            "response": response,
            "tool_calls": tool_calls,
            "usage": usage_of(call.usage),
            "latency_ms": a.get(sc.LLM_LATENCY_MS),
            "finish_reason": call.finish_reason,
            "error": call.error,
            "api": call.api,
            "source": call.source,
            "agent": call.agent_name,
            "model_version": call.model_version,
            "has_token_ids": a.get(sc.LLM_HAS_TOKEN_IDS, call.has_token_ids),
            "prompt_token_ids": _count(call.prompt_token_ids),
            "completion_token_ids": _count(call.completion_token_ids),
            "logprobs": _count(call.logprobs),
            "tools": [
                (t.get("function") or {}).get("name", t.get("name"))
                for t in settings.get("tools") or []
                if isinstance(t, dict)
            ],
            "settings": {k: v for k, v in settings.items() if k != "tools"},
        }
    if span.name == COMMAND_SPAN:
        return "command", {
            "argv": a.get("agl.command.argv"),
            "exit_code": a.get("agl.command.exit_code"),
            "stderr": a.get("agl.command.stderr"),
        }
    if span.name == sc.SPAN_REWARD:
        return "reward", {"value": a.get(sc.REWARD_VALUE), "values": a.get(sc.REWARD_VALUES) or {}}
    if span.name == sc.SPAN_MESSAGE:
        return "message", {"text": a.get(sc.MESSAGE_TEXT)}
    if span.name == sc.SPAN_OBJECT:
        return "object", {"value": a.get(sc.OBJECT_VALUE)}
    if span.name == sc.SPAN_EXCEPTION:
        return "exception", {
            "type": a.get(sc.EXCEPTION_TYPE),
            "message": a.get(sc.EXCEPTION_MESSAGE),
            "stacktrace": a.get(sc.EXCEPTION_STACKTRACE),
        }
    if span.name == sc.SPAN_ANNOTATION:
        return "annotation", {"value": a.get(sc.ANNOTATION)}
    if sc.OPERATION_NAME in a:
        return "operation", {
            "name": a.get(sc.OPERATION_NAME),
            "input": a.get(sc.OPERATION_INPUT),
            "output": a.get(sc.OPERATION_OUTPUT),
        }
    return "other", {"agent": a.get(sc.AGENT_NAME)}


def span_view(span: Span, depth: int = 0, recorded: frozenset[str] = frozenset()) -> dict[str, Any]:
    """One span as the page shows it: identity, timing, its category's readable fields, attributes.

    A client-side trace of a call the gateway also recorded (same response id, in ``recorded``) is
    category ``llm_trace``: it stays in the tree, but the transcript shows the call once.
    """
    category, detail = _detail(span)
    if category == "llm" and _traced_twin(span, recorded):
        category = "llm_trace"
    attributes = {k: _light(k, v) for k, v in span.attributes.items()}
    return {
        "span_id": span.span_id,
        "rollout_id": span.rollout_id,
        "parent_id": span.parent_id,
        "name": span.name,
        "category": category,
        "depth": depth,
        "sequence_id": span.sequence_id,
        "start_ns": span.start_time_ns,
        "end_ns": span.end_time_ns,
        "duration_ms": (span.end_time_ns - span.start_time_ns) / 1e6,
        "status": span.status.code.value,
        "status_message": span.status.description,
        "detail": redact(detail),
        "attributes": redact(attributes),
    }


def _light(key: str, value: Any) -> Any:
    """An attribute as the tree ships it: bulky ones (token ids, bodies) as a size note; the span's
    raw JSON (``/api/rollouts/{id}/spans/{span_id}``) has them in full."""
    if key not in _BULKY:
        return value
    if isinstance(value, list):
        return f"<{len(value)} values>"
    if isinstance(value, dict):
        return f"<object with {len(value)} keys>"
    return value


def _traced_twin(span: Span, recorded: frozenset[str]) -> bool:
    a = span.attributes
    return a.get(sc.LLM_SOURCE, "gateway") != "gateway" and str(a.get(sc.LLM_RESPONSE_ID)) in recorded


def span_tree(spans: Iterable[Span]) -> list[dict[str, Any]]:
    """Views of ``spans`` in tree order (each parent before its children, siblings by start time).

    A span whose parent is not among ``spans`` (another process's span, or a lost one) is a root. A model
    call recorded twice, by the client's tracer and by the gateway (same response id), is drawn as one
    row where the client's span sits: the gateway's record (token ids, weights version) with the client
    span's place in the tree, its name and id in ``twin_span_id`` / ``twin_name``.
    """
    spans = list(spans)
    ids = {s.span_id for s in spans}
    gateway = {
        str(s.attributes[sc.LLM_RESPONSE_ID]): s
        for s in spans
        if sc.LLM_RESPONSE_ID in s.attributes and s.attributes.get(sc.LLM_SOURCE, "gateway") == "gateway"
    }
    recorded = frozenset(gateway)
    twin_of: dict[str, Span] = {}  # client span id -> the gateway's span of the same call
    for s in spans:
        if _detail(s)[0] == "llm" and _traced_twin(s, recorded):
            twin_of.setdefault(s.span_id, gateway[str(s.attributes[sc.LLM_RESPONSE_ID])])
    drawn_in_twin = {g.span_id: c for c, g in twin_of.items()}  # gateway span id -> client span id
    children: dict[str | None, list[Span]] = {}
    for span in spans:
        if span.span_id in drawn_in_twin:
            continue
        parent = span.parent_id if span.parent_id in ids and span.parent_id != span.span_id else None
        parent = drawn_in_twin.get(parent, parent) if parent is not None else None
        children.setdefault(parent, []).append(span)
    for group in children.values():
        group.sort(key=lambda s: (s.start_time_ns, s.sequence_id or 0))
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    stack = [(s, 0) for s in reversed(children.get(None, []))]
    while stack:
        span, depth = stack.pop()
        if span.span_id in seen:  # a parent cycle in foreign spans must not loop forever
            continue
        seen.add(span.span_id)
        out.append(_row(span, depth, recorded, twin_of.get(span.span_id)))
        stack.extend((c, depth + 1) for c in reversed(children.get(span.span_id, [])))
    unseen = [s for s in spans if s.span_id not in seen and s.span_id not in drawn_in_twin]
    out.extend(_row(s, 0, recorded, twin_of.get(s.span_id)) for s in unseen)  # cycles: show them flat
    return out


def _row(span: Span, depth: int, recorded: frozenset[str], twin: Span | None) -> dict[str, Any]:
    """A tree row: the span, or for a client span with a gateway twin, the twin in the client's place."""
    if twin is None:
        return span_view(span, depth, recorded)
    view = span_view(twin, depth, recorded)
    view.update(
        parent_id=span.parent_id,
        start_ns=min(span.start_time_ns, twin.start_time_ns),
        end_ns=max(span.end_time_ns, twin.end_time_ns),
        twin_span_id=span.span_id,
        twin_name=span.name,
    )
    view["duration_ms"] = (view["end_ns"] - view["start_ns"]) / 1e6
    return view


def rollout_view(
    rollout: Rollout, reward: float | None, agent: str | None = None, started_at: float | None = None
) -> dict[str, Any]:
    """A rollout, secrets hidden, with its final reward, agent name and run time (None while it runs).

    The run time counts from ``started_at``, its first attempt's start (a claim), to its end: the
    rollout's own ``started_at`` is stamped at its first span, often just before the end.
    """
    view: dict[str, Any] = redact(rollout.model_dump(mode="json"))
    view["reward"] = reward
    view["agent"] = agent
    ended = rollout.ended_at
    view["duration_s"] = ended - started_at if ended is not None and started_at is not None else None
    return view


def listed_view(rollout: Rollout, digest: AttemptDigest | None, started_at: float | None) -> dict[str, Any]:
    """A row of the rollout list: :func:`rollout_view` with its latest attempt's digest (reward, agent)
    and what that attempt did: model calls, tool calls and completion tokens (0 with no digest)."""
    view = rollout_view(
        rollout, digest.reward if digest else None, digest.agent if digest else None, started_at
    )
    view["calls"] = digest.calls if digest else 0
    view["tool_calls"] = digest.tool_calls if digest else 0
    view["completion_tokens"] = digest.completion_tokens if digest else 0
    return view


def reward_facts(reward_spans: list[Span]) -> tuple[float | None, str | None]:
    """(final reward, agent name) of an attempt's reward spans, as its digest has them."""
    agent = next(
        (str(s.attributes[sc.AGENT_NAME]) for s in reward_spans if sc.AGENT_NAME in s.attributes), None
    )
    return final_reward(reward_spans), agent


def model_version(version: ResourcesVersion) -> str | None:
    """The weights version a resources version serves (GRPO's ``model_version``: what spans record)."""
    tagged = version.metadata.get("model_version")
    if tagged is not None:
        return str(tagged)
    for resource in version.resources.values():
        if isinstance(resource, ModelWeights):
            return resource.version
    return None


def version_label(version: ResourcesVersion) -> str | None:
    """The name a resources version was published under (``agl eval`` labels each model), if any."""
    label = version.metadata.get("label")
    return None if label is None else str(label)


def version_view(version: ResourcesVersion) -> dict[str, Any]:
    """A resources version, secrets hidden, with its APO record (parent, round, critique) if it has one."""
    view: dict[str, Any] = redact(version.model_dump(mode="json"))
    apo = version.metadata.get("apo")
    view["apo"] = apo if isinstance(apo, dict) else None
    view["diff_parent_id"] = diff_parent(version)
    view["model_version"] = model_version(version)
    view["label"] = version_label(version)
    return view


def diff_parent(version: ResourcesVersion, previous: str | None = None) -> str | None:
    """The version a change is read against: the APO parent candidate, else the stored parent, else
    ``previous`` (the version numbered just before it: GRPO's versions have no parent)."""
    apo = version.metadata.get("apo")
    if isinstance(apo, dict) and apo.get("parent_id"):
        return str(apo["parent_id"])
    return version.parent_id or previous


def _lines(version: ResourcesVersion | None, name: str) -> list[str]:
    if version is None or name not in version.resources:
        return []
    resource = version.resources[name]
    if isinstance(resource, PromptTemplate):
        return resource.template.splitlines()
    dumped = redact(resource.model_dump(mode="json"))
    return orjson.dumps(dumped, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS).decode().splitlines()


def resources_diff(old: ResourcesVersion | None, new: ResourcesVersion) -> list[dict[str, Any]]:
    """Per resource name, a line diff ``[{"op": " "|"-"|"+", "text"}]`` from ``old`` to ``new``.

    Prompts are diffed by template lines, other resources by their JSON; unchanged ones are listed
    with ``changed: False`` and no lines.
    """
    names = list(new.resources) + [n for n in (old.resources if old else {}) if n not in new.resources]
    out: list[dict[str, Any]] = []
    for name in names:
        before, after = _lines(old, name), _lines(new, name)
        kind = getattr(new.resources.get(name), "resource_type", None) or getattr(
            old.resources.get(name) if old else None, "resource_type", None
        )
        if before == after:
            out.append({"name": name, "resource_type": kind, "changed": False, "lines": []})
            continue
        lines = [
            {"op": line[0], "text": line[2:]} for line in difflib.ndiff(before, after) if line[:1] in " +-"
        ]
        out.append({"name": name, "resource_type": kind, "changed": True, "lines": lines})
    return out


def _number(text: str | None) -> float | None:
    if text is None or text == "":
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_metrics(metrics_dir: Path) -> list[dict[str, Any]]:
    """Every ``metrics.csv`` (written by :class:`agl.metrics.MetricsLogger`) in ``metrics_dir`` or one or
    two levels below, as ``{"name", "columns", "rows"}`` with the last ``MAX_METRIC_ROWS`` rows.
    """
    found = sorted(
        {
            *metrics_dir.glob("metrics.csv"),
            *metrics_dir.glob("*/metrics.csv"),
            *metrics_dir.glob("*/*/metrics.csv"),
        }
    )
    runs = []
    for path in found:
        try:
            with path.open(newline="") as f:
                reader = csv.DictReader(f)
                rows = [{k: _number(v) for k, v in row.items() if k} for row in reader]
                columns = [c for c in reader.fieldnames or [] if c]
        except (OSError, csv.Error, UnicodeDecodeError):
            continue  # a file being rewritten right now; the next poll reads it
        name = str(path.parent.relative_to(metrics_dir)) if path.parent != metrics_dir else metrics_dir.name
        store = path.parent / "store.db"  # where Trainer.fit keeps the run's own store
        runs.append(
            {
                "name": name,
                "path": str(path),
                "store": str(store) if store.is_file() else None,
                "columns": columns,
                "rows": rows[-MAX_METRIC_ROWS:],
            }
        )
    return runs
