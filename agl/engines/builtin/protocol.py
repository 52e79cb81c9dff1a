"""OpenAI request bodies accepted by the engine server, and the token-fidelity response fields.

Unknown OpenAI fields are accepted and ignored, so real clients work unchanged. Responses always carry
``prompt_token_ids``, per-choice ``token_ids`` and ``logprobs`` (vLLM's shape) and ``model_version``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agl.engines.builtin.engine import Choice, PromptLogprob
from agl.engines.builtin.sampling import MAX_TOP_LOGPROBS, SamplingParams


class Message(BaseModel):
    """One chat message; content may be a string or a list of text parts."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None

    def sampling(self, top_logprobs: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            max_tokens=self.max_completion_tokens or self.max_tokens,
            stop=stop,
            seed=self.seed,
            n=self.n,
            top_logprobs=top_logprobs,
        )


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``; ``logprobs`` are returned whether or not they are requested."""

    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # extra variables for the chat template, as vLLM takes them (e.g. {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a text prompt or a list of token ids; ``logprobs`` k adds top-k."""

    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False
    # vLLM's extension: each prompt token's log-prob under the model (and the k likeliest), as a
    # distillation teacher scores a student's tokens
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class WeightsRequest(BaseModel):
    """``POST /v1/weights``: load a model folder (full weights) or a PEFT adapter folder (``lora``)."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    lora: bool | None = None
    version: str | None = None


def chat_logprobs(tokenizer: Any, choice: Choice, start: int = 0, end: int | None = None) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` for tokens ``start:end``."""
    ids = choice.token_ids[start:end]
    content = []
    for offset, (tid, lp) in enumerate(zip(ids, choice.logprobs[start:end], strict=True)):
        tops = choice.top_logprobs[start + offset] if choice.top_logprobs else []
        content.append(
            {
                "token": tokenizer.decode([tid]),
                "logprob": lp,
                "bytes": None,
                "top_logprobs": [
                    {"token": tokenizer.decode([t]), "logprob": v, "bytes": None} for t, v in tops
                ],
            }
        )
    return {"content": content}


def prompt_logprobs_view(tokenizer: Any, ids: list[int], scored: list[PromptLogprob]) -> list[Any]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token ``{id: {logprob, rank,
    decoded_token}}`` for the token itself and its position's k likeliest."""
    out: list[Any] = [None]
    for token, (logprob, rank, tops) in zip(ids[1:], scored, strict=True):
        entry = {
            str(t): {"logprob": lp, "rank": n, "decoded_token": tokenizer.decode([t])}
            for n, (t, lp) in enumerate(tops, 1)
        }
        entry[str(token)] = {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.decode([token])}
        out.append(entry)
    return out


def completion_logprobs(tokenizer: Any, choice: Choice) -> dict[str, Any]:
    """The legacy completions logprobs shape, plus the chat-style ``content`` list."""
    chat = chat_logprobs(tokenizer, choice)
    tokens = [entry["token"] for entry in chat["content"]]
    offsets, pos = [], 0
    for token in tokens:
        offsets.append(pos)
        pos += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": list(choice.logprobs),
        "top_logprobs": [
            {e["token"]: e["logprob"] for e in entry["top_logprobs"]} for entry in chat["content"]
        ],
        "text_offset": offsets,
        "content": chat["content"],
    }
