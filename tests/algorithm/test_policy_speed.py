"""The policy's speed settings change no result: small micro-batches skip checkpointing and the head's
recompute under "auto", AdamW runs fused, and each gives the gradient or step of the plain path."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from agl.adapter import Sample
from agl.algorithm.grpo import LossConfig
from agl.algorithm.policy.logprobs import token_logprobs
from agl.algorithm.policy.model import Policy, PolicyConfig
from agl.compute.memory import PLAIN_CPU_TOKENS, plain_tokens_for
from agl.models import tiny_model
from tests.support.gradients import batch_gradient


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_model()


def _samples(n: int, length: int, seed: int = 0) -> tuple[list[Sample], list[float], list[int]]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        ids = tuple(rng.randrange(3, 1024) for _ in range(length))
        mask = tuple([0] * (length // 2) + [1] * (length - length // 2))
        old = tuple(-6.9 if m else 0.0 for m in mask)
        samples.append(Sample(f"r{i}", "g", ids, mask, old, float(i % 2)))
    return samples, [1.0 if i % 2 else -1.0 for i in range(n)], [i // 2 for i in range(n)]


def _checkpointed_calls(
    policy: Policy, samples: list[Sample], adv: list[float], index: list[int]
) -> list[bool]:
    """For each decoder-layer call during ``accumulate``, whether that layer had checkpointing on."""
    seen: list[bool] = []
    layer = next(m for m in policy.model.modules() if hasattr(m, "gradient_checkpointing"))
    handle = layer.register_forward_pre_hook(lambda m, _: seen.append(bool(m.gradient_checkpointing)))
    try:
        policy.accumulate(samples, adv, index)
    finally:
        handle.remove()
        policy.optimizer.zero_grad(set_to_none=True)
    return seen


def test_auto_checkpoints_only_large_micro_batches_on_cpu(tiny: Path) -> None:
    assert plain_tokens_for("auto", "cpu") == PLAIN_CPU_TOKENS
    assert plain_tokens_for("auto", "cuda") == 0 and plain_tokens_for(True, "cpu") == 0
    policy = Policy(PolicyConfig(model_path=str(tiny), lr=0.0, micro_batch_tokens=4096), LossConfig())
    small = _samples(4, 32)  # 128 tokens: whole
    large = _samples(4, 300)  # 1,200 tokens in one micro-batch: checkpointed
    assert set(_checkpointed_calls(policy, *small)) == {False}
    assert True in _checkpointed_calls(policy, *large)
    # the flag is restored after a plain micro-batch
    assert all(
        m.gradient_checkpointing for m in policy.model.modules() if hasattr(m, "gradient_checkpointing")
    )


def test_checkpointing_always_on_when_asked(tiny: Path) -> None:
    policy = Policy(PolicyConfig(model_path=str(tiny), lr=0.0, activation_checkpointing=True), LossConfig())
    assert True in _checkpointed_calls(policy, *_samples(4, 32))


def test_a_whole_small_micro_batch_gives_the_checkpointed_gradient(tiny: Path) -> None:
    config = PolicyConfig(model_path=str(tiny), lr=0.0, activation_checkpointing=True)
    always = Policy(config, LossConfig())
    auto = Policy(PolicyConfig(model_path=str(tiny), lr=0.0), LossConfig())
    batch = _samples(6, 40)
    a, b = batch_gradient(always, *batch), batch_gradient(auto, *batch)
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-7, msg=name)
    assert max(float(g.abs().max()) for g in a.values()) > 1e-4


def test_keeping_the_head_logits_gives_the_recomputed_gradient(tiny: Path) -> None:
    policy = Policy(PolicyConfig(model_path=str(tiny), lr=0.0, activation_checkpointing=False), LossConfig())
    ids = torch.randint(3, 1024, (3, 50))
    attention = torch.ones_like(ids)
    grads = []
    for recompute in (True, False):
        policy.model.zero_grad(set_to_none=True)
        logprobs, _ = token_logprobs(policy.model, ids, attention, chunk_tokens=64, recompute_head=recompute)
        logprobs.sum().backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-5, atol=1e-7, msg=name)


def test_adamw_is_fused_on_cpu_and_steps_as_the_plain_one(tiny: Path) -> None:
    policy = Policy(PolicyConfig(model_path=str(tiny), lr=1e-3), LossConfig())
    assert policy.optimizer.defaults["fused"] is True
    params = [p for p in policy.model.parameters() if p.requires_grad]
    twins = [p.detach().clone().requires_grad_(True) for p in params]
    plain = torch.optim.AdamW(twins, lr=1e-3, weight_decay=policy.config.weight_decay, foreach=False)
    samples, adv, index = _samples(4, 24)
    policy.step(samples, adv, index)  # clipped gradients, then the fused step
    for p, twin in zip(params, twins, strict=True):
        assert p.grad is not None
        twin.grad = p.grad.clone()
    before = [t.detach().clone() for t in twins]
    plain.step()
    moved = 0.0
    for p, twin, old in zip(params, twins, before, strict=True):
        torch.testing.assert_close(p.detach(), twin.detach(), rtol=1e-6, atol=1e-7)
        moved = max(moved, float((twin.detach() - old).abs().max()))
    assert moved > 1e-4  # the step moved the weights (lr 1e-3, Adam's first step is ~lr per weight)


@pytest.mark.parametrize("chunk_tokens", [64, None])  # the chunked head, and the full-logits path
def test_the_head_on_loss_positions_only_gives_their_logprobs_and_gradient(
    tiny: Path, chunk_tokens: int | None
) -> None:
    policy = Policy(PolicyConfig(model_path=str(tiny), lr=0.0, activation_checkpointing=False), LossConfig())
    torch.manual_seed(1)
    ids = torch.randint(3, 1024, (3, 40))
    attention = torch.ones_like(ids)
    only = torch.zeros(3, 39, dtype=torch.bool)
    only[0, 20:] = only[1, 5:9] = only[2, 30:] = True
    results = []
    for subset in (None, only):
        policy.model.zero_grad(set_to_none=True)
        logprobs, entropy = token_logprobs(
            policy.model, ids, attention, chunk_tokens=chunk_tokens, only=subset
        )
        (logprobs * only).sum().backward()
        grads = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
        results.append((logprobs.detach(), entropy, grads))
    (full, full_entropy, full_grads), (part, part_entropy, part_grads) = results
    torch.testing.assert_close(part[only], full[only], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(part_entropy[only], full_entropy[only], rtol=1e-5, atol=1e-6)
    assert bool((part[~only] == 0).all()) and bool((full[~only] != 0).all())
    for name in full_grads:
        torch.testing.assert_close(part_grads[name], full_grads[name], rtol=1e-4, atol=1e-7, msg=name)
