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
differ). ``garbage_every`` / ``fail_every`` make the editor and critic misbehave on purpose;
``task_outage_calls`` makes the agent's first model calls fail as an outage would.

For side-by-side benchmarks with DSPy it also speaks DSPy's chat-adapter format (``[[ ## question ## ]]``
in, ``[[ ## answer ## ]]`` out, a tool request answered as ``LOOKUP <item>``), and plays GEPA's
reflection LM (model ``reflector``) with the same one-rule-per-edit power as the editor.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from examples.apo.price_tasks import (
    BASIC_RULES,
    CATALOG_CENTS,
    LOOKUP_TOOL,
    RULES,
    PriceTask,
    adjust,
    format_number,
    grade,
    make_tasks,
)


class SimulatedLM:
    """The rule engine: ``respond(body)`` returns an OpenAI chat completion for a request body."""

    def __init__(self, *, garbage_every: int = 0, fail_every: int = 0, task_outage_calls: int = 0) -> None:
        self.garbage_every = garbage_every
        self.fail_every = fail_every
        self.task_outage_calls = task_outage_calls  # the first this many task calls answer 500
        self.calls = {"task": 0, "critic": 0, "editor": 0, "reflector": 0}
        self.tokens = 0
        self._lock = threading.Lock()

    def respond(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return 400, _error("messages must be a non-empty list of chat messages", "messages")
        role = str(body.get("model", "task")).removeprefix("openai/")
        role = role if role in ("critic", "editor", "reflector") else "task"
        with self._lock:
            self.calls[role] += 1
            n = self.calls[role]
        if role != "task" and self.fail_every and n % self.fail_every == 0:
            return 500, _error(f"simulated {role} outage (call {n})", None)
        if role == "task" and n <= self.task_outage_calls:
            return 500, _error(f"simulated model outage (task call {n})", None)
        if role == "critic":
            message: dict[str, Any] = {"role": "assistant", "content": self._critique(messages, n)}
        elif role == "editor":
            message = {"role": "assistant", "content": self._edit(messages, int(body.get("seed") or 0), n)}
        elif role == "reflector":
            message = {"role": "assistant", "content": self._reflect(messages)}
        elif "[[ ## question ## ]]" in str(messages[-1].get("content")):
            message = {"role": "assistant", "content": self._answer_dspy(messages)}
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
            numbers = re.findall(r"\d+(?:\.\d+)?", tool_results[-1])
            cents = float(numbers[0]) if numbers else 0.0
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
        total = adjust(total, units, "including sales tax" in question, follows["bulk"], follows["tax"])
        text = (
            f"ANSWER: {format_number(total)}"
            if follows["format"]
            else f"The total is {format_number(total)}."
        )
        return {"role": "assistant", "content": text}

    def _answer_dspy(self, messages: list[dict[str, Any]]) -> str:
        """The task model behind DSPy's chat adapter: same rules, tool requests as ``LOOKUP <item>``."""
        text = str(messages[-1].get("content") or "")
        fields = dict(re.findall(r"\[\[ ## (\w+) ## \]\]\n(.*?)(?=\n\n|\Z)", text, re.S))
        chat: list[dict[str, Any]] = [m for m in messages if m.get("role") == "system"]
        chat.append({"role": "user", "content": fields.get("question", "")})
        observation = fields.get("observation", "").strip()
        if observation and observation.lower() not in ("none", "[]", '""'):
            chat.append({"role": "tool", "content": observation})
        reply = self._answer(chat)
        if reply.get("tool_calls"):
            item = json.loads(reply["tool_calls"][0]["function"]["arguments"])["item"]
            answer = f"LOOKUP {item}"
        else:
            answer = str(reply.get("content") or "")
        return f"[[ ## answer ## ]]\n{answer}\n\n[[ ## completed ## ]]"

    def _reflect(self, messages: list[dict[str, Any]]) -> str:
        """GEPA's reflection step: current instruction in the first ``` block, feedback below it."""
        shown = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "user")
        dspy_field = re.search(
            r"\[\[ ## (?:current|basic)_instruction ## \]\]\n(.*?)\n\n", shown + "\n\n", re.S
        )
        blocks = re.findall(r"```\n?(.*?)```", shown, re.S)
        current = (dspy_field.group(1) if dspy_field else blocks[0] if blocks else "").strip()
        counts = {rule: shown.count(feedback.split(":")[0]) for rule, (_, _, feedback) in RULES.items()}
        open_issues = [
            r
            for r, c in sorted(counts.items(), key=lambda kv: -kv[1])
            if c and RULES[r][0].lower() not in current.lower()
        ]
        new = f"{current} {RULES[open_issues[0]][1]}".strip() if open_issues else current
        system = " ".join(str(m.get("content") or "") for m in messages if m.get("role") == "system")
        outputs = re.findall(r"^\d+\. `(\w+)`", system.split("Your output fields are:")[-1], re.M)
        if "Your output fields are:" in system and outputs:  # a DSPy signature (GEPA's or MIPROv2's proposer)
            values = {name: new if "instruction" in name else "n/a" for name in outputs}
            if "JSON object" in system:
                return json.dumps(values)
            return (
                "\n\n".join(f"[[ ## {k} ## ]]\n{v}" for k, v in values.items()) + "\n\n[[ ## completed ## ]]"
            )
        return f"```\n{new}\n```"

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
        from agl.asgi_server import BackgroundServer

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


__all__ = [
    "BASIC_RULES",
    "CATALOG_CENTS",
    "LOOKUP_TOOL",
    "RULES",
    "PriceTask",
    "SimulatedLM",
    "SimulatedLMServer",
    "grade",
    "make_tasks",
]
