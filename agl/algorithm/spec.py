"""What an algorithm asks ``Trainer.fit`` to serve: a :class:`ModelSpec`, from ``Algorithm.model_spec()``.

The spec is the whole contract between the trainer and the algorithm about the model: fit starts the
engines and the gateway for ``spec.path`` with the spec's LoRA rank and precision, and reads nothing
else of the algorithm. Each field is checked when the spec is made, so a wrong one fails by name.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from agl.errors import ConfigError

if TYPE_CHECKING:
    from agl.compute.precision import Precision
    from agl.engines.launch import EngineSpec

_DEVICE = re.compile(r"[a-z][a-z0-9_]*(:\d+)?")  # torch's spelling: "cpu", "cuda", "cuda:1", "mps"
#: agl.compute.precision.PRECISIONS, spelled out so that a spec is made without importing torch
_PRECISIONS = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class AdapterSpec:
    """One LoRA adapter trained on the base model, served under its own endpoint (model) name.

    Args:
        name: the model name agents call the adapter by (distinct from the base's ``"policy"``).
        rank: its LoRA rank (>= 1).
    """

    name: str
    rank: int

    def __post_init__(self) -> None:
        _check_name(self.name, "AdapterSpec.name")
        if self.name == "policy":
            raise ConfigError("AdapterSpec.name 'policy' is the base model's endpoint name: pick another")
        _check_rank(self.rank, "AdapterSpec.rank", minimum=1)


@dataclass(frozen=True)
class TeacherSpec:
    """A second model served alongside the trained one and never updated (e.g. a distillation teacher).

    Either a local folder fit serves with its own built-in engine (``path``), or an OpenAI-compatible
    ``endpoint`` fit puts behind the same gateway; agents call either by ``model`` through the gateway,
    so their calls are recorded like the student's.

    Args:
        path: its local Hugging Face folder (served under the model name ``model``, default ``"teacher"``).
        precision: ``"auto"``, ``"fp32"`` or ``"bf16"`` (see :mod:`agl.compute.precision`).
        engine: what serves ``path`` (``agl.engines.BuiltinEngine``); None: the built-in engine.
        endpoint: an OpenAI-compatible base URL (``https://.../v1``) instead of ``path``.
        model: the model name agents send (the endpoint's own model name with ``endpoint``).
        api_key: sent to ``endpoint`` as a bearer token (never recorded).
    """

    path: str | None = None
    precision: Precision = "auto"
    engine: EngineSpec | None = None
    endpoint: str | None = None
    model: str = "teacher"
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.path is None) == (self.endpoint is None):
            raise ConfigError(
                "TeacherSpec needs exactly one of path (a local model folder) and endpoint (an "
                f"OpenAI-compatible URL), got path={self.path!r}, endpoint={self.endpoint!r}"
            )
        if self.path is not None:
            _check_name(self.path, "TeacherSpec.path")
        if self.endpoint is not None and (
            not isinstance(self.endpoint, str) or not self.endpoint.startswith(("http://", "https://"))
        ):
            raise ConfigError(f"TeacherSpec.endpoint must be an http(s) URL, got {self.endpoint!r}")
        _check_name(self.model, "TeacherSpec.model")
        if self.model == "policy":
            raise ConfigError("TeacherSpec.model 'policy' is the trained model's endpoint name: pick another")
        _check_precision(self.precision, "TeacherSpec.precision")
        from agl.engines.launch import BuiltinEngine, VllmEngine

        if self.engine is not None and not isinstance(self.engine, (BuiltinEngine, VllmEngine)):
            raise ConfigError(
                "TeacherSpec.engine must be agl.engines.BuiltinEngine(...), VllmEngine(...) or None, "
                f"got a {type(self.engine).__name__}"
            )


@dataclass(frozen=True)
class ModelSpec:
    """The model an algorithm trains, as ``Trainer.fit`` must serve it to the agents.

    Args:
        path: the base model's local Hugging Face folder.
        lora_rank: the rank of the LoRA adapter the algorithm pushes (0: it pushes full weights).
        precision: ``"auto"``, ``"fp32"`` or ``"bf16"``: the trained policy's, which the built-in engine
            takes too (unless its options set one), so sampling and training log-probs agree.
        device: where the algorithm trains the model (``"cpu"``, ``"cuda"``, ``"cuda:1"``); the engine's
            placement is ``Trainer(serving=agl.Serving(engine=...))``'s.
        adapters: one LoRA adapter per agent on the shared base: agent name -> :class:`AdapterSpec`
            (each with its own rank, so ``lora_rank`` stays 0). fit serves each under its name, and the
            gateway sends an agent's calls to the policy through its agent endpoint to its adapter.
        teacher: a frozen model fit serves alongside, behind the same gateway (:class:`TeacherSpec`).
    """

    path: str
    lora_rank: int = 0
    precision: Precision = "auto"
    device: str = "cpu"
    adapters: Mapping[str, AdapterSpec] = field(default_factory=dict)
    teacher: TeacherSpec | None = None

    def __post_init__(self) -> None:
        _check_name(self.path, "ModelSpec.path")
        _check_rank(self.lora_rank, "ModelSpec.lora_rank", minimum=0)
        _check_precision(self.precision, "ModelSpec.precision")
        if not isinstance(self.device, str) or not _DEVICE.fullmatch(self.device):
            raise ConfigError(
                f"ModelSpec.device must be a torch device such as 'cpu' or 'cuda:0', got {self.device!r}"
            )
        if self.teacher is not None and not isinstance(self.teacher, TeacherSpec):
            raise ConfigError(
                f"ModelSpec.teacher must be an agl.algorithm.TeacherSpec or None, got a {type(self.teacher).__name__}"
            )
        object.__setattr__(
            self, "adapters", MappingProxyType(_checked_adapters(self.adapters, self.lora_rank))
        )


def _checked_adapters(adapters: object, lora_rank: int) -> dict[str, AdapterSpec]:
    if not isinstance(adapters, Mapping):
        raise ConfigError(
            f"ModelSpec.adapters must map agent names to AdapterSpec(name=..., rank=...), got a {type(adapters).__name__}"
        )
    out: dict[str, AdapterSpec] = {}
    ranks: dict[str, int] = {}
    for agent, adapter in adapters.items():
        _check_name(agent, "ModelSpec.adapters' agent name")
        if not isinstance(adapter, AdapterSpec):
            raise ConfigError(
                f"ModelSpec.adapters[{agent!r}] must be an AdapterSpec(name=..., rank=...), got a {type(adapter).__name__}"
            )
        if ranks.setdefault(adapter.name, adapter.rank) != adapter.rank:  # agents sharing one adapter
            raise ConfigError(
                f"ModelSpec.adapters names adapter {adapter.name!r} with ranks {ranks[adapter.name]} and "
                f"{adapter.rank}: agents that share an adapter share its rank"
            )
        out[agent] = adapter
    if out and lora_rank:
        raise ConfigError(
            f"ModelSpec(adapters=..., lora_rank={lora_rank}): with adapters per agent each AdapterSpec has its "
            "own rank; leave lora_rank at 0"
        )
    return out


def _check_name(value: object, what: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{what} must be a non-empty string, got {value!r}")


def _check_rank(value: object, what: str, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{what} must be an integer >= {minimum}, got {value!r}")


def _check_precision(value: object, what: str) -> None:
    if value not in _PRECISIONS:
        raise ConfigError(f"{what} must be one of {list(_PRECISIONS)}, got {value!r}")


__all__ = ["AdapterSpec", "ModelSpec", "TeacherSpec"]
