"""Few-row decode products as ``W @ x.T``: same numbers as ``F.linear``, chosen only on a clear win."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from agl.engines.builtin import Engine, SamplingParams, matmul
from agl.engines.builtin.matmul import MAX_ROWS, use_weight_major_decode, weight_major_gain


def _layer(bias: bool) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(48, 80, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 48), (8, 1, 48), (4, 8, 48), (MAX_ROWS + 1, 48)])
def test_weight_major_products_equal_linear(bias: bool, shape: tuple[int, ...]) -> None:
    layer = _layer(bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = F.linear(x, layer.weight, layer.bias)
        got = matmul._weight_major_forward(layer, x)
    assert got.shape == expected.shape == (*shape[:-1], 80)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_with_gradients_on_it_is_plain_linear() -> None:
    layer = _layer(True)
    x = torch.randn(2, 48, requires_grad=True)
    matmul._weight_major_forward(layer, x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_switches_only_on_a_clear_win(monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Sequential(_layer(False), torch.nn.ReLU(), torch.nn.Linear(80, 16))
    monkeypatch.setattr(matmul, "weight_major_gain", lambda layer, rows=8: 1.1)
    assert not use_weight_major_decode(model)
    assert all("forward" not in m.__dict__ for m in model.modules())
    monkeypatch.setattr(matmul, "weight_major_gain", lambda layer, rows=8: 2.0)
    assert use_weight_major_decode(model)
    assert all("forward" in m.__dict__ for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_the_gain_probe_measures_both_ways() -> None:
    gain = weight_major_gain(_layer(False))
    assert 0.0 < gain < float("inf")


def test_engine_generates_the_same_tokens_either_way(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=16)

    async def generate(engine: Engine) -> list[tuple[list[int], list[float]]]:
        prompts = [engine.encode_chat([{"role": "user", "content": f"Count to {i}."}]) for i in range(5)]
        gens = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
        return [(g.choices[0].token_ids, g.choices[0].logprobs) for g in gens]

    monkeypatch.setattr(matmul, "weight_major_gain", lambda layer, rows=8: 1.0)
    plain = Engine(tiny_path, max_batch_size=8)
    monkeypatch.setattr(matmul, "weight_major_gain", lambda layer, rows=8: 3.0)
    switched = Engine(tiny_path, max_batch_size=8)
    assert switched.weight_major_decode and not plain.weight_major_decode
    a, b = asyncio.run(generate(plain)), asyncio.run(generate(switched))
    for (ids_a, lp_a), (ids_b, lp_b) in zip(a, b, strict=True):
        assert ids_a == ids_b and len(ids_a) > 0
        torch.testing.assert_close(torch.tensor(lp_a), torch.tensor(lp_b), rtol=1e-4, atol=1e-5)
