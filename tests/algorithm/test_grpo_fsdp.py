"""FSDP2-sharded GRPO and SFT steps over gloo on 2 CPU processes: the single-process result at half the memory."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from agl.adapter import Sample
from agl.algorithm.export import export_policy
from agl.algorithm.grpo import GRPOConfig, LossConfig
from agl.algorithm.policy.collective import shard
from agl.algorithm.policy.distributed import DistributedPolicy
from agl.algorithm.policy.model import Policy, PolicyConfig
from agl.algorithm.sft import SFTConfig
from agl.errors import ConfigError
from agl.models import tiny_model
from tests.algorithm.test_grpo_distributed import _batch

# AdamW's first step is about lr * g / (|g| + 1e-8): a gradient element of ~1e-9, where a sum over two
# ranks and one over a single process differ in rounding, moves its parameter by a visible share of lr
PARAM_ATOL = 1e-3 / 100


def _second_batch() -> tuple[list[Sample], list[float], list[int]]:
    samples, advantages, index = _batch()
    return samples[::-1], [-a for a in advantages[::-1]], index[::-1]


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=atol, msg=name)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _bytes(policy: Policy) -> int:
    """Parameters, gradients and AdamW state of an unsharded policy."""
    params = list(policy.model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [v for s in policy.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.slow  # spawns a second Python (torch and transformers), twice
def test_fsdp_step_equals_one_process_at_half_the_memory_and_resumes_from_a_sharded_checkpoint(
    tmp_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM

    config = PolicyConfig(model_path=str(tiny_model()), lr=1e-3, max_grad_norm=1.0)
    loss = LossConfig(aggregation="rollout_mean")  # a sample's weight depends on samples on the other rank
    first, second = _batch(), _second_batch()

    single = Policy(config, loss)
    single_metrics = single.step(*first)
    after_one = _state(single.model)
    single_bytes = _bytes(single)

    ranked = DistributedPolicy.start(Policy(config, loss), world_size=2, sharding="fsdp")
    try:
        metrics = ranked.step(*first)
        for key in ("loss", "grad_norm", "entropy", "trained_tokens"):
            assert metrics[key] == pytest.approx(single_metrics[key], rel=1e-5), key
        assert single_metrics["grad_norm"] > 1.0  # clipping (over the sharded gradient) was exercised
        _close(ranked.engine_weights(), after_one, atol=PARAM_ATOL)

        shards = ranked.memory_bytes()  # each rank's local shards of parameters, gradients, AdamW state
        assert len(shards) == 2
        for rank in shards:
            share = sum(rank.values()) / single_bytes
            assert 0.45 < share < 0.55, (share, rank)
            assert rank["optimizer"] > 0 and rank["gradients"] > 0

        ranked.save(tmp_path / "ckpt")
        assert (tmp_path / "ckpt" / "sharded" / ".metadata").is_file()
        ranked.step(*second)
        uninterrupted = ranked.engine_weights()
        # an export mid-run gathers the shards into a normal Hugging Face folder
        folder = export_policy(ranked, tmp_path / "model").model_path
        loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        _close(_state(loaded), uninterrupted, atol=0.0)
    finally:
        ranked.close()
    assert not dist.is_initialized()
    assert type(ranked.policy) is Policy  # rank 0 keeps a plain policy with the trained weights
    _close(_state(ranked.policy.model), uninterrupted, atol=0.0)

    # resume as GRPO does: rank 0 loads the checkpoint's HF folder, every rank its shards (with AdamW's)
    resumed = DistributedPolicy.start(
        Policy(dataclasses.replace(config, model_path=str(tmp_path / "ckpt")), loss),
        world_size=2,
        optimizer_from=str(tmp_path / "ckpt"),
        sharding="fsdp",
    )
    try:
        resumed.step(*second)
        _close(resumed.engine_weights(), uninterrupted, atol=1e-7)
    finally:
        resumed.close(graceful=False)
    assert not dist.is_initialized()


@pytest.mark.slow
def test_fsdp_lora_kl_and_sft_steps_equal_one_process(tmp_path: Path) -> None:
    """LoRA, a sharded KL reference, an optimizer warm-started before sharding, and ranks with different
    numbers of micro-batches (one sample each: the rank with fewer runs zero-weight passes)."""
    from transformers import AutoModelForCausalLM

    config = PolicyConfig(
        model_path=str(tiny_model()), lr=1e-3, lora_rank=4, lora_alpha=8, kl_coef=0.1, micro_batch_tokens=1
    )
    loss = LossConfig(kl_coef=0.1)
    batch = _batch()
    samples, advantages, index = batch[0][:5], batch[1][:5], batch[2][:5]  # odd: the ranks get 3 and 2
    others = batch[0][5:9]
    counts = [len(s) for s in shard([len(s.input_ids) for s in samples], 2)]
    assert counts[0] != counts[1], counts  # uneven micro-batch counts: the idle passes run
    single, plain = Policy(config, loss), Policy(config, loss)
    for policy in (single, plain):  # a warm start on the unsharded policy: AdamW state to carry over
        policy.sft_step(others)
    ranked = DistributedPolicy.start(plain, world_size=2, sharding="fsdp")
    try:
        single_metrics, metrics = (
            single.step(samples, advantages, index),
            ranked.step(samples, advantages, index),
        )
        for key in ("loss", "kl", "grad_norm"):
            assert metrics[key] == pytest.approx(single_metrics[key], rel=1e-5), key
        assert single_metrics["kl"] > 0  # the reference differs from the warm-started policy
        single_sft, sft = single.sft_step(others), ranked.sft_step(others)
        assert sft["sft_loss"] == pytest.approx(single_sft["sft_loss"], rel=1e-5)
        merged = single.engine_weights()  # LoRA merged into the base weights
        gathered = ranked.engine_weights()
        _close(gathered, merged, atol=PARAM_ATOL)
        folder = export_policy(ranked, tmp_path / "model").model_path
        assert not (folder / "adapter_config.json").exists()  # a plain model, LoRA merged
        loaded = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
        _close(_state(loaded), merged, atol=PARAM_ATOL)
    finally:
        ranked.close()
    assert type(ranked.policy) is Policy  # unsharded on rank 0, the adapter kept (peft merges the same)
    _close(ranked.policy.engine_weights(), gathered, atol=1e-6)


def test_sharding_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="sharding"):
        GRPOConfig(model_path="unused", world_size=2, sharding="zero3")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="world_size >= 2"):
        GRPOConfig(model_path="unused", sharding="fsdp")
    with pytest.raises(ConfigError, match="world_size >= 2"):
        SFTConfig(model_path="unused", sharding="fsdp")
    with pytest.raises(ConfigError, match='world_size >= 2 with sharding="fsdp"'):
        SFTConfig(model_path="unused", world_size=2)
