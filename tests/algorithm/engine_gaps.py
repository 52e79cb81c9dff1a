"""Engine-vs-trainer log-prob gaps on tokens the built-in engine samples (test_grpo_policy, test_precision)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agl.adapter import Sample
from agl.algorithm.policy.logprobs import token_logprobs
from agl.algorithm.policy.model import collate
from agl.compute.precision import autocast


async def engine_logprob_gaps(
    engine: Any, model: Any, pad_id: int, precisions: Sequence[str]
) -> list[torch.Tensor]:
    """|engine logprob - trainer logprob| of each token the engine samples, the trainer computing in each
    of ``precisions`` (``"fp32"`` or ``"bf16"``) on the same tokens."""
    from agl.engines.builtin import SamplingParams

    prompt = engine.encode_chat([{"role": "user", "content": "What is 2 plus 3?"}])
    gen = await engine.generate(prompt, SamplingParams(temperature=1.0, max_tokens=24, n=4, seed=7))
    samples = [
        Sample(
            "r", None, tuple(prompt + c.token_ids), (0,) * len(prompt) + (1,) * len(c.token_ids), None, 0.0
        )
        for c in gen.choices
    ]
    batch = collate(samples, [0.0] * len(samples), [0] * len(samples), pad_id)
    gaps = []
    for precision in precisions:
        with torch.no_grad(), autocast(precision, "cpu"):  # type: ignore[arg-type]
            trainer, _ = token_logprobs(model, batch.input_ids, batch.attention)
        per_choice = []
        for i, choice in enumerate(gen.choices):
            n = len(choice.token_ids)
            assert n == len(choice.logprobs) and n > 0
            span = slice(len(prompt) - 1, len(prompt) - 1 + n)
            per_choice.append((trainer[i, span] - torch.tensor(choice.logprobs)).abs())
        gaps.append(torch.cat(per_choice))
    return gaps
