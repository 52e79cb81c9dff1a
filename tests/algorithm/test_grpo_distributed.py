"""Data-parallel GRPO steps over gloo on 2 CPU processes give the single-process gradient and parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from agl.adapter import Sample, llm_calls, to_samples
from agl.algorithm.grpo import GRPOConfig, LossConfig
from agl.algorithm.policy.collective import shard
from agl.algorithm.policy.distributed import DistributedPolicy
from agl.algorithm.policy.model import Policy, PolicyConfig
from agl.errors import ConfigError
from agl.models import tiny_model
from tests.algorithm.test_grpo_policy import multi_turn_rollout


def _batch() -> tuple[list[Sample], list[float], list[int]]:
    """Five rollouts of different lengths, split per call: more samples than ranks, uneven shards."""
    samples, advantages, index = [], [], []
    for n, (turns, adv) in enumerate([(3, 1.0), (2, -0.7), (4, 0.4), (1, -1.2), (2, 0.5)]):
        made, _ = to_samples(llm_calls(multi_turn_rollout(f"ro-{n}", n, turns)), 1.0, level="transition")
        samples += made
        advantages += [adv] * len(made)
        index += [n] * len(made)
    return samples, advantages, index


def test_shards_cover_every_sample_once_and_balance_tokens() -> None:
    lengths = [50, 10, 40, 30, 20, 5]
    shards = shard(lengths, 2)
    assert sorted(i for s in shards for i in s) == list(range(6))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert abs(loads[0] - loads[1]) <= 5
    assert shard([7], 3) == [[0], [], []]  # fewer samples than ranks: some ranks train nothing
    assert shard(lengths, 2) == shards  # every rank computes the same assignment


def _grads(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if p.grad is not None}


def _params(policy: Policy) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in policy.model.named_parameters()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], atol: float = 1e-7) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=atol, msg=name)


@pytest.mark.slow  # spawns a second Python that imports torch and transformers
def test_two_gloo_ranks_give_the_single_process_gradient_and_step() -> None:
    config = PolicyConfig(model_path=str(tiny_model()), lr=1e-3, max_grad_norm=1.0)
    # rollout_mean: a sample's weight depends on its rollout's other samples, which may sit on the other rank
    loss = LossConfig(aggregation="rollout_mean")
    samples, advantages, index = _batch()
    assert len(samples) >= 8

    single = Policy(config, loss)
    single_metrics = single.step(samples, advantages, index)

    ranked = DistributedPolicy.start(Policy(config, loss), world_size=2)
    try:
        assert dist.get_world_size() == 2 and dist.get_rank() == 0
        before = _params(ranked.policy)
        ranked_metrics = ranked.step(samples, advantages, index)
        _close(_grads(single), _grads(ranked.policy))  # the summed shards' gradient (after clipping)
        # AdamW's first step is about lr * g / (|g| + 1e-8): a gradient element of ~1e-9, where the two
        # sums differ in rounding, moves its parameter by a visible share of lr; so compare to lr / 100
        _close(_params(single), _params(ranked.policy), atol=config.lr / 100)
        assert any(not torch.equal(before[n], p) for n, p in _params(ranked.policy).items())
        assert single_metrics["grad_norm"] > 1.0  # clipping was exercised on both sides
        for key in ("loss", "grad_norm", "entropy", "ratio_mean", "trained_tokens"):
            assert ranked_metrics[key] == pytest.approx(single_metrics[key], rel=1e-5), key
        digests = ranked.check_in_sync()  # rank 1 took the same step: its parameters equal rank 0's
        assert len(digests) == 2
    finally:
        ranked.close(graceful=False)  # the error path: no stop message, the spawned rank is terminated
    assert not dist.is_initialized()
    ranked._processes[0].join(timeout=10)
    assert not ranked._processes[0].is_alive()


def test_world_size_must_be_at_least_two() -> None:
    policy = Policy(PolicyConfig(model_path=str(tiny_model())), LossConfig())
    with pytest.raises(ConfigError, match="world_size >= 2"):
        DistributedPolicy.start(policy, world_size=1)
    with pytest.raises(ConfigError, match="world_size >= 1"):
        GRPOConfig(model_path="unused", world_size=0)


@pytest.mark.slow
def test_fit_with_two_ranks_trains(tmp_path: Path) -> None:
    import agl
    from agl.algorithm.grpo import GRPO
    from tests.trainer.test_fit import digits_agent

    config = GRPOConfig(
        model_path=str(tiny_model()),
        steps=2,
        tasks_per_step=2,
        group_size=3,
        lr=1e-3,
        eval_every=0,
        world_size=2,
    )
    grpo = GRPO(config)
    result = agl.Trainer(algorithm=grpo, n_runners=6, output_dir=str(tmp_path)).fit(
        digits_agent, ["a", "b", "c"], ["a"]
    )
    assert len(result["history"]) == 2
    assert any(row.get("grad_norm", 0.0) > 0 for row in result["history"])
    assert isinstance(grpo.policy, Policy)  # the ranks stopped; rank 0 keeps its plain policy
    assert not dist.is_initialized()


_UNGUARDED = """
import agl
from agl.algorithm.grpo import GRPO, GRPOConfig

grpo = GRPO(GRPOConfig(model_path={model!r}, steps=1, tasks_per_step=1, group_size=2, world_size=2))
agl.Trainer(algorithm=grpo, n_runners=2, output_dir={out!r}).fit(agl.rollout(lambda task: 1.0), ["a"])
"""


@pytest.mark.slow  # starts an engine and a spawned rank
def test_world_size_two_from_a_script_without_a_main_guard_fails_naming_the_guard(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_UNGUARDED.format(model=str(tiny_model()), out=str(tmp_path / "out")))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path
    )
    assert done.returncode != 0, done.stderr[-3000:]
    # the spawned rank refuses to start a second fit, and rank 0 reports it instead of waiting forever
    assert "Trainer.fit ran in a spawned training rank" in done.stderr, done.stderr[-3000:]
    assert "rank 1 of 2 exited" in done.stderr and 'if __name__ == "__main__":' in done.stderr
