"""The lean decode step: the same logits and samples as the model's own forward, or not used at all."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from agl.engines.builtin import Engine, SamplingParams, lean_decode
from agl.engines.builtin.lean_decode import lean_decode_step, make_decode_step


def _llama(kv_heads: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_llama_steps_match_the_models_forward(kv_heads: int) -> None:
    """Three decode steps of a left-padded batch, lean and generic, from one prefill: equal logits."""
    from transformers import DynamicCache

    model = _llama(kv_heads)
    step = lean_decode_step(model)
    assert step is not None
    ids = torch.randint(0, 300, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    mask[2, :7] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, cache=cache)
        token, pos = ids[:, -1], positions[:, -1] + 1
        for _ in range(3):
            mask = torch.cat([mask, mask.new_ones((3, 1))], dim=1)
            want = model(
                input_ids=token.unsqueeze(1),
                attention_mask=mask,
                position_ids=pos.unsqueeze(1),
                use_cache=True,
                cache=caches[0],
            ).logits[:, -1]
            got = step(token, pos, mask, caches[1])
            assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
            token, pos = want.argmax(-1), pos + 1
    layers: list[Any] = [list(cache.layers) for cache in caches]  # DynamicLayer: keys and values
    for a, b in zip(*layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


async def test_engine_samples_the_same_with_and_without_it(tiny_path: Path) -> None:
    """The tiny Qwen2 model through the engine: continuous batching of prompts of different lengths gives
    the same tokens and logprobs either way."""
    lean = Engine(tiny_path, precision="fp32", prefix_cache_share=0)
    plain = Engine(tiny_path, precision="fp32", prefix_cache_share=0, lean_decode=False)
    assert lean.decode_step is not None and plain.decode_step is None
    prompts = [lean.encode_chat([{"role": "user", "content": "Count " + "to ten " * i}]) for i in range(5)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=6 + 4 * i) for i in range(5)]
    got, want = [
        await asyncio.gather(*(e.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))
        for e in (lean, plain)
    ]
    for g, w in zip(got, want, strict=True):
        assert g.choices[0].token_ids == w.choices[0].token_ids
        assert g.choices[0].logprobs == pytest.approx(w.choices[0].logprobs, abs=1e-4)


def test_unsupported_or_disagreeing_models_keep_their_forward(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=100, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    assert lean_decode_step(gpt2) is None
    model = _llama(2)

    def off_by_a_little(model: Any) -> lean_decode.DecodeStep:
        step = make_decode_step(model)
        return lambda *args: step(*args) + 0.5

    monkeypatch.setattr(lean_decode, "make_decode_step", off_by_a_little)
    with caplog.at_level(logging.WARNING, logger=lean_decode.__name__):
        assert lean_decode_step(model) is None
    assert "differs from the model's forward" in caplog.text
