"""GRPO's settings: every field has a default, cross-field checks run on construction."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from agl.algorithm.grpo.advantages import BASELINES, Baseline, StdScale, std_scale
from agl.algorithm.grpo.warm_start import WarmStart
from agl.algorithm.policy.loss import LossConfig
from agl.algorithm.teacher import Teacher
from agl.compute.memory import check_settings
from agl.compute.precision import Precision, check_precision
from agl.errors import ConfigError
from agl.failures import FAILURE_CLASSES, FailureClass
from agl.rewards.judge import Judge

#: what a step does with a rollout that yielded no reward (README "Failure classes")
OnFailure = Literal["resample", "drop_group", "train_survivors", "zero"]
ON_FAILURE_CHOICES: tuple[OnFailure, ...] = get_args(OnFailure)
#: a broken reward never trains; an agent's exception may be the model's doing, so it trains as 0
DEFAULT_ON_FAILURE: Mapping[FailureClass, OnFailure] = {
    "infra": "resample",
    "agent": "zero",
    "reward": "drop_group",
}


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
    # recomputes activations in backward on CPU, where it is no slower (agl/compute/memory.py)
    micro_batch_tokens: int | Literal["auto"] = "auto"
    activation_checkpointing: bool | Literal["auto"] = "auto"
    memory_budget_gb: float | None = None
    # "auto": the policy's and the built-in engine's matmuls in bf16 on a CPU with native bf16 (as high after
    # GRPO, less CPU; a warm start served in bf16 scores lower), else fp32 (agl/compute/precision.py)
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
    # which agents' calls train (agl.agent_scope, agent endpoint, or span name): () every call, one policy;
    # ("solver",) only the solver's calls; ("solver", "checker") one LoRA adapter per agent on one base
    # model (lora_rank each), each served under its agent's endpoint and trained on its own calls only
    agents: tuple[str, ...] = ()
    credit: Literal["final", "per_call"] = "final"  # per_call: emit_reward(response_id=...) shapes its call
    call_reward_weight: float = 1.0  # per_call: a call's return = final reward + weight * its own reward
    # scores the rollouts that return no reward, a group per call (agl.rewards.Judge, agl/algorithm/grpo/judging.py)
    judge: Judge | None = None
    # SFT before the first GRPO step: on known-good conversations (WarmStart), or on a stronger model's
    # best rollouts of the train tasks (agl.Teacher, which fit serves beside the policy)
    warm_start: WarmStart | Teacher | None = None
    loss: LossConfig = field(default_factory=LossConfig)
    kl_coef: float = 0.0
    # on-policy distillation: a teacher sharing the student's tokenizer scores the student's sampled
    # tokens, a local folder (agl.Teacher(path=...)) in the trainer or an endpoint answering
    # prompt_logprobs (vLLM, agl engine serve: agl.Teacher(url, model=...)) before each update; each
    # token's advantage gets -distill_coef times log pi_student(t) - log pi_teacher(t), so groups whose
    # rewards tie train too (policy/loss.py, policy/distill.py)
    teacher: Teacher | None = None
    distill_coef: float = 1.0
    eval_every: int = 5
    rollout_timeout_s: float = 600.0
    checkpoint_every: int = 0
    resume: bool = False  # continue from the newest checkpoint under the output dir (full fine-tuning)
    # the final policy as a Hugging Face folder in OUT/model (LoRA merged), the best-validation one in
    # OUT/model-best; export_adapter also keeps a LoRA run's bare adapter in OUT/model-adapter
    export_model: bool = True
    export_adapter: bool = False
    seed: int = 0
    # True: a seed reproduces a run's samples and rewards on one machine: every rollout's model calls sample
    # from seeds derived from (seed, step, task, sample), batches keep enqueue order, Python/NumPy/torch are
    # seeded. The weights then still differ in their last bits, as the engine's logprobs do with what it
    # batched beside each call; "exact" (sync only) takes the loss's ratio against the trainer's own
    # logprobs instead (on-policy, no engine/trainer mismatch correction) for bit-identical weights
    deterministic: bool | Literal["exact"] = True
    # async: rollouts of the next max_staleness steps run while a step trains (off-policy by at most
    # max_staleness weight versions; the loss's ratio is against the engine's logprobs). Sync ignores it.
    async_rollouts: bool = False
    max_staleness: int = 1
    world_size: int = 1  # > 1: data-parallel policy steps over torch.distributed (policy/distributed.py)
    # "fsdp": the world_size ranks shard parameters, gradients and optimizer state with FSDP2 (bf16
    # compute on CUDA) instead of each holding the full model (agl/algorithm/policy/sharding.py)
    sharding: Literal["none", "fsdp"] = "none"
    device: str = "cpu"  # where the policy trains ("cuda" for a GPU); the engine's is Serving(engine=BuiltinEngine(...))
    # every rollout of the baseline evaluation or the first step failed: stop with the first error
    stop_on_all_failed: bool = True
    # per failure class (agl/failures.py), what a step does with a rollout that yielded no reward:
    # "resample" (again in its group under the same resources version, up to max_resamples times,
    # then the group is dropped), "drop_group", "train_survivors" (the rest of the group, when at
    # least 2 remain) or "zero" (trains with reward 0); merged over DEFAULT_ON_FAILURE
    on_failure: Mapping[FailureClass, OnFailure] = field(default_factory=dict)
    max_resamples: int = 2
    # dynamic sampling (DAPO's filter_groups): groups whose rewards all tie are set aside and more tasks
    # are drawn until the step holds tasks_per_step groups with signal, or refill_max_rollouts extra
    # rollouts ran (None: twice the step's tasks_per_step * group_size); synchronous runs only (grpo/refill.py)
    refill: bool = False
    refill_max_rollouts: int | None = None
    # reasoning models: False takes each completion's thinking (<think> through </think>, both included) out
    # of the loss; only the answer trains. The tags' ids come from the policy's tokenizer when GRPO loads it,
    # unless think_token_ids gives them as (open_id, close_id) (agl/adapter/thinking.py)
    train_thinking: bool = True
    think_token_ids: tuple[int, int] | None = None

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
        if self.deterministic not in (True, False, "exact"):
            raise ConfigError(f"deterministic must be True, False or 'exact', got {self.deterministic!r}")
        if self.deterministic == "exact" and self.async_rollouts:
            raise ConfigError(
                'GRPOConfig(deterministic="exact") trains on-policy; async rollouts need the engine\'s '
                "logprobs for their staleness: set deterministic=True or async_rollouts=False"
            )
        if self.credit not in ("final", "per_call"):
            raise ConfigError(f"credit must be 'final' or 'per_call', got {self.credit!r}")
        object.__setattr__(self, "on_failure", check_on_failure(self.on_failure))
        if self.max_resamples < 0:
            raise ConfigError(f"GRPOConfig.max_resamples must be >= 0, got {self.max_resamples}")
        if self.judge is not None and not isinstance(self.judge, Judge):
            raise ConfigError(
                f"GRPOConfig(judge=...) must be an agl.rewards.Judge, got {type(self.judge).__name__}"
            )
        if self.warm_start is not None and not isinstance(self.warm_start, WarmStart | Teacher):
            raise ConfigError(
                "GRPOConfig.warm_start must be an agl.WarmStart(...), an agl.Teacher(...) or None, "
                f"got a {type(self.warm_start).__name__}"
            )
        self._check_agents()
        self._check_refill()
        self._check_teacher()
        self._check_thinking()
        if self.kl_coef > 0 and self.loss.kl_coef == 0:
            object.__setattr__(self, "loss", LossConfig(**{**self.loss.__dict__, "kl_coef": self.kl_coef}))

    def _check_teacher(self) -> None:
        """The distillation teacher is an ``agl.Teacher`` and ``distill_coef`` > 0; the loss gets the
        coefficient with a teacher and 0 without one (GRPOConfig owns ``LossConfig.distill_coef``)."""
        teacher = self.teacher
        coef = self.distill_coef if teacher is not None else 0.0
        if self.loss.distill_coef != coef:
            object.__setattr__(self, "loss", LossConfig(**{**self.loss.__dict__, "distill_coef": coef}))
        if teacher is None:
            return
        if not isinstance(teacher, Teacher):
            raise ConfigError(
                f"GRPOConfig.teacher must be an agl.Teacher(path=... or an endpoint) or None, got a {type(teacher).__name__}"
            )
        if isinstance(self.distill_coef, bool) or not self.distill_coef > 0:
            raise ConfigError(
                f"GRPOConfig.distill_coef must be > 0 with a teacher, got {self.distill_coef!r}"
            )

    def _check_agents(self) -> None:
        """``agents`` is a tuple of distinct names; several need LoRA (one adapter each) on one rank."""
        agents = self.agents
        if isinstance(agents, str) or not isinstance(agents, tuple | list):
            raise ConfigError(
                f"GRPOConfig.agents must be a tuple of agent names such as ('solver',) (in a run file "
                f"[solver, checker]), got {agents!r}"
            )
        if not all(isinstance(a, str) and a.strip() and "/" not in a for a in agents):
            raise ConfigError(
                f"GRPOConfig.agents must hold non-empty agent names without '/', got {agents!r}"
            )
        if len(set(agents)) != len(agents):
            raise ConfigError(f"GRPOConfig.agents names an agent twice: {agents!r}")
        object.__setattr__(self, "agents", tuple(agents))
        if len(agents) < 2:
            return
        if any("." in a or a == "policy" for a in agents):
            raise ConfigError(
                "GRPOConfig.agents with several agents names their LoRA adapters too, which cannot hold '.' "
                f"nor be 'policy' (the base model's name): {agents!r}"
            )
        if self.lora_rank < 1:
            raise ConfigError(
                f"GRPOConfig(agents={tuple(agents)!r}) trains one LoRA adapter per agent: set lora_rank > 0 "
                "(e.g. 16), or name one agent"
            )
        if self.world_size > 1:
            raise ConfigError("GRPOConfig.agents with several agents trains on one rank: set world_size=1")
        if isinstance(self.warm_start, Teacher):
            raise ConfigError(
                "GRPOConfig.agents with several agents takes a WarmStart (it trains the first agent's "
                "adapter), not a Teacher warm start"
            )

    def _check_thinking(self) -> None:
        if not isinstance(self.train_thinking, bool):
            raise ConfigError(f"GRPOConfig.train_thinking must be True or False, got {self.train_thinking!r}")
        ids = self.think_token_ids
        if ids is None:
            return
        if (
            not isinstance(ids, tuple | list)
            or len(ids) != 2
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
            or ids[0] == ids[1]
        ):
            raise ConfigError(
                "GRPOConfig.think_token_ids must be (open_id, close_id), two different token ids of "
                f"<think> and </think>, or None to read them from the tokenizer; got {ids!r}"
            )
        object.__setattr__(self, "think_token_ids", (int(ids[0]), int(ids[1])))

    def _check_refill(self) -> None:
        cap = self.refill_max_rollouts
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise ConfigError(f"GRPOConfig.refill_max_rollouts must be None or an int >= 0, got {cap!r}")
        if not self.refill:
            return
        if self.async_rollouts:
            raise ConfigError(
                "GRPOConfig(refill=True) tops a step up with rollouts of the policy that trains on them; "
                "async rollouts run ahead of it: set async_rollouts=False or refill=False"
            )
        if self.baseline == "batch":
            raise ConfigError(
                "GRPOConfig(refill=True) refills groups whose rewards tie; baseline='batch' compares the "
                "whole batch, not groups: set baseline='group' or refill=False"
            )


def check_on_failure(on_failure: Mapping[Any, Any]) -> dict[FailureClass, OnFailure]:
    """``on_failure`` merged over :data:`DEFAULT_ON_FAILURE`; a ConfigError names a bad key or value."""
    if not isinstance(on_failure, Mapping):
        raise ConfigError(
            f"GRPOConfig.on_failure must be a mapping of failure class to action, e.g. "
            f'{{"infra": "drop_group"}}, got {type(on_failure).__name__}'
        )
    merged: dict[FailureClass, OnFailure] = dict(DEFAULT_ON_FAILURE)
    for key, value in on_failure.items():
        if key not in FAILURE_CLASSES:
            raise ConfigError(
                f"GRPOConfig.on_failure has an unknown failure class {key!r}; use {', '.join(FAILURE_CLASSES)}"
            )
        if value not in ON_FAILURE_CHOICES:
            raise ConfigError(
                f"GRPOConfig.on_failure[{key!r}] = {value!r} is not an action; use "
                f"{', '.join(ON_FAILURE_CHOICES)}"
            )
        if key == "reward" and value == "zero":
            raise ConfigError(
                'GRPOConfig.on_failure["reward"] cannot be "zero": a reward that failed must not train; '
                'use "drop_group", "train_survivors" or "resample"'
            )
        merged[key] = value  # type: ignore[index, assignment]  # both checked just above
    return merged


__all__ = ["DEFAULT_ON_FAILURE", "GRPOConfig", "OnFailure", "check_on_failure"]
