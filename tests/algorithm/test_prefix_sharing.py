"""Shared prompt prefixes: found where samples share a loss-free prefix, and the same gradients as whole samples."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from agl.adapter import Sample
from agl.algorithm.grpo import LossConfig
from agl.algorithm.policy.model import Policy, PolicyConfig
from agl.algorithm.policy.prefix import SharedPrefixes
from agl.models import tiny_model
from tests.support.gradients import batch_gradient


def sample(prompt: list[int], completion: list[int], tool: list[int] = (), more: list[int] = ()) -> Sample:  # type: ignore[assignment]
    """A sample of ``prompt`` then ``completion`` (loss), optionally a tool result (no loss) and ``more`` (loss)."""
    ids = [*prompt, *completion, *tool, *more]
    mask = [0] * len(prompt) + [1] * len(completion) + [0] * len(tool) + [1] * len(more)
    old = [-6.9 + 0.01 * (i % 7) if m else 0.0 for i, m in enumerate(mask)]
    return Sample("r", "g", tuple(ids), tuple(mask), tuple(old), 0.0)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 1024) for _ in range(n)]


def test_a_group_shares_its_prompt_up_to_the_token_before_the_first_loss_token() -> None:
    rng = random.Random(0)
    prompt = ids(rng, 40)
    group = [sample(prompt, ids(rng, n)) for n in (3, 9, 5, 12)]
    found = SharedPrefixes.find(group)
    # position 39 predicts the first completion token, so it is each sample's own
    assert found.length == (39, 39, 39, 39)
    assert len(set(found.family)) == 1


def test_two_groups_keep_their_own_prompts_rather_than_only_the_system_prompt() -> None:
    rng = random.Random(1)
    system = ids(rng, 20)
    a, b = system + ids(rng, 20), system + ids(rng, 25)
    batch = [sample(a, ids(rng, 4)), sample(b, ids(rng, 6)), sample(a, ids(rng, 7)), sample(b, ids(rng, 2))]
    found = SharedPrefixes.find(batch)
    assert found.length == (39, 44, 39, 44)
    assert found.family[0] == found.family[2] != found.family[1] == found.family[3]


def test_short_or_loss_bearing_prefixes_are_not_shared() -> None:
    rng = random.Random(2)
    prompt = ids(rng, 10)  # under the 16 tokens worth a second forward pass
    short = [sample(prompt, ids(rng, 30)), sample(prompt, ids(rng, 30))]
    assert SharedPrefixes.find(short).length == (0, 0)
    # equal for 40 tokens, but the loss starts at token 8: a shared prefix may not pass position 7
    body = ids(rng, 40)
    early = [sample(body[:8], body[8:]), sample(body[:8], [*body[8:], *ids(rng, 3)])]
    assert SharedPrefixes.find(early).length == (0, 0)
    alone = [sample(ids(rng, 40), ids(rng, 5))]
    assert SharedPrefixes.find(alone) == SharedPrefixes.none(1)


def test_micro_batches_keep_families_together_and_count_each_prefix_once() -> None:
    rng = random.Random(3)
    a, b = ids(rng, 30), ids(rng, 50)
    batch = [sample(a, ids(rng, 5)), sample(b, ids(rng, 5)), sample(a, ids(rng, 10)), sample(b, ids(rng, 3))]
    found = SharedPrefixes.find(batch)
    lengths = [len(s.input_ids) for s in batch]
    order = found.order(range(4), lengths)
    assert {order[0], order[1]} in ({0, 2}, {1, 3}) and {order[2], order[3]} in ({0, 2}, {1, 3})
    # nothing shared: shortest first, as whole-sample micro-batches were always cut
    assert SharedPrefixes.none(4).order([3, 2, 1, 0], lengths) == sorted(range(4), key=lambda i: lengths[i])
    # a's family: prefix 29 once + 2 rows padded to the longer suffix (40 - 29 = 11)
    assert found.cost([0, 2], lengths) == 29 + 2 * 11
    # mixed families: each prefix once, rows padded to the longest suffix, the hole of the shorter prefix
    assert found.cost([0, 1], lengths) == 2 * 49 + 2 * 6


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def policies(tiny: Path) -> Iterator[tuple[Policy, Policy]]:
    def make(share: bool) -> Policy:
        config = PolicyConfig(model_path=str(tiny), lr=1e-3, max_grad_norm=1e9, share_prefixes=share)
        return Policy(config, LossConfig())

    yield make(True), make(False)


def mixed_batch(seed: int) -> tuple[list[Sample], list[float], list[int]]:
    """Two groups with prompts of different lengths (so the shorter leaves a hole in the cache), a
    multi-turn sample (loss, tool result, loss) in one, and one sample that shares nothing."""
    rng = random.Random(seed)
    system = ids(rng, 12)
    p1, p2 = system + ids(rng, 30), system + ids(rng, 21)
    samples = [sample(p1, ids(rng, n)) for n in (4, 9, 2)]
    samples.append(sample(p1, ids(rng, 3), tool=ids(rng, 5), more=ids(rng, 4)))
    samples += [sample(p2, ids(rng, n)) for n in (7, 1, 5, 11)]
    samples.append(sample(ids(rng, 25), ids(rng, 6)))
    advantages = [rng.uniform(-1, 1) for _ in samples]
    index = [0, 0, 0, 0, 1, 1, 1, 1, 2]
    return samples, advantages, index


def test_shared_prefixes_give_the_whole_samples_gradient(policies: tuple[Policy, Policy]) -> None:
    shared, whole = policies
    assert shared.share_prefixes and not whole.share_prefixes
    samples, advantages, index = mixed_batch(4)
    assert SharedPrefixes.find(samples).length.count(0) == 1
    got = batch_gradient(shared, samples, advantages, index)
    want = batch_gradient(whole, samples, advantages, index)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-7, msg=name)
    a = shared.accumulate(samples, advantages, index)
    b = whole.accumulate(samples, advantages, index)
    for key in ("loss", "entropy", "ratio_mean", "clip_fraction"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


def test_shared_prefixes_compute_fewer_positions(policies: tuple[Policy, Policy]) -> None:
    """The embedding layer sees each family's prefix once instead of once per sample."""
    samples, advantages, index = mixed_batch(5)
    samples, advantages, index = samples[:-1], advantages[:-1], index[:-1]  # the two groups
    seen = {}
    for policy in policies:
        counted = [0]
        hook = policy.model.get_input_embeddings().register_forward_hook(
            lambda _m, args, _o, c=counted: c.__setitem__(0, c[0] + args[0].numel())
        )
        try:
            computed = policy.accumulate(samples, advantages, index)["computed_tokens"]
        finally:
            hook.remove()
            policy.optimizer.zero_grad(set_to_none=True)
        assert computed == counted[0]  # the step's metric reports the positions the forward passes ran
        seen[policy.share_prefixes] = counted[0]
    lengths = [len(s.input_ids) for s in samples]
    assert seen[False] == len(samples) * max(lengths)
    assert seen[True] == SharedPrefixes.find(samples).cost(range(len(samples)), lengths) < 0.5 * seen[False]


def test_sft_step_with_shared_prefixes_matches(policies: tuple[Policy, Policy]) -> None:
    samples, _, _ = mixed_batch(6)
    shared, whole = policies
    # sft_step leaves the step's gradient in .grad (the clip norm is far above it)
    losses = [policy.sft_step(samples)["sft_loss"] for policy in policies]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    grads = [
        {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None} for policy in policies
    ]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_checkpointing_everywhere_turns_sharing_off(tiny: Path) -> None:
    """A checkpointed layer replays its forward and would write the prefix cache twice."""
    config = PolicyConfig(model_path=str(tiny), activation_checkpointing=True)
    assert not Policy(config, LossConfig()).share_prefixes


def test_lora_policy_shares_prefixes_with_the_same_gradient(tiny: Path) -> None:
    """A PEFT wrapper passes the cache through to the base model; the adapters' gradients agree."""
    samples, advantages, index = mixed_batch(7)
    grads = []
    for share in (True, False):
        policy = Policy(PolicyConfig(model_path=str(tiny), lora_rank=4, share_prefixes=share), LossConfig())
        assert policy.share_prefixes is share
        grads.append(batch_gradient(policy, samples, advantages, index))
    assert grads[0].keys() == grads[1].keys() and all("lora_" in name for name in grads[0])
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[0][name], grad, rtol=1e-4, atol=1e-7, msg=name)
