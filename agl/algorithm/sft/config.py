"""SFT's settings, and the time bounds that select rollouts already in a store."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Literal

from agl.algorithm.teacher import Teacher
from agl.compute.memory import check_settings
from agl.compute.precision import Precision, check_precision
from agl.errors import ConfigError

if TYPE_CHECKING:
    from agl.store.base import LightningStore

TimeBound = float | int | str | datetime | None


def parse_time(value: TimeBound, name: str) -> float | None:
    """A time bound as Unix seconds: a number, a ``datetime`` (naive = local time) or an ISO 8601 string."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be Unix seconds, a datetime or an ISO 8601 string, got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite time, got {value!r}")
        return float(value)
    if isinstance(value, datetime):
        return value.timestamp()
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
        try:
            return datetime.fromisoformat(value).timestamp()
        except ValueError:
            raise ConfigError(
                f"{name}={value!r} is no time: use Unix seconds or ISO 8601 (e.g. 2026-12-01T09:00:00+00:00)"
            ) from None
    raise ConfigError(
        f"{name} must be Unix seconds, a datetime or an ISO 8601 string, got {type(value).__name__}"
    )


@dataclass(frozen=True)
class SFTConfig:
    model_path: str
    iterations: int = 2
    samples_per_task: int = 4
    tasks_per_iteration: int = 16
    min_reward: float | None = 1.0
    top_k_per_task: int | None = 1
    epochs: int = 1
    batch_size: int = 8
    lr: float = 1e-5
    lora_rank: int = 0
    micro_batch_tokens: int | Literal["auto"] = "auto"  # "auto": the largest that fits memory_budget_gb
    activation_checkpointing: bool | Literal["auto"] = "auto"  # "auto": on for CPU, where it is no slower
    memory_budget_gb: float | None = None  # None: a share of the RAM (or VRAM) this process could have
    # fp32: SFT's small updates fall below a bf16 weight's rounding step, so the model served in bf16 loses
    # most of them (benchmarks/serving_precision.py); "auto" (bf16 on a CPU with native bf16) or "bf16" is
    # faster and trains the same fp32 weights (agl/compute/precision.py)
    precision: Precision = "fp32"
    # run a prompt prefix that several samples share (a group's prompt, a system prompt) once per
    # micro-batch: same gradient, fewer tokens computed (agl/algorithm/policy/prefix.py)
    share_prefixes: bool = True
    export_jsonl: bool = True  # each iteration's kept conversations (with the agent's tools) as OpenAI JSONL
    # a stronger model's best rollouts of the train tasks train the student first (agl.Teacher; fit serves
    # it beside the policy); its held-out score is result["phases"]["teacher"]
    teacher: Teacher | None = None
    # offline: train `epochs` passes on succeeded rollouts already in this store (a URL for open_store, or a
    # LightningStore) instead of generating any; chosen by min_reward/top_k_per_task, agent and finish time
    from_store: str | LightningStore | None = None
    # only rollouts of these modes, e.g. ("online",): the production conversations `agl gateway serve
    # --record-unattributed` recorded; None: every mode but a teacher's
    from_modes: tuple[str, ...] | None = None
    agent: str | None = None  # only this agent's calls (agl.agent_scope name, agent endpoint or span name)
    since: TimeBound = None  # finished at or after: Unix seconds, datetime or ISO 8601 (from_store only)
    until: TimeBound = None  # finished at or before
    # the final policy as a Hugging Face folder in OUT/model (LoRA merged), the best-validation one in
    # OUT/model-best; export_adapter also keeps a LoRA run's bare adapter in OUT/model-adapter
    export_model: bool = True
    export_adapter: bool = False
    # > 1: the policy trains on world_size ranks (spawned processes, or torchrun: see
    # agl.algorithm.policy.distributed); SFT over ranks shards with FSDP2, so sharding="fsdp" is required
    world_size: int = 1
    sharding: Literal["none", "fsdp"] = "none"
    # a progress bar and a console line per step (metrics.csv and curve.png are always written)
    progress: bool = True
    rollout_timeout_s: float = 600.0
    # every rollout of the baseline evaluation or the first iteration failed: stop with the first error
    stop_on_all_failed: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        check_settings(self.micro_batch_tokens, self.memory_budget_gb)
        check_precision(self.precision, "SFTConfig.precision")
        if self.iterations < 1 or self.samples_per_task < 1 or self.batch_size < 1:
            raise ConfigError("SFTConfig needs iterations, samples_per_task and batch_size >= 1")
        if self.epochs < 1:
            raise ConfigError(f"SFTConfig needs epochs >= 1, got {self.epochs}")
        if self.sharding not in ("none", "fsdp"):
            raise ConfigError(f"SFTConfig(sharding=...) must be 'none' or 'fsdp', got {self.sharding!r}")
        if self.world_size < 1 or (self.sharding == "fsdp") != (self.world_size > 1):
            raise ConfigError(
                f"SFTConfig(world_size={self.world_size}, sharding={self.sharding!r}): SFT over ranks shards "
                "with FSDP2, so set world_size >= 2 with sharding=\"fsdp\", or world_size=1 with sharding='none'"
            )
        if self.teacher is not None and not isinstance(self.teacher, Teacher):
            raise ConfigError(
                f"SFTConfig.teacher must be an agl.Teacher(...) or None, got a {type(self.teacher).__name__}"
            )
        if self.teacher is not None and self.from_store is not None:
            raise ConfigError(
                "SFTConfig(teacher=...) runs the teacher on train tasks: it does not go with from_store"
            )
        self._check_modes()
        since, until = parse_time(self.since, "since"), parse_time(self.until, "until")
        if since is not None and until is not None and since > until:
            raise ConfigError(f"since ({self.since!r}) is after until ({self.until!r}): no rollout can match")
        if (since is not None or until is not None) and self.from_store is None:
            raise ConfigError("since/until select rollouts already in a store: set from_store too")

    def _check_modes(self) -> None:
        """``from_modes``: a non-empty list of mode names (a YAML list becomes a tuple), with ``from_store``."""
        modes = self.from_modes
        if modes is None:
            return
        if isinstance(modes, str) or not all(isinstance(m, str) and m for m in modes) or not modes:
            raise ConfigError(
                f"SFTConfig.from_modes must be a list of rollout modes such as ['online'], got {modes!r}"
            )
        if self.from_store is None:
            raise ConfigError("SFTConfig.from_modes selects rollouts already in a store: set from_store too")
        object.__setattr__(self, "from_modes", tuple(modes))


__all__ = ["SFTConfig", "TimeBound", "parse_time"]
