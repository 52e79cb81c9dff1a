"""A judge for tasks without labels: one model call scores a group's trajectories side by side (RULER).

The judge sees every trajectory of a GRPO group at once (the task, each rollout's conversation with its
tool calls, and its final answer) and returns a score in [0, 1] and a one-line reason for each. Scores
relative to each other are what group-relative advantages need, and are easier for a model to give
than absolute ones. A reply that is not the JSON asked for is retried (``max_tries``); after that the
group raises :class:`agl.errors.JudgeError`: no reward, never a reward of 0.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agl.errors import ConfigError, JudgeError

SYSTEM_PROMPT = """You judge attempts at one task. You see {n} trajectories: each is one attempt (its \
conversation, tool calls and final answer). Score each from 0 to 1 by the rubric, comparing them with \
each other: a better trajectory scores higher, equally good ones score the same. Give every trajectory a \
one-line reason.

Rubric:
{rubric}

Reply with JSON only, exactly {n} entries, one per trajectory, in order:
{{"scores": [{{"trajectory": 1, "score": 0.5, "reason": "one line"}}, ...]}}"""

RETRY_PROMPT = "That reply could not be used: {problem}. Reply with the JSON only, {n} entries."


@dataclass(frozen=True)
class JudgeScore:
    """One trajectory's score in [0, 1] and the judge's one-line reason."""

    score: float
    reason: str


@dataclass(frozen=True)
class Verdict:
    """A group's scores (in the order shown), every raw reply (one per try) and the prompt sent first."""

    scores: list[JudgeScore]
    replies: list[str]
    messages: list[dict[str, Any]]


class MalformedReply(ValueError):
    """The judge's reply is not the JSON asked for (the message says what is wrong)."""


@dataclass(frozen=True)
class Judge:
    """``Judge(endpoint, rubric, model=...)``: an OpenAI-compatible chat endpoint that scores groups.

    ``endpoint`` is the base URL (``https://api.openai.com/v1``); ``api_key`` defaults to
    ``OPENAI_API_KEY``. ``max_tries`` bounds the calls per group when replies are malformed;
    ``max_chars`` bounds each trajectory's text in the prompt (its middle is cut).
    """

    endpoint: str
    rubric: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    max_tries: int = 3
    temperature: float | None = 0.0  # None: not sent (models that accept only their default)
    max_chars: int = 6000
    timeout_s: float = 120.0
    concurrency: int = 8  # groups judged at once
    http_retries: int = 2  # the openai SDK's retries of a 5xx, 429 or dropped connection

    def __post_init__(self) -> None:
        if not re.match(r"^https?://", self.endpoint or ""):
            raise ConfigError(f"Judge(endpoint=...) must be an http(s) base URL, got {self.endpoint!r}")
        if not self.rubric or not self.rubric.strip():
            raise ConfigError("Judge(rubric=...) must say what a good trajectory is; got an empty rubric")
        if not self.model:
            raise ConfigError("Judge(model=...) must name the judge's model")
        if self.max_tries < 1 or self.concurrency < 1 or self.max_chars < 200:
            raise ConfigError(
                "Judge needs max_tries >= 1, concurrency >= 1 and max_chars >= 200, got "
                f"{self.max_tries}, {self.concurrency}, {self.max_chars}"
            )

    def client(self) -> Any:
        """A new ``openai.AsyncOpenAI`` on the endpoint (the caller closes it)."""
        import openai

        key = self.api_key or os.environ.get("OPENAI_API_KEY") or "none"
        return openai.AsyncOpenAI(
            base_url=self.endpoint, api_key=key, timeout=self.timeout_s, max_retries=self.http_retries
        )

    def prompt(self, task: Any, trajectories: Sequence[str]) -> list[dict[str, Any]]:
        """The chat messages asking for ``len(trajectories)`` scores."""
        n = len(trajectories)
        shown = task if isinstance(task, str) else json.dumps(task, default=str, ensure_ascii=False)
        parts = [f"Task:\n{clip(shown, self.max_chars)}"]
        for i, text in enumerate(trajectories, 1):
            parts.append(f"=== Trajectory {i} ===\n{clip(text, self.max_chars)}")
        return [
            {"role": "system", "content": SYSTEM_PROMPT.format(n=n, rubric=self.rubric.strip())},
            {"role": "user", "content": "\n\n".join(parts)},
        ]

    async def score(
        self, task: Any, trajectories: Sequence[str], *, client: Any = None, group_id: str | None = None
    ) -> Verdict:
        """Score the trajectories of one group; raises :class:`JudgeError` when no try gives usable JSON."""
        import openai

        if not trajectories:
            raise ValueError("nothing to judge: no trajectories")
        own = client is None
        client = client or self.client()
        messages = self.prompt(task, trajectories)
        sent = list(messages)
        replies: list[str] = []
        problem = ""
        extra = {} if self.temperature is None else {"temperature": self.temperature}
        try:
            for _ in range(self.max_tries):
                try:
                    reply = await client.chat.completions.create(model=self.model, messages=sent, **extra)
                except openai.OpenAIError as exc:
                    raise JudgeError(
                        f"the judge at {self.endpoint} failed: {type(exc).__name__}: {exc}",
                        group_id=group_id,
                        replies=replies,
                    ) from exc
                text = (reply.choices[0].message.content or "") if reply.choices else ""
                replies.append(text)
                try:
                    return Verdict(parse_scores(text, len(trajectories)), replies, messages)
                except MalformedReply as exc:
                    problem = str(exc)
                sent = [
                    *sent,
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": RETRY_PROMPT.format(problem=problem, n=len(trajectories))},
                ]
        finally:
            if own:
                await client.close()
        raise JudgeError(
            f"the judge gave no usable scores in {self.max_tries} tries (last problem: {problem})",
            group_id=group_id,
            replies=replies,
        )


def clip(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: its head and tail, the middle cut and marked."""
    if len(text) <= limit:
        return text
    keep = (limit - 40) // 2
    return f"{text[:keep]}\n[... {len(text) - 2 * keep} characters cut ...]\n{text[-keep:]}"


def _json_object(text: str) -> Any:
    body = text.strip()
    fenced = re.search(r"```(?:json)?\s*(.*?)```", body, re.S)
    if fenced:
        body = fenced.group(1).strip()
    start = min((i for i in (body.find("{"), body.find("[")) if i >= 0), default=-1)
    end = max(body.rfind("}"), body.rfind("]"))
    if start < 0 or end < start:
        raise MalformedReply("no JSON object in the reply")
    try:
        return json.loads(body[start : end + 1])
    except json.JSONDecodeError as exc:
        raise MalformedReply(f"the reply is not valid JSON ({exc.msg})") from exc


def parse_scores(text: str, n: int) -> list[JudgeScore]:
    """The ``n`` scores of a reply ``{"scores": [{"trajectory", "score", "reason"}, ...]}``, in order.

    Raises :class:`MalformedReply` naming the problem: not JSON, a wrong count, a score that is not a
    number in [0, 1], a missing reason, or trajectory numbers that are not 1..n.
    """
    data = _json_object(text)
    entries = data.get("scores") if isinstance(data, Mapping) else data
    if not isinstance(entries, list):
        raise MalformedReply('the JSON has no "scores" list')
    if len(entries) != n:
        raise MalformedReply(f"{len(entries)} scores for {n} trajectories")
    out: dict[int, JudgeScore] = {}
    for i, entry in enumerate(entries, 1):
        if not isinstance(entry, Mapping):
            raise MalformedReply(f"score {i} is not an object")
        number = entry.get("trajectory", i)
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= n or number in out:
            raise MalformedReply(f"score {i} names trajectory {number!r}; expected each of 1..{n} once")
        value = entry.get("score")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MalformedReply(f"trajectory {number}'s score {value!r} is not a number")
        if not 0.0 <= value <= 1.0:
            raise MalformedReply(f"trajectory {number}'s score {value} is outside 0-1")
        reason = entry.get("reason")
        if not isinstance(reason, str):
            raise MalformedReply(f"trajectory {number} has no reason")
        out[number] = JudgeScore(float(value), " ".join(reason.split())[:500])
    return [out[i] for i in range(1, n + 1)]


__all__ = ["Judge", "JudgeScore", "Verdict", "parse_scores"]
