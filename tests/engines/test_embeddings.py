"""The engine's embeddings against a plain recomputation with the model's own ``output_hidden_states``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from agl.engines.builtin import embeddings
from agl.engines.builtin.engine import Engine


async def test_pooled_vectors_equal_the_mean_of_the_last_hidden_layer(
    tiny_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = Engine(tiny_path)
    texts = ["what is the answer", "hello", "the weather in paris is sunny today and tomorrow"]
    inputs = [engine.encode_prompt(t) for t in texts]
    monkeypatch.setattr(embeddings, "_BATCH_TOKENS", 16)  # force several forward passes of mixed lengths
    vectors, version = await engine.embed(inputs)
    assert version == engine.model_version and len(vectors) == 3
    for ids, got in zip(inputs, vectors, strict=True):
        with torch.inference_mode():
            out = engine.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        want = torch.nn.functional.normalize(out.hidden_states[-1][0].mean(dim=0), dim=-1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
