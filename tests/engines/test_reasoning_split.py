"""Splitting a thinking model's reply into reasoning and content: on text the real tokenizer decodes from
real token ids, whole or streamed in any pieces, and only for models that think."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agl.engines.builtin.reasoning import ReasoningStream, opens_thinking, reasoning_tags, split_reasoning


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from agl.models import tiny_model

    return AutoTokenizer.from_pretrained(tiny_model(cache_dir=tmp_path_factory.mktemp("m"), thinking=True))


def _stream(text_pieces: list[str], inside: bool = False) -> tuple[str, str]:
    splitter, reasoning, content = ReasoningStream(inside), "", ""
    for i, piece in enumerate(text_pieces):
        r, c = splitter.feed(piece, final=i == len(text_pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


def test_split_of_decoded_ids_whole_and_token_by_token(tokenizer: Any) -> None:
    ids = tokenizer("<think>\nso 2 + 3 = 5\n</think>\n\n5", add_special_tokens=False)["input_ids"]
    tags = reasoning_tags(tokenizer)
    assert tags is not None and ids[0] == tags[0] and tags[1] in ids
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert split_reasoning(text) == ("so 2 + 3 = 5", "5")
    # streamed as the engine streams: each token's text as it decodes, so the tags arrive whole or not
    pieces = [tokenizer.decode(ids[: i + 1], skip_special_tokens=True) for i in range(len(ids))]
    deltas = [b[len(a) :] for a, b in zip(["", *pieces], pieces, strict=False)]
    assert _stream(deltas) == ("so 2 + 3 = 5", "5")
    assert _stream(list(text)) == ("so 2 + 3 = 5", "5")  # tags cut anywhere, one character at a time


@pytest.mark.parametrize(
    ("text", "inside", "expected"),
    [
        ("just an answer", False, (None, "just an answer")),
        ("  <think>\nhm\n</think>\n\nok", False, ("hm", "ok")),
        ("<think>\nstill thinking when cut", False, ("still thinking when cut", "")),
        ("hm\n</think>\n\nok", True, ("hm", "ok")),  # the prompt opened the block
        ("<thin", False, (None, "<thin")),
        ("<think>\n\n</think>\n\nok", False, ("", "ok")),
    ],
)
def test_split_cases_whole_and_streamed(text: str, inside: bool, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, inside) == expected
    assert _stream(list(text), inside) == (expected[0] or "", expected[1])


def test_only_models_that_think_split(tokenizer: Any, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from agl.models import tiny_model

    plain = AutoTokenizer.from_pretrained(tiny_model(cache_dir=tmp_path))  # ChatML: no think tokens
    assert reasoning_tags(plain) is None
    tags = reasoning_tags(tokenizer)
    assert tags is not None
    ids = tokenizer("<|im_start|>assistant\n<think>\n", add_special_tokens=False)["input_ids"]
    assert opens_thinking(ids, tags)
    closed = tokenizer("<|im_start|>assistant\n<think>\n\n</think>\n\n", add_special_tokens=False)[
        "input_ids"
    ]
    assert not opens_thinking(closed, tags)
