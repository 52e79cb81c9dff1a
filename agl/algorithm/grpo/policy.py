"""The trainer side of GRPO: a HF causal LM (full or LoRA), its log-probs, and one optimizer step.

Micro-batches are cut by a token budget; each adds its share of the batch loss (aggregation weights
are computed over the whole batch), so accumulation gives the same gradient as one big batch. Under
torch.distributed each rank backpropagates its shard of the samples and the gradients are summed
(:mod:`agl.algorithm.grpo.distributed`), which gives the same gradient again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agl.adapter.trajectory import Sample
from agl.algorithm.grpo import distributed
from agl.algorithm.grpo.logprobs import token_logprobs
from agl.algorithm.grpo.loss import LossConfig, grpo_loss, token_weights
from agl.errors import ConfigError


@dataclass(frozen=True)
class PolicyConfig:
    model_path: str
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_tokens: int = 4096
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: int = 32
    kl_coef: float = 0.0
    activation_checkpointing: bool = False  # less memory for about a third more compute (NOTES.md)
    seed: int = 0
    device: str = "cpu"  # "cuda" trains on the GPU


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T)
    attention: torch.Tensor  # (B, T)
    mask: torch.Tensor  # (B, T-1), loss mask of predicted tokens
    old_logprobs: torch.Tensor  # (B, T-1)
    advantages: torch.Tensor  # (B,), or (B, T-1) per token
    rollout_index: torch.Tensor  # (B,)
    has_old: torch.Tensor  # (B,) whether the engine's logprobs came with the sample

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
    for i, s in enumerate(samples):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        if s.old_logprobs is not None:
            old[i, :n] = torch.tensor(s.old_logprobs, dtype=torch.float32)
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
    )


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
    """The model being trained, its optimizer and (with KL) a frozen reference copy."""

    def __init__(self, config: PolicyConfig, loss: LossConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(config.seed)
        self.config, self.loss_config = config, loss
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            config.model_path, local_files_only=True, dtype=torch.float32
        )
        self.device = torch.device(config.device)
        self.data_parallel = False  # set by agl.algorithm.grpo.distributed on every rank of a group
        model.to(self.device)  # type: ignore[arg-type]
        if config.activation_checkpointing:
            enable_activation_checkpointing(model)
        self.reference = None
        if config.kl_coef > 0:
            self.reference = AutoModelForCausalLM.from_pretrained(
                config.model_path, local_files_only=True, dtype=torch.float32
            ).eval()
            self.reference.to(self.device)  # type: ignore[arg-type]
        if config.lora_rank > 0:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules="all-linear")
            model = get_peft_model(model, lora)  # type: ignore[assignment]
        self.model = model
        self.model.train()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else self.tokenizer.eos_token_id or 0)

    def micro_batches(self, samples: Sequence[Sample]) -> list[list[int]]:
        """Sample indices grouped so each group's padded size stays within ``micro_batch_tokens``."""
        order = sorted(range(len(samples)), key=lambda i: len(samples[i].input_ids))
        groups: list[list[int]] = []
        current: list[int] = []
        for i in order:
            width = max([len(samples[j].input_ids) for j in current] + [len(samples[i].input_ids)])
            if current and width * (len(current) + 1) > self.config.micro_batch_tokens:
                groups.append(current)
                current = []
            current.append(i)
        if current:
            groups.append(current)
        return groups

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
        totals: dict[str, float] = {
            "loss": 0.0,
            "kl": 0.0,
            "clip_fraction": 0.0,
            "entropy": 0.0,
            "ratio_mean": 0.0,
        }
        n_tokens = max(float(full.mask.sum()), 1.0)
        mine = list(range(len(samples))) if only is None else list(only)
        for local in self.micro_batches([samples[i] for i in mine]):
            group = [mine[i] for i in local]
            part = collate(
                [samples[i] for i in group], [advantages[i] for i in group], [0] * len(group), self.pad_id
            ).to(self.device)
            w = weights[torch.tensor(group), : part.input_ids.shape[1] - 1].to(self.device)  # (b, t-1)
            logprobs, entropy = token_logprobs(self.model, part.input_ids, part.attention)
            # without engine logprobs the ratio is taken on-policy (the trainer's own, detached)
            old = torch.where(part.has_old.unsqueeze(-1), part.old_logprobs, logprobs.detach())
            ref = None
            if self.reference is not None:
                with torch.no_grad():
                    ref, _ = token_logprobs(self.reference, part.input_ids, part.attention)
            loss, metrics = grpo_loss(
                logprobs, old, part.advantages, part.mask, self.loss_config, ref_logprobs=ref, weights=w
            )
            loss.backward()
            share = float(part.mask.sum()) / n_tokens
            totals["loss"] += float(loss.item())
            totals["kl"] += metrics["kl"] * share
            totals["clip_fraction"] += metrics["clip_fraction"] * share
            # pi_theta / pi_behaviour: off-policy (stale) samples move it away from 1
            totals["ratio_mean"] += metrics["ratio_mean"] * share
            totals["entropy"] += float((entropy * part.mask).sum()) / n_tokens
        totals["trained_tokens"] = float(full.mask.sum())
        totals["processed_tokens"] = float(sum(len(s.input_ids) for s in samples))
        return totals

    def step(
        self, samples: Sequence[Sample], advantages: Sequence[float], rollout_index: Sequence[int]
    ) -> dict[str, float]:
        """One optimizer step over ``samples`` (accumulate, clip, AdamW); adds grad norm and tokens/s."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.data_parallel and distributed.active():
            import torch.distributed as dist

            shards = distributed.shard([len(s.input_ids) for s in samples], dist.get_world_size())
            metrics = self.accumulate(samples, advantages, rollout_index, only=shards[dist.get_rank()])
            distributed.all_reduce_grads(params)
            metrics = distributed.all_reduce_metrics(metrics, self.device)
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
        }

    def sft_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step of masked next-token NLL: only model tokens (mask 1) carry loss."""
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        n_tokens = float(sum(s.num_model_tokens for s in samples))
        total = 0.0
        for group in self.micro_batches(samples):
            part = collate([samples[i] for i in group], [0.0] * len(group), [0] * len(group), self.pad_id).to(
                self.device
            )
            logprobs, _ = token_logprobs(self.model, part.input_ids, part.attention)
            loss = sft_loss(logprobs, part.mask, normalizer=max(n_tokens, 1.0))
            loss.backward()
            total += float(loss.item())
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in self.model.parameters() if p.requires_grad], self.config.max_grad_norm
        )
        self.optimizer.step()
        return {
            "sft_loss": total,
            "grad_norm": float(grad_norm),
            "train_tokens_per_s": n_tokens / (time.perf_counter() - started),
        }

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """Full weights for the engine: the model's state dict, with LoRA merged in when training LoRA."""
        if self.config.lora_rank > 0:
            merged = {}
            base = self.model.get_base_model()  # type: ignore[operator]
            with torch.no_grad():
                self.model.merge_adapter()  # type: ignore[operator]
                merged = {k: v.detach().clone() for k, v in base.state_dict().items() if "lora_" not in k}
                self.model.unmerge_adapter()  # type: ignore[operator]
            return {k.replace("base_layer.", ""): v for k, v in merged.items()}
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")

    def load_optimizer(self, path: Path) -> None:
        state = path / "optimizer.pt"
        if state.exists():
            self.optimizer.load_state_dict(torch.load(state, weights_only=True))
