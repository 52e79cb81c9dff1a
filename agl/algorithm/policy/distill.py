"""The frozen teacher of on-policy distillation, loaded beside the policy to score the student's own tokens.

The teacher reads the student's token ids as they are, so both must map ids to the same strings: the
tokenizers are compared on load and a mismatch is a ConfigError naming ``GRPOConfig.teacher``.
"""

from __future__ import annotations

from typing import Any

import torch

from agl.errors import ConfigError

FIELD = "GRPOConfig.teacher"


def check_same_tokenizer(student: Any, teacher: Any, teacher_path: str) -> None:
    """Raise a ConfigError naming ``GRPOConfig.teacher`` unless ``teacher`` gives every token id the same
    string as ``student`` (its scores would be for other tokens). Special-token settings (a base model's
    end-of-text against its instruct sibling's end-of-turn) may differ: the ids are scored as they are."""
    mine, theirs = student.get_vocab(), teacher.get_vocab()
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        example = ", ".join(f"{token!r}={index}" for token, index in differ[:3])
        raise ConfigError(
            f"{FIELD}: the teacher at {teacher_path} has another tokenizer than the student "
            f"({len(mine)} vs {len(theirs)} tokens, {len(differ)} (token, id) pairs held by one only, "
            f"e.g. {example}); on-policy distillation scores the student's token ids under the teacher, "
            "so it needs a teacher that shares the student's tokenizer (e.g. a larger model of its family)"
        )


def load_teacher(path: str, student_tokenizer: Any, device: torch.device) -> Any:
    """The teacher at ``path`` as a frozen fp32 causal LM on ``device``, after the tokenizer check."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{FIELD}: no tokenizer could be read from the teacher folder {path!r} ({e}); distillation "
            "needs a local Hugging Face folder (Teacher(path=...)) that shares the student's tokenizer"
        ) from e
    check_same_tokenizer(student_tokenizer, tokenizer, path)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    size = model.get_output_embeddings().weight.shape[0]
    if size < len(student_tokenizer):
        raise ConfigError(
            f"{FIELD}: the teacher at {path} scores {size} token ids, the student's tokenizer has "
            f"{len(student_tokenizer)}; distillation needs a teacher that covers every student token"
        )
    model.requires_grad_(False)
    return model.eval().to(device)


__all__ = ["FIELD", "check_same_tokenizer", "load_teacher"]
