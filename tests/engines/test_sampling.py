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
