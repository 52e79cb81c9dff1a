"""Resources: immutable, versioned bundles of what an agent runs with (LLM endpoints, prompts, weights)."""

from __future__ import annotations

import string
from typing import Annotated, Any, Literal

from pydantic import Field

from agl.schemas._base import WireModel


class LLM(WireModel):
    """An OpenAI-compatible model endpoint and the sampling parameters to call it with."""

    resource_type: Literal["llm"] = "llm"
    endpoint: str
    model: str
    api_key: str | None = Field(None, description="Never logged; prefer a gateway that injects it.")
    sampling_parameters: dict[str, Any] = Field(default_factory=dict)

    def base_url(self, rollout_id: str | None = None, attempt_id: str | None = None) -> str:
        """The endpoint, scoped to a rollout when the endpoint is an agl gateway that supports it."""
        base = self.endpoint.rstrip("/")
        if rollout_id is None or "{rollout_id}" not in base:
            return base
        return base.format(rollout_id=rollout_id, attempt_id=attempt_id or "latest")


class PromptTemplate(WireModel):
    """A prompt with ``{name}`` placeholders."""

    resource_type: Literal["prompt_template"] = "prompt_template"
    template: str

    def format(self, **values: Any) -> str:
        return self.template.format(**values)

    @property
    def placeholders(self) -> list[str]:
        return [name for _, name, _, _ in string.Formatter().parse(self.template) if name]


class ModelWeights(WireModel):
    """A reference to model weights: a local directory or URI plus the engine version that serves it."""

    resource_type: Literal["model_weights"] = "model_weights"
    uri: str
    version: str | None = None
    lora: bool = False


class JsonResource(WireModel):
    """Any other JSON value an agent needs."""

    resource_type: Literal["json"] = "json"
    value: Any = None


Resource = Annotated[LLM | PromptTemplate | ModelWeights | JsonResource, Field(discriminator="resource_type")]


class ResourcesVersion(WireModel):
    """One immutable version of the named resources; ``version`` increases by one per stored bundle."""

    resources_id: str
    version: int
    resources: dict[str, Resource]
    parent_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    created_at: float
