"""A tiny random Qwen2 causal LM with a locally trained byte-level BPE tokenizer, for fast tests.

The tokenizer knows digits, arithmetic, chat words and ``<tool_call>`` markup; the chat template is ChatML
with tools and tool-call / tool-result messages. ``thinking=True`` builds a reasoning-model variant: ``<think>``
and ``</think>`` are single (non-special) tokens and the chat template is Qwen3's real one. Everything is
deterministic by seed and built in seconds.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from agl.models.cache import build_once, cache_root
from agl.models.chatml import CHAT_TEMPLATE
from agl.models.qwen3 import QWEN3_CHAT_TEMPLATE

logger = logging.getLogger(__name__)

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_WORDS = [
    "the",
    "a",
    "an",
    "is",
    "are",
    "was",
    "what",
    "how",
    "why",
    "who",
    "when",
    "where",
    "which",
    "answer",
    "question",
    "solve",
    "compute",
    "add",
    "subtract",
    "multiply",
    "divide",
    "plus",
    "minus",
    "times",
    "equals",
    "sum",
    "result",
    "number",
    "digit",
    "hello",
    "hi",
    "thanks",
    "please",
    "sure",
    "yes",
    "no",
    "you",
    "I",
    "we",
    "it",
    "assistant",
    "user",
    "system",
    "tool",
    "function",
    "call",
    "arguments",
    "name",
    "weather",
    "city",
    "today",
    "calculator",
    "search",
    "query",
    "value",
    "true",
    "false",
    "null",
    "step",
    "think",
    "so",
    "therefore",
    "because",
    "first",
    "then",
    "finally",
]
_TOOLS = ("get_weather", "calculator", "search", "lookup")


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    """Generated training text: arithmetic, chat turns and tool-call markup."""
    rng = random.Random(seed)
    out: list[str] = [
        " ".join(str(i) for i in range(100)),
        " ".join(_WORDS),
        "+ - * / = ( ) { } [ ] : , . ? !",
    ]
    for _ in range(lines):
        kind = rng.randrange(4)
        a, b = rng.randrange(1000), rng.randrange(1000)
        if kind == 0:
            op = rng.choice("+-*")
            out.append(f"What is {a} {op} {b}? {a} {op} {b} = {eval(f'{a}{op}{b}')}")
        elif kind == 1:
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(3, 12)))
            role = rng.choice(["user", "assistant", "system", "tool"])
            out.append(f"{IM_START}{role}\n{words.capitalize()}.{IM_END}\n")
        elif kind == 2:
            name = rng.choice(_TOOLS)
            out.append(
                f'<tool_call>{{"name": "{name}", "arguments": {{"x": {a}, "city": "Paris"}}}}</tool_call>'
            )
        else:
            out.append(f'{{"name": "{rng.choice(_TOOLS)}", "arguments": {{"expression": "{a} + {b}"}}}}')
    return out


def _build_tokenizer(seed: int, vocab_size: int, thinking: bool = False) -> object:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if thinking:  # as in Qwen3: whole tokens, yet not special, so decoded text keeps them
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in (THINK_OPEN, THINK_CLOSE)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token=IM_END, pad_token=PAD, unk_token=None
    )
    fast.chat_template = QWEN3_CHAT_TEMPLATE if thinking else CHAT_TEMPLATE
    return fast


def _build(out: Path, seed: int, vocab_size: int, thinking: bool = False) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = _build_tokenizer(seed, vocab_size, thinking)
    tokenizer.save_pretrained(out)  # type: ignore[attr-defined]
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)  # type: ignore[attr-defined]
    pad_id = tokenizer.convert_tokens_to_ids(PAD)  # type: ignore[attr-defined]
    config = Qwen2Config(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,  # type: ignore[call-arg]
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id)
    model.save_pretrained(out)
    logger.info("built tiny model (seed %d) in %s", seed, out)


def tiny_model(
    seed: int = 0, cache_dir: str | Path | None = None, vocab_size: int = 1024, *, thinking: bool = False
) -> Path:
    """Path of the tiny model for ``seed``, building it (a few seconds) unless already cached.

    ``thinking``: the reasoning variant (``<think>``/``</think>`` tokens, Qwen3's chat template).
    Loads with ``AutoModelForCausalLM.from_pretrained(path)`` and ``AutoTokenizer.from_pretrained(path)``.
    """
    suffix = ("" if vocab_size == 1024 else f"-v{vocab_size}") + ("-think" if thinking else "")
    target = cache_root(cache_dir) / f"tiny-s{seed}{suffix}"
    return build_once(target, lambda out: _build(out, seed, vocab_size, thinking))
