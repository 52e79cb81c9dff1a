"""The trainer-side policy of GRPO and SFT: a HF causal LM (full or LoRA), its log-probs, and one optimizer step.

Micro-batches are cut by a token limit; each adds its share of the batch loss (aggregation weights
are computed over the whole batch), so accumulation gives the same gradient as one big batch. The
limit is sized to a memory budget (:mod:`agl.compute.memory`): a micro-batch whose peak goes over it
restarts the step's accumulation with smaller micro-batches, which changes nothing in the gradient. Under
torch.distributed each rank backpropagates its shard of the samples and the gradients are summed
(:mod:`agl.algorithm.policy.distributed`), which gives the same gradient again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agl.adapter.trajectory import Sample
from agl.algorithm.policy import collective
from agl.algorithm.policy.logprobs import token_logprobs
from agl.algorithm.policy.loss import LossConfig, grpo_loss, token_weights
from agl.algorithm.policy.prefix import PrefixRows, SharedPrefixes, shares
from agl.compute.memory import (
    GB,
    Checkpointing,
    MicroBatchSizer,
    MicroBatchTokens,
    checkpointing_for,
    hold_freed_memory,
    limit_arenas,
    plain_tokens_for,
    release_free_memory,
    shared_monitor,
)
from agl.compute.precision import Precision, autocast, resolve_precision
from agl.errors import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicyConfig:
    model_path: str
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_tokens: MicroBatchTokens = "auto"  # "auto": the largest that fits memory_budget_gb
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: int = 32
    # one LoRA adapter (lora_rank each) per name on the one base model; use_adapter(name) picks the one a
    # step trains, each with its own optimizer state (empty: one adapter, or full fine-tuning)
    adapters: tuple[str, ...] = ()
    kl_coef: float = 0.0
    # a local model folder sharing the tokenizer: scores the samples' tokens for on-policy distillation
    # (LossConfig.distill_coef; agl/algorithm/policy/distill.py)
    teacher_path: str | None = None
    # the samples carry an endpoint teacher's log-probs (Sample.teacher_logprobs) to distill from
    teacher_scored: bool = False
    # "auto": on CPU, micro-batches over 1,024 tokens (memory.PLAIN_CPU_TOKENS); off on CUDA
    activation_checkpointing: Checkpointing = "auto"
    seed: int = 0
    device: str = "cpu"  # "cuda" trains on the GPU
    memory_budget_gb: float | None = None  # None: a fraction of the RAM (or VRAM) this process could have
    # "auto": bf16 autocast on a CPU with native bf16, else fp32 (agl/compute/precision.py)
    precision: Precision = "auto"
    # run a prompt prefix that several samples share once per micro-batch (agl/algorithm/policy/prefix.py)
    share_prefixes: bool = True


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T)
    attention: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T-1), loss mask of predicted tokens
    old_logprobs: torch.Tensor  # (B, T-1)
    advantages: torch.Tensor  # (B,), or (B, T-1) per token
    rollout_index: torch.Tensor  # (B,)
    has_old: torch.Tensor  # (B,) whether the engine's logprobs came with the sample
    teacher_logprobs: torch.Tensor  # (B, T-1) an endpoint teacher's, scored before the step (0: none)

    def to(self, device: torch.device | str) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


def collate(
    samples: Sequence[Sample], advantages: Sequence[float], rollout_index: Sequence[int], pad_id: int
) -> Batch:
    """Right-padded tensors; position t of mask/old_logprobs describes token t+1 (what logits[t] predict)."""
    if not samples:
        raise ConfigError(
            "a training batch needs at least one sample, got none; skip the step when build_batch "
            "returns no samples (e.g. every group had the same reward)"
        )
    width = max(len(s.input_ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.float32)
    old = torch.zeros((len(samples), width), dtype=torch.float32)
    teacher = torch.zeros((len(samples), width), dtype=torch.float32)
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.old_logprobs is not None:
            old[i, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
        if s.teacher_logprobs is not None:
            teacher[i, :n] = torch.tensor(s.teacher_logprobs, dtype=torch.float32)
    adv = torch.tensor(list(advantages), dtype=torch.float32)  # (B,)
    if any(s.token_advantages is not None for s in samples):  # per-call credit: (B, T-1)
        per_token = adv.unsqueeze(-1).repeat(1, width)
        for i, s in enumerate(samples):
            if s.token_advantages is not None:
                per_token[i, : len(s.input_ids)] = torch.tensor(s.token_advantages, dtype=torch.float32)
        adv = per_token[:, 1:]
    return Batch(
        ids,
        attention,
        mask[:, 1:],
        old[:, 1:],
        adv,
        torch.tensor(list(rollout_index), dtype=torch.long),
        torch.tensor([s.old_logprobs is not None for s in samples]),
        teacher[:, 1:],
    )


@contextlib.contextmanager
def checkpointing_paused(model: Any, pause: bool) -> Iterator[None]:
    """With ``pause``, run the block without the activation checkpointing enabled on ``model``'s layers."""
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)] if pause else []
    for layer in layers:
        layer.gradient_checkpointing = False
    try:
        yield
    finally:
        for layer in layers:
            layer.gradient_checkpointing = True


# at a few dozen positions PyTorch's CPU flash-attention backward costs more than plain products do
# (SmolLM2: a step ran faster with short rows, slower past a few hundred tokens)
EAGER_ATTENTION_MAX_LEN = 128


@contextlib.contextmanager
def short_rows_attention(model: Any, eager: bool) -> Iterator[None]:
    """With ``eager``, run the block with plain (eager) attention instead of SDPA, where ``model`` allows it."""
    switch = eager and getattr(model.config, "_attn_implementation", None) == "sdpa"
    if not switch or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation("sdpa")


def enable_activation_checkpointing(model: Any) -> None:
    """Recompute each layer's activations in the backward pass instead of keeping them."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5
    if enable is not None:
        enable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, normalizer: float | None = None) -> torch.Tensor:
    """Masked NLL: -(sum of log-probs of model tokens) / normalizer (default: their count). (B, T-1) inputs."""
    norm = mask.sum().clamp(min=1) if normalizer is None else normalizer
    return -(logprobs * mask).sum() / norm


class Policy:
    """The model being trained, its optimizer, (with KL) a frozen reference copy and (distilling) a frozen
    teacher."""

    def __init__(self, config: PolicyConfig, loss: LossConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        limit_arenas()  # before the model's weights and the worker threads allocate
        torch.manual_seed(config.seed)
        self.config, self.loss_config = config, loss
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            config.model_path, local_files_only=True, dtype=torch.float32
        )
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            hold_freed_memory()  # each step reuses the last one's pages instead of faulting in new ones
        self.precision = resolve_precision(config.precision, self.device)
        self.data_parallel = False  # set by agl.algorithm.policy.distributed on every rank of a group
        model.to(self.device)  # type: ignore[arg-type]
        if checkpointing_for(config.activation_checkpointing, self.device):
            enable_activation_checkpointing(model)
        self.reference = None
        if config.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(
                config.model_path, local_files_only=True, dtype=torch.float32
            ).eval()
            self.reference.to(self.device)  # type: ignore[arg-type]
        self.teacher = None
        if config.teacher_path is not None:
            from agl.algorithm.policy.distill import load_teacher

            self.teacher = load_teacher(config.teacher_path, self.tokenizer, self.device)
        if config.adapters and config.lora_rank < 1:
            raise ConfigError(f"PolicyConfig.adapters {config.adapters} are LoRA adapters: set lora_rank > 0")
        if config.lora_rank > 0:
            model = with_lora(model, config.lora_rank, config.lora_alpha, config.adapters)
        self.model = model
        self.model.train()
        # one optimizer per adapter: each adapter's moments move only with its own steps
        self.optimizers = {name: self._optimizer(adapter_parameters(model, name)) for name in config.adapters}
        self.adapter: str | None = None
        if config.adapters:
            self.use_adapter(config.adapters[0])
        else:
            self.optimizer = self._optimizer([p for p in self.model.parameters() if p.requires_grad])
        self.plain_tokens = plain_tokens_for(config.activation_checkpointing, self.device)
        self.checkpointing = checkpointing_for(config.activation_checkpointing, self.device)
        # prefix sharing needs plain forward passes: off when every micro-batch is checkpointed
        self.share_prefixes = (
            config.share_prefixes and shares(model) and (self.plain_tokens > 0 or not self.checkpointing)
        )
        self.prefixes = SharedPrefixes.none(0)  # the current step's, set by accumulate and sft_step
        self._computed_tokens = 0  # positions the last backprop pass that counted ran (computed_tokens)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)
        self.sizer = MicroBatchSizer(config.micro_batch_tokens, self.device, config.memory_budget_gb)
        self.monitor = shared_monitor()
        self._update_peak = 0

    def _optimizer(self, params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
        # fused: one kernel over all tensors (a CPU AdamW step for SmolLM2 much faster)
        config = self.config
        return torch.optim.AdamW(
            params, lr=config.lr, weight_decay=config.weight_decay, fused=_fusable(params)
        )

    def use_adapter(self, name: str) -> None:
        """Make adapter ``name`` (of ``PolicyConfig.adapters``) the one forward passes use and steps train."""
        if name not in self.optimizers:
            raise ConfigError(
                f"this policy has no adapter {name!r}; its adapters: {', '.join(self.optimizers)}"
            )
        self.model.set_adapter(name)  # type: ignore[operator]  # PEFT: only this adapter requires grad
        self.optimizer, self.adapter = self.optimizers[name], name

    @contextlib.contextmanager
    def _memory_mode(self, tokens: int) -> Iterator[bool]:
        """A micro-batch of ``tokens`` runs whole when small enough (see ``plain_tokens_for``); yields
        whether the log-prob head should still recompute its chunks in the backward pass."""
        plain = tokens <= self.plain_tokens
        with checkpointing_paused(self.model, plain):
            yield not plain

    def find_prefixes(self, samples: Sequence[Sample]) -> SharedPrefixes:
        """The shared prompt prefixes of a step's samples (none when this policy does not share them)."""
        return SharedPrefixes.find(samples) if self.share_prefixes else SharedPrefixes.none(len(samples))

    def _limit(self, prefixes: SharedPrefixes) -> int:
        """The micro-batch token limit; with shared prefixes, at most what runs without checkpointing
        (a checkpointed micro-batch cannot share: its replayed layers would write the cache twice)."""
        if self.checkpointing and any(prefixes.length):
            return min(self.sizer.limit, self.plain_tokens)
        return self.sizer.limit

    def micro_batches(self, samples: Sequence[Sample], limit: int | None = None) -> list[list[int]]:
        """Sample indices grouped so each group's computed size stays within ``limit`` tokens (default:
        the current micro-batch limit): families of a shared prefix together, shortest first, and a
        sample longer than the limit alone."""
        lengths = [len(s.input_ids) for s in samples]
        prefixes = self.find_prefixes(samples)
        order = prefixes.order(range(len(samples)), lengths)
        groups: list[list[int]] = []
        while order:
            groups.append(
                _next_group(order, lambda g: prefixes.cost(g, lengths), limit or self._limit(prefixes))
            )
            order = order[len(groups[-1]) :]
        return groups

    def _shared_rows(self, group: Sequence[int], lengths: Sequence[int]) -> tuple[int, PrefixRows | None]:
        """A micro-batch's computed tokens and its shared prefixes (None: it runs whole samples)."""
        rows = self.prefixes.rows(group)
        tokens = self.prefixes.cost(group, lengths) if rows is not None else 0
        if rows is None or (self.checkpointing and tokens > self.plain_tokens):
            return padded_tokens(lengths)(group), None
        return tokens, rows

    def _backprop(
        self,
        samples: Sequence[Sample],
        mine: Sequence[int],
        work: Callable[[list[int]], None],
        restart: Callable[[], None],
    ) -> None:
        """Run ``work`` (forward and backward of one micro-batch) over ``mine``, micro-batch by micro-batch,
        within the memory budget; on a micro-batch over it, zero the gradient, ``restart`` the sums and
        go again with smaller micro-batches."""
        lengths = [len(s.input_ids) for s in samples]
        cuda = self.device.type == "cuda"
        # on CPU freed memory is held for the next step (hold_freed_memory): trim only where the sizer
        # needs the true footprint, i.e. before its first reading and after a back-off
        trim = cuda or not self.sizer.bytes_per_token
        while True:
            if trim:
                release_free_memory()
            base = torch.cuda.memory_allocated(self.device) if cuda else self.monitor.sample()
            if not trim and base > self.sizer.budget():  # perhaps only memory held free: look again
                release_free_memory()
                base = self.monitor.sample()
            self.sizer.check_base(base)
            order = self.prefixes.order(mine, lengths)
            restart()
            self._update_peak = over = 0  # report the peak of the pass that counts
            group: list[int] = []
            self._computed_tokens = 0
            while order and not over:
                group = _next_group(
                    order, lambda g: self.prefixes.cost(g, lengths), self._limit(self.prefixes)
                )
                order = order[len(group) :]
                tokens = self._shared_rows(group, lengths)[0]
                self._computed_tokens += tokens
                if cuda:
                    torch.cuda.reset_peak_memory_stats(self.device)
                    base = torch.cuda.memory_allocated(self.device)
                else:
                    base = self.monitor.window()
                try:
                    work(group)
                except torch.OutOfMemoryError:  # CUDA: the allocator could not find the memory
                    over = tokens
                    break
                if cuda:
                    peak = torch.cuda.max_memory_allocated(self.device)
                    self.monitor.note_vram(peak)
                else:
                    peak = self.monitor.window_peak()
                self._update_peak = max(self._update_peak, peak)
                if not self.sizer.observe(tokens, base, peak):
                    over = tokens
            if not over:
                return
            self.optimizer.zero_grad(set_to_none=True)
            self.sizer.back_off(over, alone=len(group) == 1)  # raises when one sample alone did not fit
            trim = True
            log.warning(
                "a micro-batch of %d tokens went over the memory budget (%.1f GB): retrying the step with "
                "micro-batches of %d tokens",
                over,
                self.sizer.budget() / GB,
                self.sizer.limit,
            )

    def _logprobs(
        self, group: Sequence[int], part: Batch, lengths: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch's (b, t-1) log-probs and entropies at its loss positions, with grad."""
        tokens, shared = self._shared_rows(group, lengths)
        # not under checkpointing: the backward's re-run of the forward must take the same attention
        eager = (
            self.device.type == "cpu"
            and part.input_ids.shape[1] <= EAGER_ATTENTION_MAX_LEN
            and (not self.checkpointing or tokens <= self.plain_tokens)
        )
        with (
            self._memory_mode(tokens) as recompute,
            autocast(self.precision, self.device),
            short_rows_attention(self.model, eager),
        ):
            return token_logprobs(
                self.model,
                part.input_ids,
                part.attention,
                recompute_head=recompute,
                only=part.mask > 0,
                prefixes=shared,
            )

    def _memory_metrics(self, backoffs_before: int) -> dict[str, float]:
        key = "update_peak_vram_gb" if self.device.type == "cuda" else "update_peak_rss_gb"
        row = {
            "micro_batch_tokens": float(self.sizer.limit),
            "memory_backoffs": float(self.sizer.backoffs - backoffs_before),
            "memory_budget_gb": self.sizer.budget() / GB,
            key: self._update_peak / GB,
        }
        self._update_peak = 0
        return row

    def accumulate(
        self,
        samples: Sequence[Sample],
        advantages: Sequence[float],
        rollout_index: Sequence[int],
        only: Sequence[int] | None = None,
    ) -> dict[str, float]:
        """Backpropagate the batch loss into ``.grad`` micro-batch by micro-batch; returns loss, KL, entropy.

        ``only``: backpropagate just these samples' share of the loss (a data-parallel rank's shard);
        aggregation weights still come from the whole batch, so the shards' gradients sum to the batch's.
        """
        full = collate(samples, advantages, rollout_index, self.pad_id)
        weights = token_weights(full.mask, self.loss_config.aggregation, full.rollout_index)  # (B, T-1)
        names: tuple[str, ...] = ("loss", "kl", "clip_fraction", "entropy", "ratio_mean")
        if self.teacher is not None or self.config.teacher_scored:
            names += ("distill_kl",)  # the mean reverse KL of the sampled tokens to the teacher
        totals: dict[str, float] = dict.fromkeys(names, 0.0)
        n_tokens = max(float(full.mask.sum()), 1.0)
        mine = list(range(len(samples))) if only is None else list(only)
        lengths = [len(s.input_ids) for s in samples]
        self.prefixes = self.find_prefixes(samples)

        def work(group: list[int]) -> None:
            part = collate(
                [samples[i] for i in group], [advantages[i] for i in group], [0] * len(group), self.pad_id
            ).to(self.device)
            w = weights[torch.tensor(group), : part.input_ids.shape[1] - 1].to(self.device)  # (b, t-1)
            logprobs, entropy = self._logprobs(group, part, lengths)
            # without engine logprobs the ratio is taken on-policy (the trainer's own, detached)
            old = torch.where(part.has_old.unsqueeze(-1), part.old_logprobs, logprobs.detach())
            ref, teacher = (self._frozen_logprobs(m, part) for m in (self.reference, self.teacher))
            if self.config.teacher_scored:  # an endpoint teacher scored the samples before the step
                teacher = part.teacher_logprobs
            loss, metrics = grpo_loss(
                logprobs,
                old,
                part.advantages,
                part.mask,
                self.loss_config,
                ref_logprobs=ref,
                teacher_logprobs=teacher,
                weights=w,
            )
            self.monitor.sample()  # activations are all held here: the micro-batch's peak
            loss.backward()
            share = float(part.mask.sum()) / n_tokens
            totals["loss"] += float(loss.item())
            totals["kl"] += metrics["kl"] * share
            totals["clip_fraction"] += metrics["clip_fraction"] * share
            # pi_theta / pi_behaviour: off-policy (stale) samples move it away from 1
            totals["ratio_mean"] += metrics["ratio_mean"] * share
            totals["entropy"] += float((entropy * part.mask).sum()) / n_tokens
            if "distill_kl" in metrics:
                totals["distill_kl"] += metrics["distill_kl"] * share

        self._backprop(samples, mine, work, restart=lambda: totals.update(dict.fromkeys(names, 0.0)))
        totals["trained_tokens"] = float(full.mask.sum())
        totals["processed_tokens"] = float(sum(len(s.input_ids) for s in samples))
        # what the forward passes ran after shared prefixes (padding included): the step's real work
        totals["computed_tokens"] = float(self._computed_tokens)
        return totals

    def _frozen_logprobs(self, model: Any, part: Batch) -> torch.Tensor | None:
        """A frozen model's (reference, teacher) log-probs of the micro-batch's loss tokens; None without one."""
        if model is None:
            return None
        with torch.no_grad(), autocast(self.precision, self.device):
            return token_logprobs(model, part.input_ids, part.attention, only=part.mask > 0)[0]

    def step(
        self, samples: Sequence[Sample], advantages: Sequence[float], rollout_index: Sequence[int]
    ) -> dict[str, float]:
        """One optimizer step over ``samples`` (accumulate, clip, AdamW); adds grad norm and tokens/s."""
        started = time.perf_counter()
        backoffs = self.sizer.backoffs
        self.optimizer.zero_grad(set_to_none=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.data_parallel and collective.active():
            import torch.distributed as dist

            shards = collective.shard([len(s.input_ids) for s in samples], dist.get_world_size())
            metrics = self.accumulate(samples, advantages, rollout_index, only=shards[dist.get_rank()])
            collective.all_reduce_grads(params)
            metrics = collective.all_reduce_metrics(metrics, self.device)
        else:
            metrics = self.accumulate(samples, advantages, rollout_index)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.config.max_grad_norm)
        self.optimizer.step()
        elapsed = time.perf_counter() - started
        return {
            **metrics,
            "grad_norm": float(grad_norm),
            "train_tokens_per_s": metrics["processed_tokens"] / elapsed,
            "update_time_s": elapsed,
            **self._memory_metrics(backoffs),
        }

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step of masked next-token NLL: only model tokens (mask 1) carry loss."""
        started = time.perf_counter()
        backoffs = self.sizer.backoffs
        self.optimizer.zero_grad(set_to_none=True)
        n_tokens = float(sum(s.num_model_tokens for s in samples))
        total = [0.0]
        lengths = [len(s.input_ids) for s in samples]
        self.prefixes = self.find_prefixes(samples)

        def work(group: list[int]) -> None:
            part = collate([samples[i] for i in group], [0.0] * len(group), [0] * len(group), self.pad_id).to(
                self.device
            )
            logprobs, _ = self._logprobs(group, part, lengths)
            loss = sft_loss(logprobs, part.mask, normalizer=max(n_tokens, 1.0))
            self.monitor.sample()  # activations are all held here: the micro-batch's peak
            loss.backward()
            total[0] += float(loss.item())

        def restart() -> None:
            total[0] = 0.0

        self._backprop(samples, range(len(samples)), work, restart)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], self.config.max_grad_norm
        )
        self.optimizer.step()
        return {
            "sft_loss": total[0],
            "grad_norm": float(grad_norm),
            "train_tokens_per_s": n_tokens / (time.perf_counter() - started),
            **self._memory_metrics(backoffs),
        }

    def engine_weights(self, adapter: str | None = None) -> dict[str, torch.Tensor]:
        """Full weights for the engine: the model's state dict, with LoRA merged in when training LoRA
        (with several adapters, ``adapter``'s)."""
        if self.config.lora_rank > 0:
            names = [self._adapter_name(adapter)] if self.config.adapters else None
            merged = {}
            base = self.model.get_base_model()  # type: ignore[operator]
            with torch.no_grad():
                self.model.merge_adapter(adapter_names=names)  # type: ignore[operator]
                merged = {k: v.detach().clone() for k, v in base.state_dict().items() if "lora_" not in k}
                self.model.unmerge_adapter()  # type: ignore[operator]
            return {k.replace("base_layer.", ""): v for k, v in merged.items()}
        if adapter is not None:
            self._adapter_name(adapter)  # raises: full weights have no adapters
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def _adapter_name(self, adapter: str | None) -> str:
        """``adapter``, checked against the policy's adapters (required when it has several)."""
        if adapter is None or adapter not in self.config.adapters:
            raise ConfigError(
                f"no adapter {adapter!r} to push: this policy's adapters are {list(self.config.adapters)} "
                "(engines started with ModelSpec.adapters ask for each by name)"
            )
        return adapter

    def save_adapter(self, folder: Path, adapter: str | None = None) -> None:
        """The LoRA adapter alone as a PEFT folder (what vLLM hot-loads); with several, ``adapter``'s."""
        if not hasattr(self.model, "peft_config"):
            raise ConfigError(
                "this policy trains full weights (lora_rank=0), so it has no LoRA adapter to save; "
                "engines started for LoRA need a policy with lora_rank > 0"
            )
        if not self.config.adapters:
            self.model.save_pretrained(str(folder))
            return
        name = self._adapter_name(adapter)
        self.model.save_pretrained(str(folder), selected_adapters=[name])
        nested = Path(folder) / name  # PEFT writes a named adapter into a subfolder of its name
        for item in nested.iterdir():
            item.replace(Path(folder) / item.name)
        nested.rmdir()

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        if self.optimizers:
            states = {name: opt.state_dict() for name, opt in self.optimizers.items()}
            torch.save(states, path / "optimizers.pt")
        else:
            torch.save(self.optimizer.state_dict(), path / "optimizer.pt")

    def load_optimizer(self, path: Path) -> None:
        state = path / "optimizer.pt"
        if state.exists():
            self.optimizer.load_state_dict(torch.load(state, weights_only=True))


def with_lora(model: Any, rank: int, alpha: int, adapters: Sequence[str] = ()) -> Any:
    """``model`` wrapped in PEFT LoRA on every linear layer: one adapter (``"default"``), or one per
    name in ``adapters``, each starting as the base model (B = 0)."""
    from peft import LoraConfig, get_peft_model

    def lora() -> LoraConfig:
        return LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear")

    if not adapters:
        return get_peft_model(model, lora())
    wrapped = get_peft_model(model, lora(), adapter_name=adapters[0])
    for name in adapters[1:]:
        wrapped.add_adapter(name, lora())
    return wrapped


def adapter_parameters(model: Any, name: str) -> list[torch.nn.Parameter]:
    """The LoRA parameters of adapter ``name`` (PEFT names them ``...lora_A.<name>.weight``)."""
    own = re.compile(rf"\.lora_[AB]\.{re.escape(name)}\.")
    return [p for key, p in model.named_parameters() if own.search(key)]


def _fusable(params: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel takes these parameters: plain floating tensors on CPU or CUDA."""
    return bool(params) and all(
        type(p) in (torch.Tensor, torch.nn.Parameter)
        and p.device.type in ("cpu", "cuda")
        and p.is_floating_point()
        for p in params
    )


def _next_group(order: Sequence[int], cost: Callable[[list[int]], int], limit: int) -> list[int]:
    """The longest prefix of ``order`` whose ``cost`` (tokens computed) stays within ``limit``; at least one."""
    group = [order[0]]
    for i in order[1:]:
        if cost([*group, i]) > limit:
            break
        group.append(i)
    return group


def padded_tokens(lengths: Sequence[int]) -> Callable[[Sequence[int]], int]:
    """The cost of a micro-batch of whole samples: its rows padded to the longest."""
    return lambda group: len(group) * max(lengths[i] for i in group)
