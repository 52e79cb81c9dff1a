"""bf16 autocast for the policy and the built-in engine: how "auto" resolves, and that bf16 stays close to fp32
(gradient direction, engine-vs-trainer logprobs) with fp32 weights and optimizer state. Learning under bf16
is in test_grpo_learning.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agl.adapter import Sample
from agl.algorithm.grpo import GRPOConfig, LossConfig
from agl.algorithm.policy.model import Policy, PolicyConfig
from agl.algorithm.sft import SFTConfig
from agl.compute.precision import resolve_precision
from agl.errors import ConfigError
from agl.models import tiny_model
from tests.algorithm.engine_gaps import engine_logprob_gaps


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_model()


def test_auto_follows_the_cpu_and_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGL_PRECISION", raising=False)
    assert resolve_precision("fp32", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"
    assert resolve_precision("auto", "cuda") == "fp32"  # not measured on a GPU yet
    monkeypatch.setattr("agl.compute.precision.cpu_has_native_bf16", lambda: False)
    assert resolve_precision("auto", "cpu") == "fp32"  # emulated bf16 would be slower than fp32
    monkeypatch.setattr("agl.compute.precision.cpu_has_native_bf16", lambda: True)
    assert resolve_precision("auto", "cpu") == "bf16"
    monkeypatch.setenv("AGL_PRECISION", "bf16")
    assert resolve_precision("auto", "cpu") == "bf16" and resolve_precision("fp32", "cpu") == "fp32"
    monkeypatch.setenv("AGL_PRECISION", "fp32")
    assert resolve_precision("auto", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"
    monkeypatch.setenv("AGL_PRECISION", "half")
    with pytest.raises(ConfigError, match="AGL_PRECISION must be 'fp32' or 'bf16', got 'half'"):
        resolve_precision("auto", "cpu")


def test_bf16_on_a_cpu_without_it_warns_once(monkeypatch: pytest.MonkeyPatch) -> None:
    import warnings

    from agl.compute import precision

    monkeypatch.delenv("AGL_PRECISION", raising=False)
    precision._warn_emulated_bf16.cache_clear()
    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: False)
    with pytest.warns(RuntimeWarning, match="CPU without native bf16.*far slower than in fp32"):
        assert resolve_precision("bf16", "cpu") == "bf16"  # still what was asked for
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resolve_precision("bf16", "cpu")  # once per process
        resolve_precision("auto", "cpu")  # auto never picks emulated bf16
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: True)
        precision._warn_emulated_bf16.cache_clear()
        resolve_precision("bf16", "cpu")  # native: no warning
    precision._warn_emulated_bf16.cache_clear()


def test_a_bad_precision_names_the_field(tiny: Path) -> None:
    with pytest.raises(ConfigError, match=r"GRPOConfig\.precision must be one of .*got 'fp16'"):
        GRPOConfig(model_path=str(tiny), precision="fp16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"SFTConfig\.precision must be one of"):
        SFTConfig(model_path=str(tiny), precision="half")  # type: ignore[arg-type]
    from agl.engines.builtin import Engine

    with pytest.raises(ConfigError, match="precision must be one of"):
        Engine(tiny, precision="float8")


def _samples(vocab: int) -> list[Sample]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for n in (19, 27, 33):
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        out.append(Sample("r", None, tuple(ids), (0,) * 5 + (1,) * (n - 5), None, 0.0))
    return out


def _gradient(tiny: Path, precision: str) -> tuple[torch.Tensor, Policy]:
    policy = Policy(
        PolicyConfig(model_path=str(tiny), lr=0.0, max_grad_norm=1e9, precision=precision),  # type: ignore[arg-type]
        LossConfig(),
    )
    samples = _samples(policy.model.config.vocab_size)
    metrics = policy.step(samples, [1.0, -0.5, 0.3], [0, 1, 2])
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["loss"]))
    flat = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None])
    return flat, policy


def test_a_bf16_step_points_the_gradient_where_fp32_does_and_keeps_fp32_weights(tiny: Path) -> None:
    fp32, _ = _gradient(tiny, "fp32")
    bf16, policy = _gradient(tiny, "bf16")
    assert policy.precision == "bf16"
    cosine = float(torch.nn.functional.cosine_similarity(fp32, bf16, dim=0))
    print(f"bf16 vs fp32 gradient: cosine {cosine:.4f}, norm ratio {float(bf16.norm() / fp32.norm()):.3f}")
    assert cosine > 0.98 and not torch.equal(fp32, bf16)  # close, and bf16 did run
    assert 0.9 < float(bf16.norm() / fp32.norm()) < 1.1
    # weights, gradients and AdamW state stay fp32: only the matmuls ran in bf16
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in policy.model.parameters() if p.grad is not None} == {torch.float32}
    states = [
        t for s in policy.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0
    ]
    assert states and {t.dtype for t in states} == {torch.float32}


async def test_a_bf16_engine_samples_with_logprobs_a_bf16_trainer_reproduces(tiny: Path) -> None:
    from agl.engines.builtin import Engine

    policy = Policy(PolicyConfig(model_path=str(tiny), precision="bf16"), LossConfig())
    engine = Engine(tiny, max_batch_size=8, precision="bf16")
    diff, off = await engine_logprob_gaps(engine, policy.model, policy.pad_id, ["bf16", "fp32"])
    print(
        f"bf16 engine vs bf16 trainer: mean {float(diff.mean()):.4f} max {float(diff.max()):.4f}; vs fp32 mean "
        f"{float(off.mean()):.4f}"
    )
    assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.5  # a ratio of exp(0.05) at most on average
    assert float(off.mean()) > 0  # the engine did run in bf16: not the exact fp32 numbers


async def test_fit_serves_the_built_in_engine_in_the_policys_precision(tiny: Path, tmp_path: Path) -> None:
    import agl
    from agl.engines.launch import BuiltinEngine, start_engines
    from agl.trainer.fit import served_model

    spec = served_model(agl.GRPO(GRPOConfig(model_path=str(tiny), precision="bf16")))
    assert spec is not None and spec.precision == "bf16"  # what fit passes to start_engines
    assert agl.ModelSpec(str(tiny)).precision == "auto"  # a spec that names none: the engine decides
    # SFT trains and serves fp32 unless told: bf16 serving drops its small updates (serving_precision.py)
    sft_spec = served_model(agl.SFT(agl.SFTConfig(model_path=str(tiny))))
    assert sft_spec is not None and sft_spec.precision == "fp32"
    served = await start_engines(BuiltinEngine(), str(tiny), precision="bf16", work_dir=tmp_path)
    chosen = await start_engines(
        BuiltinEngine({"precision": "fp32"}), str(tiny), precision="bf16", work_dir=tmp_path
    )
    try:
        assert served.replicas[0].engine.precision == "bf16"
        assert chosen.replicas[0].engine.precision == "fp32"  # the engine's own option wins
    finally:
        served.stop()
        chosen.stop()
