"""Resources: immutable, versioned bundles of what an agent runs with (LLM endpoints, prompts, weights)."""

from __future__ import annotations

import re
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

    def endpoint_for(self, agent: str) -> str:
        """This agl gateway endpoint for one agent of a multi-agent rollout: the gateway tags every call
        made through it with ``agl.agent.name = agent`` (for ``GRPOConfig(agents=...)``; with a LoRA adapter per agent, its adapter answers them)."""
        base = self.endpoint.rstrip("/")
        if "/rollout/" not in base or not base.endswith("/v1"):
            raise ValueError(
                f"endpoint_for needs an agl gateway rollout endpoint (.../rollout/<id>/attempt/<id>/v1), "
                f"got {self.endpoint!r}; use agl.agent_scope(...) with other endpoints"
            )
        if not agent or "/" in agent:
            raise ValueError(f"agent name must be non-empty and contain no '/', got {agent!r}")
        return f"{base[: -len('/v1')]}/agent/{agent}/v1"


class PromptTemplate(WireModel):
    """A prompt with ``{name}`` placeholders (``name`` an identifier); any other brace is literal text.

    So ``Reply as {"answer": <number>}`` stays as written while ``{question}`` is filled in; ``{{`` and
    ``}}`` still write a literal brace, as in ``str.format``.
    """

    resource_type: Literal["prompt_template"] = "prompt_template"
    template: str

    def format(self, **values: Any) -> str:
        """Fill every placeholder; a placeholder without a value raises ``KeyError`` naming it."""

        def fill(match: re.Match[str]) -> str:
            if match.group(1) is not None:
                return match.group(1)[0]  # "{{" or "}}" -> one literal brace
            name = match.group(2)
            if name not in values:
                raise KeyError(
                    f"{name!r}: the prompt has the placeholder {{{name}}} but format() got only "
                    f"{sorted(values)}; rename the placeholder or pass {name}=..."
                )
            return str(values[name])

        return _PLACEHOLDER.sub(fill, self.template)

    @property
    def placeholders(self) -> list[str]:
        """The placeholder names, in order of first use."""
        names = [m.group(2) for m in _PLACEHOLDER.finditer(self.template) if m.group(2) is not None]
        return list(dict.fromkeys(names))


_PLACEHOLDER = re.compile(r"(\{\{|\}\})|\{([A-Za-z_][A-Za-z0-9_]*)\}")


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
