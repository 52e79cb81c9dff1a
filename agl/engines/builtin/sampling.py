"""Sampling parameters and the per-step sampler.

Logprob convention: the logprob reported for a token is ``log_softmax`` of the model's raw logits at that
position (temperature 1, before top-p), i.e. exactly what a trainer recomputes with a plain forward pass
over prompt + completion ids. Temperature and top-p shape only which token is drawn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from agl.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """What to sample: ``temperature`` 0 is greedy; ``seed`` makes sampling reproducible per choice."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    n: int = 1
    top_logprobs: int = 0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        checks: list[tuple[str, bool, str]] = [
            ("temperature", 0.0 <= self.temperature <= 100.0, "a number in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "a number in (0, 1]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "an integer >= 1"),
            ("n", 1 <= self.n <= 128, "an integer in [1, 128]"),
            (
                "top_logprobs",
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                f"an integer in [0, {MAX_TOP_LOGPROBS}]",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise InvalidRequestError(
                    f"`{name}` must be {expected}, got {getattr(self, name)!r}", param=name
                )


def make_generator(seed: int | None, index: int) -> torch.Generator:
    """A CPU generator per choice: seed + index when seeded (so n choices differ), else fresh entropy."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed + index if seed is not None else random.SystemRandom().randrange(2**63))
    return gen


def _inverse_cdf(probs: torch.Tensor, generators: list[torch.Generator]) -> list[int]:
    """One token per row of ``probs`` [R, V] (unnormalised, >= 0): the first whose cumulative mass passes a
    uniform draw from that row's generator. One batched cumsum instead of a ``torch.multinomial`` per row,
    which took a large share of a SmolLM2 decode step over its 49k vocabulary.
    A token of zero probability is never drawn (``right``: the first cumulative mass strictly above it)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    uniform = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])
    target = (uniform.to(cdf.device) * cdf[:, -1]).unsqueeze(1)
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    return [int(i) for i in ids.tolist()]


@dataclass
class StepSample:
    """One sampled token per row: the id, its raw logprob and optionally the top-k raw logprobs."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def sample_step(
    logits: torch.Tensor,
    temperatures: list[float],
    top_ps: list[float],
    generators: list[torch.Generator],
    top_k_logprobs: list[int],
) -> StepSample:
    """Draw one token per row of ``logits`` [B, V] (any device); logprobs follow the module convention."""
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    sampled_rows = [i for i, t in enumerate(temperatures) if t > 0]
    greedy_rows = [i for i, t in enumerate(temperatures) if t <= 0]
    # each of these is a pass over a (rows x vocabulary) tensor: skipped where it changes nothing
    greedy: dict[int, int] = {}
    if greedy_rows:
        rows = logits if not sampled_rows else logits[torch.tensor(greedy_rows, device=logits.device)]
        greedy = dict(zip(greedy_rows, rows.argmax(dim=-1).tolist(), strict=True))
    if sampled_rows:
        scaled = logits if not greedy_rows else logits[torch.tensor(sampled_rows, device=logits.device)]
        if any(temperatures[i] != 1.0 for i in sampled_rows):
            temps = torch.tensor([temperatures[i] for i in sampled_rows], device=logits.device).unsqueeze(1)
            scaled = scaled / temps
        probs = torch.softmax(scaled, dim=-1)
        top_p = torch.tensor([top_ps[i] for i in sampled_rows], device=logits.device).unsqueeze(1)
        if bool((top_p < 1.0).any()):
            sorted_p, order = probs.sort(dim=-1, descending=True)
            # drop tokens once the mass before them already reaches top_p (the top token always stays)
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        drawn = dict(
            zip(sampled_rows, _inverse_cdf(probs, [generators[i] for i in sampled_rows]), strict=True)
        )
    else:
        drawn = {}
    chosen = [drawn[i] if i in drawn else greedy[i] for i in range(len(temperatures))]
    index = torch.tensor(chosen, device=logits.device).unsqueeze(1)
    logprobs = raw_logprobs.gather(1, index).squeeze(1).tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in chosen]
    k = max(top_k_logprobs, default=0)
    if k > 0:
        values, ids = raw_logprobs.topk(k, dim=-1)
        for i, want in enumerate(top_k_logprobs):
            top[i] = list(zip(ids[i, :want].tolist(), values[i, :want].tolist(), strict=True))
    return StepSample(chosen, logprobs, top)
