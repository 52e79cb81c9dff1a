"""Gateway configuration: the upstream replicas, retry and health policy, pause and recording settings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

UpstreamKind = Literal["vllm", "agl", "openai"]

# What to add to a forwarded body so the engine returns token ids and logprobs (never overrides the agent).
# OpenAI proper rejects unknown fields, so "openai" asks for nothing and its calls record has_token_ids=False.
TOKEN_FIELDS: dict[str, dict[str, dict[str, Any]]] = {
    "vllm": {
        "chat.completions": {"return_token_ids": True, "logprobs": True},
        "completions": {"return_token_ids": True, "logprobs": 1},
    },
    "agl": {
        "chat.completions": {"return_token_ids": True, "logprobs": True},
        "completions": {"return_token_ids": True, "logprobs": 1},
    },
    "openai": {},
}


class UpstreamConfig(BaseModel):
    """One model backend replica: an OpenAI-compatible base URL (ending in ``/v1``)."""

    model_config = ConfigDict(extra="forbid")

    url: str
    kind: UpstreamKind = "vllm"
    api_key: str | None = Field(
        None, repr=False, description="Sent upstream as a bearer token; never recorded."
    )
    models: list[str] | None = Field(None, description="Models this replica serves; None serves any model.")
    apis: list[Literal["chat.completions", "completions", "responses", "embeddings"]] | None = Field(
        None,
        description="APIs this replica serves (an embeddings-only server: ['embeddings']); None serves all. "
        "Anthropic Messages calls reach it as chat.completions.",
    )
    name: str | None = Field(None, description="Recorded as the backend; defaults to the URL.")
    token_fields: dict[str, dict[str, Any]] | None = Field(
        None, description="Per API, fields added to forwarded bodies; None uses the kind's defaults."
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream url must start with http:// or https://, got {v!r}")
        return v.rstrip("/")

    @property
    def backend(self) -> str:
        return self.name or self.url

    def fields_for(self, api: str) -> dict[str, Any]:
        table = self.token_fields if self.token_fields is not None else TOKEN_FIELDS[self.kind]
        return table.get(api, {})


class GatewayConfig(BaseModel):
    """How the gateway retries, checks health, pauses and records."""

    model_config = ConfigDict(extra="forbid")

    max_attempts: int = Field(
        3, ge=1, description="Tries per call across replicas (transport errors and 5xx)."
    )
    backoff_s: float = Field(0.05, ge=0, description="First retry delay; doubles per retry.")
    backoff_max_s: float = Field(1.0, ge=0)
    connect_timeout_s: float = Field(5.0, gt=0)
    read_timeout_s: float = Field(600.0, gt=0, description="Per read; generation can be slow.")
    health_interval_s: float = Field(5.0, gt=0, description="How often unhealthy replicas are probed.")
    max_connections: int = Field(512, ge=1)
    retry_after_s: int = Field(1, ge=1, description="Retry-After sent with 429 while paused.")
    record_unattributed: bool = Field(
        False,
        description="Record calls without a rollout: each conversation (x-agl-session-id header or OpenAI "
        "'user' field; else the call alone) as a rollout of mode 'online' the gateway creates.",
    )
    stream_usage: bool = Field(True, description="Ask streams for a final usage chunk (stream_options).")
    queue_size: int = Field(
        10_000, ge=1, description="Spans waiting for the store; beyond it they are dropped."
    )
    batch_size: int = Field(256, ge=1)
    span_deadline_s: float = Field(
        600.0, gt=0, description="How long spans wait through a store outage before they count failed."
    )
    attribution_cache_size: int = Field(
        10_000, ge=0, description="Attempts, and sessions of online rollouts, remembered without the store."
    )
    response_index_size: int = Field(
        100_000, ge=0, description="Response ids of recorded calls remembered for late rewards."
    )
    reward_scan_rollouts: int = Field(
        1_000,
        ge=0,
        description="Newest online rollouts a late reward's unremembered response id is sought in.",
    )
