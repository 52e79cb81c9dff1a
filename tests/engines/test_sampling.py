"""The sampler: greedy, seeds, top-p, raw logprobs; and parameter validation."""

from __future__ import annotations

import pytest
import torch

from agl.engines.builtin.sampling import SamplingParams, make_generator, sample_step
from agl.errors import InvalidRequestError


def _logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3, 50) * 3


def test_greedy_and_raw_logprobs() -> None:
    logits = _logits()
    step = sample_step(logits, [0.0] * 3, [1.0] * 3, [make_generator(0, i) for i in range(3)], [0, 2, 0])
    assert step.token_ids == logits.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)
    for row, tid in enumerate(step.token_ids):
        assert step.logprobs[row] == pytest.approx(raw[row, tid].item(), abs=1e-6)
    assert step.top[0] == [] and len(step.top[1]) == 2 and step.top[1][0][0] == step.token_ids[1]


def test_seeded_sampling_repeats_and_logprob_ignores_temperature() -> None:
    logits = _logits()

    def draw(seed: int, temp: float) -> list[int]:
        gens = [make_generator(seed, i) for i in range(3)]
        return [sample_step(logits, [temp] * 3, [1.0] * 3, gens, [0] * 3).token_ids[0] for _ in range(20)]

    assert draw(7, 1.0) == draw(7, 1.0)
    assert draw(7, 1.0) != draw(8, 1.0)
    step = sample_step(logits, [5.0] * 3, [1.0] * 3, [make_generator(1, i) for i in range(3)], [0] * 3)
    raw = torch.log_softmax(logits, -1)
    assert step.logprobs[0] == pytest.approx(raw[0, step.token_ids[0]].item(), abs=1e-6)


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = _logits()
    gens = [make_generator(None, i) for i in range(3)]
    for _ in range(10):
        step = sample_step(logits, [2.0] * 3, [1e-6] * 3, gens, [0] * 3)
        assert step.token_ids == logits.argmax(-1).tolist()


def test_draws_follow_the_tempered_distribution_and_skip_masked_tokens() -> None:
    """Frequencies over 4,000 draws per row match softmax(logits / T) within 4 standard errors; a token
    top-p removed (the least likely of three) is never drawn."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.1, 0.6, 0.3, 0.0]]))
    gens = [make_generator(3, i) for i in range(2)]
    counts = torch.zeros(2, 4)
    draws = 4000
    for _ in range(draws):
        step = sample_step(logits, [1.0, 1.0], [1.0, 0.85], gens, [0, 0])
        for row, token in enumerate(step.token_ids):
            counts[row, token] += 1
    expected = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.6 / 0.9, 0.3 / 0.9, 0.0]])
    error = 4 * (expected * (1 - expected) / draws).sqrt()
    assert ((counts / draws - expected).abs() <= error + 1e-9).all(), counts
    assert counts[:, 3].sum() == 0 and counts[1, 0] == 0  # zero mass; row 1's top-p of 0.85 cuts token 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("top_p", 0.0),
        ("max_tokens", 0),
        ("n", 0),
        ("top_logprobs", 21),
        ("stop", [""]),
    ],
)
def test_validation_names_the_field(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match=field) as info:
        params.validate()
    assert info.value.param == field
