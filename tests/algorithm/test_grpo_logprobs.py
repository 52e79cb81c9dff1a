"""Chunked log-probs equal the full-logits ones, in value and gradient, and fall back when they must."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from agl.algorithm.policy.logprobs import token_logprobs
from agl.models import tiny_model

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_model()


def _batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 23), generator=gen)
    attention = torch.ones_like(ids)
    attention[1, 17:] = 0  # right padding, as collate makes it
    attention[2, 9:] = 0
    return ids, attention


def _values_and_grads(
    model: PreTrainedModel | PeftModel, chunk_tokens: int | None
) -> tuple[torch.Tensor, ...]:
    model.zero_grad()
    ids, attention = _batch(model.config.vocab_size)
    taken, entropy = token_logprobs(model, ids, attention, chunk_tokens=chunk_tokens)
    weights = torch.linspace(-1, 1, taken.numel()).view_as(taken)  # any loss of the log-probs
    (taken * weights).sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    return (taken.detach(), entropy, *grads)


@pytest.mark.parametrize("chunk_tokens", [7, 64, 10_000])  # ragged chunks, a few, one
def test_chunked_logprobs_and_gradients_equal_the_full_logits_path(tiny: Path, chunk_tokens: int) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True, dtype=torch.float32)
    reference = _values_and_grads(model, chunk_tokens=None)
    chunked = _values_and_grads(model, chunk_tokens=chunk_tokens)
    assert len(chunked) == len(reference) > 2
    for ours, theirs in zip(chunked, reference, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert model(input_ids=_batch(model.config.vocab_size)[0]).logits.shape[-1] == model.config.vocab_size


def test_lora_model_takes_the_chunked_path_with_equal_gradients(tiny: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # init_lora_weights=False draws random adapters: the same ones every run
    base = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True, dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    )
    head = model.get_output_embeddings()
    assert type(head) is torch.nn.Linear  # all-linear leaves the head alone, so the chunked path applies
    for ours, theirs in zip(
        _values_and_grads(model, chunk_tokens=16), _values_and_grads(model, chunk_tokens=None), strict=True
    ):
        # fp32 sums in another order: differences scale with the tensor (random adapters give larger
        # gradients than the plain model's; one element once differed by 1.13e-6 at |grad| ~1e-4)
        scale = float(theirs.abs().max())
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=max(1e-6, 1e-5 * scale))


def test_soft_capped_logits_take_the_full_path() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=0.05,  # small, so skipping it would change every log-prob
    )
    model = Gemma2ForCausalLM(config).eval()
    ids, attention = _batch(config.vocab_size)
    with torch.no_grad():
        taken, _ = token_logprobs(model, ids, attention, chunk_tokens=8)
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(taken, expected)
    model.config.final_logit_softcapping = None
    with torch.no_grad():
        uncapped, _ = token_logprobs(model, ids, attention, chunk_tokens=8)
    assert (uncapped - expected).abs().max() > 1e-3  # the cap matters, so the check above means something
