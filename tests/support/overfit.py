"""A tiny model taught exact replies: a few seconds of Adam on (prompt, reply) token sequences, so tests
get a real model that says what they need (a tool call in a given spelling) through the real engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def overfit_replies(
    base: Path, out: Path, examples: list[tuple[list[dict[str, Any]], str]], tools: list[dict[str, Any]]
) -> Path:
    """``base`` overfitted to answer each example's chat messages (rendered with ``tools``) with its text
    followed by EOS, saved with its tokenizer in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Any, as Engine.tokenizer is: HF's stubs type chat messages as str-only dicts
    tok: Any = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    batch: list[tuple[torch.Tensor, torch.Tensor]] = []
    for messages, reply in examples:
        prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        c_ids = tok(reply, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([p_ids + c_ids])
        labels = ids.clone()
        labels[0, : len(p_ids)] = -100
        batch.append((ids, labels))
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs many times faster on one thread of a busy machine
    try:
        for _ in range(400):
            losses = [model(input_ids=ids, labels=labels).loss for ids, labels in batch]
            loss = torch.stack(losses).mean()
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # no spikes: converges in ~150 steps
            opt.step()
            if max(x.item() for x in losses) < 0.002:
                break
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
