"""A deterministic simulated language model behind a real OpenAI-compatible HTTP server, for prompt optimization.

It stands in for a paid model API in tests, examples and benchmarks. Its behaviour on the task depends
on hidden rules about what the *system prompt* says:

- **format**: it answers ``ANSWER: <number>`` only if the prompt names that format (contains ``ANSWER:``);
- **tool**: when a price is not given, it calls the ``lookup`` tool only if the prompt says to use the
  lookup tool (contains ``lookup tool``); otherwise it guesses;
- **trap**: catalog prices are in cents; it converts to dollars only if warned (prompt mentions ``cents``).

It also plays **critic** (model ``critic``) and **editor** (model ``editor``) by rule: the critic names
the rule behind the most common failure in the trajectories it is shown; the editor adds one
instruction for an issue in the critique, choosing which by the request's ``seed`` (so branches
differ). ``garbage_every`` / ``fail_every`` make the editor and critic misbehave on purpose.
"""

from __future__ import annotations

import json
import random
import re
import threading
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

CATALOG_CENTS = {f"item-{i}": 100 * (3 + (i * 7) % 11) + 25 * (i % 4) for i in range(200)}

#: rule name -> (what the prompt must contain, the instruction that satisfies it, the feedback a failure yields)
RULES: dict[str, tuple[str, str, str]] = {
    "format": (
        "ANSWER:",
        "End your reply with one line of the form 'ANSWER: <number>'.",
        "wrong format: the reply must end with 'ANSWER: <number>'",
    ),
    "tool": (
        "lookup tool",
        "When a price is not given, call the lookup tool with the item name before answering.",
        "price unknown: the agent guessed instead of calling the lookup tool",
    ),
    "trap": (
        "cents",
        "Catalog prices are in cents: convert them to dollars before computing the total.",
        "unit error: catalog prices are in cents but the answer must be in dollars",
    ),
}

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up the catalog price of an item.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]},
    },
}


@dataclass(frozen=True, slots=True)
class PriceTask:
    """``level`` 1: price given (needs the format rule); 2: price only in the catalog (needs the tool);
    3: the catalog price is in cents (needs the warning too)."""

    question: str
    answer: float
    level: int

    def as_input(self) -> dict[str, Any]:
        return {"question": self.question, "answer": self.answer, "level": self.level}


def make_tasks(n: int, seed: int = 0, levels: tuple[int, ...] = (1, 2, 3)) -> list[PriceTask]:
    """``n`` tasks cycling through ``levels``, deterministic by seed."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        level = levels[i % len(levels)]
        item = f"item-{rng.randrange(len(CATALOG_CENTS))}"
        units = rng.randint(2, 9)
        cents = CATALOG_CENTS[item]
        if level == 1:
            price = rng.randint(2, 40)
            tasks.append(
                PriceTask(
                    f"One {item} costs {price} dollars. What do {units} of them cost?", units * price, 1
                )
            )
        elif level == 2:
            tasks.append(
                PriceTask(f"What do {units} units of {item} cost, in catalog units?", units * cents, 2)
            )
        else:
            question = f"What do {units} units of {item} cost in dollars?"
            tasks.append(PriceTask(question, round(units * cents / 100, 2), 3))
    return tasks


def grade(task: dict[str, Any], reply: str, used_tool: bool) -> tuple[float, str]:
    """Reward 1 for the right number in the required format; otherwise 0 and feedback naming the failure."""
    match = re.search(r"ANSWER:\s*(-?[\d.]+)\s*$", reply.strip())
    if match is None:
        return 0.0, RULES["format"][2]
    value = float(match.group(1))
    if abs(value - float(task["answer"])) < 1e-6:
        return 1.0, "correct"
    if task["level"] >= 2 and not used_tool:
        return 0.0, RULES["tool"][2]
    if task["level"] == 3:
        return 0.0, RULES["trap"][2]
    return 0.0, f"wrong value: expected {task['answer']}, got {value}"


def _format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.2f}"


class SimulatedLM:
    """The rule engine: ``respond(body)`` returns an OpenAI chat completion for a request body."""

    def __init__(self, *, garbage_every: int = 0, fail_every: int = 0) -> None:
        self.garbage_every = garbage_every
        self.fail_every = fail_every
        self.calls = {"task": 0, "critic": 0, "editor": 0}
        self.tokens = 0
        self._lock = threading.Lock()

    def respond(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, _error("messages must be a non-empty list of chat messages", "messages")
        role = str(body.get("model", "task"))
        role = role if role in ("critic", "editor") else "task"
        with self._lock:
            self.calls[role] += 1
            n = self.calls[role]
        if role != "task" and self.fail_every and n % self.fail_every == 0:
            return 500, _error(f"simulated {role} outage (call {n})", None)
        if role == "critic":
            message: dict[str, Any] = {"role": "assistant", "content": self._critique(messages, n)}
        elif role == "editor":
            message = {"role": "assistant", "content": self._edit(messages, int(body.get("seed") or 0), n)}
        else:
            message = self._answer(messages)
        prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in messages)
        completion_tokens = len(str(message.get("content") or "").split()) + 5 * len(
            message.get("tool_calls") or []
        )
        with self._lock:
            self.tokens += prompt_tokens + completion_tokens
        return 200, {
            "id": f"chatcmpl-sim-{role}-{n}",
            "object": "chat.completion",
            "model": role,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    # ----- the task model --------------------------------------------------------------------
    def _answer(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        system = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "system")
        question = next((str(m.get("content") or "") for m in messages if m.get("role") == "user"), "")
        tool_results = [str(m.get("content") or "") for m in messages if m.get("role") == "tool"]
        follows = {rule: needle.lower() in system.lower() for rule, (needle, _, _) in RULES.items()}
        given = re.search(r"costs (\d+) dollars", question)
        units_match = re.search(r"(?:What do|cost of) (\d+)", question)
        units = int(units_match.group(1)) if units_match else 1
        item_match = re.search(r"(item-\d+)", question)
        in_dollars = "in dollars" in question
        total: float
        if given:
            total = units * int(given.group(1))
        elif tool_results:
            cents = (
                float(re.findall(r"[\d.]+", tool_results[-1])[0])
                if re.findall(r"[\d.]+", tool_results[-1])
                else 0
            )
            total = units * cents
            if in_dollars and follows["trap"]:
                total = round(total / 100, 2)
        elif follows["tool"] and item_match:
            call = {
                "id": f"call-{item_match.group(1)}",
                "type": "function",
                "function": {"name": "lookup", "arguments": json.dumps({"item": item_match.group(1)})},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        else:
            total = units * 10  # a guess
        text = (
            f"ANSWER: {_format_number(total)}"
            if follows["format"]
            else f"The total is {_format_number(total)}."
        )
        return {"role": "assistant", "content": text}

    # ----- critic and editor -------------------------------------------------------------------
    def _critique(self, messages: list[dict[str, Any]], n: int) -> str:
        if self.garbage_every and n % self.garbage_every == 0:
            return "asdf qwerty " * 5
        shown = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
        counts = {rule: shown.count(feedback.split(":")[0]) for rule, (_, _, feedback) in RULES.items()}
        issues = [rule for rule, c in sorted(counts.items(), key=lambda kv: -kv[1]) if c > 0]
        if not issues:
            return "The prompt works; no systematic failure is visible."
        return " ".join(f"ISSUE[{rule}]: {RULES[rule][2]}." for rule in issues)

    def _edit(self, messages: list[dict[str, Any]], seed: int, n: int) -> str:
        if self.garbage_every and n % self.garbage_every == 0:
            return "I cannot help with that, here are some thoughts instead."
        shown = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
        found = re.findall(r"<prompt>(.*?)</prompt>", shown, re.S)
        prompt = found[-1].strip() if found else ""
        issues = [rule for rule in re.findall(r"ISSUE\[(\w+)\]", shown) if rule in RULES]
        open_issues = [r for r in dict.fromkeys(issues) if RULES[r][0].lower() not in prompt.lower()]
        if open_issues:
            prompt = f"{prompt} {RULES[open_issues[seed % len(open_issues)]][1]}".strip()
        return f"<prompt>{prompt}</prompt>"


def _error(message: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


async def _sse(completion: dict[str, Any]) -> Any:
    """The completion as OpenAI stream chunks: role, content word by word, tool calls, finish, usage."""
    choice = completion["choices"][0]
    message = choice["message"]
    base = {"id": completion["id"], "object": "chat.completion.chunk", "model": completion["model"]}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        body = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        return f"data: {json.dumps(body)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    for n, word in enumerate(str(message.get("content") or "").split(" ")):
        yield chunk({"content": word if n == 0 else " " + word})
    for index, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": index, **call}]})
    yield chunk({}, choice["finish_reason"])
    yield f"data: {json.dumps({**base, 'choices': [], 'usage': completion['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def simulated_lm_app(model: SimulatedLM) -> Starlette:
    """The ASGI app: ``POST /v1/chat/completions`` and ``GET /v1/models``."""

    async def chat(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            return JSONResponse(_error("the body is not valid JSON", None), status_code=400)
        if not isinstance(body, dict):
            return JSONResponse(_error("the body must be a JSON object", None), status_code=400)
        status, payload = model.respond(body)
        if status == 200 and body.get("stream"):
            return StreamingResponse(_sse(payload), media_type="text/event-stream")
        return JSONResponse(payload, status_code=status)

    async def models(request: Request) -> JSONResponse:
        data = [
            {"id": name, "object": "model", "owned_by": "agl-sim"} for name in ("task", "critic", "editor")
        ]
        return JSONResponse({"object": "list", "data": data})

    return Starlette(
        routes=[Route("/v1/chat/completions", chat, methods=["POST"]), Route("/v1/models", models)]
    )


class SimulatedLMServer:
    """``with SimulatedLMServer() as server: server.base_url`` serves a :class:`SimulatedLM` on loopback."""

    def __init__(self, model: SimulatedLM | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        from agl.serving import BackgroundServer

        self.model = model or SimulatedLM()
        self._server = BackgroundServer(simulated_lm_app(self.model), host=host, port=port)

    @property
    def base_url(self) -> str:
        return f"{self._server.url}/v1"

    def start(self) -> SimulatedLMServer:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> SimulatedLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
