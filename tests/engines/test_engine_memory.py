"""The built-in engine keeps its KV cache within a budget: sequences wait rather than overrun it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agl.engines.builtin import Engine, SamplingParams
from agl.engines.builtin.batch import kv_bytes_per_token
from agl.errors import ConfigError


async def test_a_kv_cache_budget_bounds_the_sequences_decoded_together(tiny_path: Path) -> None:
    free = Engine(tiny_path, max_batch_size=32)
    per_token = kv_bytes_per_token(free.model.config, free.model.dtype)
    config = free.model.config
    assert per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    prompt = free.encode_chat([{"role": "user", "content": "Count to ten."}])
    params = SamplingParams(temperature=1.0, max_tokens=16, seed=1)
    # room for two sequences of this prompt plus 16 tokens, not three
    budget_gb = 2.5 * (len(prompt) + 16) * per_token / 1024**3
    bounded = Engine(tiny_path, max_batch_size=32, kv_cache_gb=budget_gb, prefix_cache_share=0)
    assert bounded.kv_cache_tokens == int(budget_gb * 1024**3 // per_token)
    # with a prefix cache, it and the running sequences share the budget
    shared = Engine(tiny_path, kv_cache_gb=budget_gb, prefix_cache_share=0.25)
    assert shared.prefix_cache is not None
    assert shared.kv_cache_tokens + shared.prefix_cache.max_tokens == bounded.kv_cache_tokens

    async def run(engine: Engine) -> list[list[int]]:
        gens = await asyncio.gather(*(engine.generate(prompt, params) for _ in range(6)))
        return [g.choices[0].token_ids for g in gens]

    assert await run(bounded) == await run(free)  # the same tokens, only scheduled differently
    assert free.peak_batch_size == 6
    assert bounded.peak_batch_size == 2
    # a request alone over the budget still runs (on its own) rather than waiting forever
    tight = Engine(tiny_path, kv_cache_gb=per_token / 1024**3)
    gen = await tight.generate(prompt, SamplingParams(max_tokens=4, n=2, seed=1))
    assert len(gen.choices) == 2 and tight.peak_batch_size == 2
    with pytest.raises(ConfigError, match="kv_cache_gb"):
        Engine(tiny_path, kv_cache_gb=0)
