"""GRPO's settings: every field has a default, cross-field checks run on construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agl.algorithm.grpo.advantages import BASELINES, Baseline, StdScale, std_scale
from agl.algorithm.grpo.warm_start import WarmStart
from agl.algorithm.memory import check_settings
from agl.algorithm.policy.loss import LossConfig
from agl.algorithm.precision import Precision, check_precision
from agl.algorithm.teacher import Teacher
from agl.errors import ConfigError


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO's knobs; every field has a default, cross-field checks run on construction."""

    model_path: str
    steps: int = 20
    tasks_per_step: int = 4
    group_size: int = 8
    lr: float = 1e-5
    max_grad_norm: float = 1.0
    # memory: "auto" sizes micro-batches to memory_budget_gb (None: a share of the free RAM or VRAM) and
    # recomputes activations in backward on CPU, where it is no slower (agl/algorithm/memory.py)
    micro_batch_tokens: int | Literal["auto"] = "auto"
    activation_checkpointing: bool | Literal["auto"] = "auto"
    memory_budget_gb: float | None = None
    # "auto": the policy's and the built-in engine's matmuls in bf16 on a CPU with native bf16 (2x faster
    # steps there), else fp32; "fp32" or "bf16" to choose (agl/algorithm/precision.py)
    precision: Precision = "auto"
    # run a prompt prefix that several samples share (a group's prompt, a system prompt) once per
    # micro-batch: same gradient, fewer tokens computed (agl/algorithm/policy/prefix.py)
    share_prefixes: bool = True
    lora_rank: int = 0
    # divide advantages by the reward std of each group (True or "group": GRPO), of the step's whole batch
    # ("batch": group mean, batch std), or not at all (False or "none": Dr. GRPO)
    scale_by_std: bool | StdScale = True
    # "batch": each rollout's reward minus the mean of the batch's other rewards (RLOO over the batch, per
    # agent), so groups of one (group_size=1) train; "group": minus its group's mean (GRPO)
    baseline: Baseline = "group"
    level: Literal["trajectory", "transition"] = "trajectory"
    max_sample_tokens: int = 2048
    agent: str | None = None  # train only this agent's calls (agl.agent_scope, agent endpoint, or span name)
    credit: Literal["final", "per_call"] = "final"  # per_call: emit_reward(response_id=...) shapes its call
    call_reward_weight: float = 1.0  # per_call: a call's return = final reward + weight * its own reward
    # SFT before the first GRPO step: on known-good conversations (WarmStart), or on a stronger model's
    # best rollouts of the train tasks (agl.Teacher, which fit serves beside the policy)
    warm_start: WarmStart | Teacher | None = None
    loss: LossConfig = field(default_factory=LossConfig)
    kl_coef: float = 0.0
    eval_every: int = 5
    rollout_timeout_s: float = 600.0
    checkpoint_every: int = 0
    resume: bool = False  # continue from the newest checkpoint under the output dir (full fine-tuning)
    # the final policy as a Hugging Face folder in OUT/model (LoRA merged), the best-validation one in
    # OUT/model-best; export_adapter also keeps a LoRA run's bare adapter in OUT/model-adapter
    export_model: bool = True
    export_adapter: bool = False
    seed: int = 0
    # async: rollouts of the next max_staleness steps run while a step trains (off-policy by at most
    # max_staleness weight versions; the loss's ratio is against the engine's logprobs). Sync ignores it.
    async_rollouts: bool = False
    max_staleness: int = 1
    world_size: int = 1  # > 1: data-parallel policy steps over torch.distributed (policy/distributed.py)
    # "fsdp": the world_size ranks shard parameters, gradients and optimizer state with FSDP2 (bf16
    # compute on CUDA) instead of each holding the full model (agl/algorithm/sharding.py)
    sharding: Literal["none", "fsdp"] = "none"
    device: str = "cpu"  # where the policy trains ("cuda" for a GPU); the engine's is Serving(engine=BuiltinEngine(...))
    # every rollout of the baseline evaluation or the first step failed: stop with the first error
    stop_on_all_failed: bool = True

    def __post_init__(self) -> None:
        check_settings(self.micro_batch_tokens, self.memory_budget_gb)
        check_precision(self.precision, "GRPOConfig.precision")
        scale = std_scale(self.scale_by_std)
        if self.baseline not in BASELINES:
            raise ConfigError(f"baseline must be 'group' or 'batch', got {self.baseline!r}")
        if self.baseline == "batch" and scale == "group":
            raise ConfigError(
                "baseline='batch' compares each rollout with the whole batch, not its group: "
                "set scale_by_std='batch' (the batch's reward std) or 'none' (RLOO's plain difference)"
            )
        if self.group_size < 1 or (self.group_size < 2 and self.baseline == "group"):
            raise ConfigError(
                f"group_size must be >= 2 for group-relative advantages, got {self.group_size} "
                "(baseline='batch' trains groups of one)"
            )
        if self.steps < 0 or self.tasks_per_step < 1:
            raise ConfigError(
                f"steps >= 0 and tasks_per_step >= 1 needed, got {self.steps}, {self.tasks_per_step}"
            )
        if self.max_staleness < 0 or self.world_size < 1:
            raise ConfigError(
                f"max_staleness >= 0 and world_size >= 1 needed, got {self.max_staleness}, {self.world_size}"
            )
        if self.sharding not in ("none", "fsdp"):
            raise ConfigError(f"GRPOConfig(sharding=...) must be 'none' or 'fsdp', got {self.sharding!r}")
        if self.sharding == "fsdp" and self.world_size < 2:
            raise ConfigError(
                f'GRPOConfig(sharding="fsdp") shards over ranks: set world_size >= 2, got {self.world_size}'
            )
        if self.credit not in ("final", "per_call"):
            raise ConfigError(f"credit must be 'final' or 'per_call', got {self.credit!r}")
        if self.warm_start is not None and not isinstance(self.warm_start, WarmStart | Teacher):
            raise ConfigError(
                "GRPOConfig.warm_start must be an agl.WarmStart(...), an agl.Teacher(...) or None, "
                f"got a {type(self.warm_start).__name__}"
            )
        if self.kl_coef > 0 and self.loss.kl_coef == 0:
            object.__setattr__(self, "loss", LossConfig(**{**self.loss.__dict__, "kl_coef": self.kl_coef}))


__all__ = ["GRPOConfig"]
