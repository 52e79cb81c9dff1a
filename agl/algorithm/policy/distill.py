"""The frozen teacher of on-policy distillation, which scores the student's own tokens: a local folder
loaded beside the policy, or an endpoint (vLLM, ``agl engine serve``) asked for ``prompt_logprobs``.

The teacher reads the student's token ids as they are, so both must map ids to the same strings: a local
teacher's tokenizer is compared on load, an endpoint's decoded tokens on its first reply, and a mismatch
is a ConfigError naming ``GRPOConfig.teacher``.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

import httpx
import torch

from agl.adapter.trajectory import Sample
from agl.errors import ConfigError, TeacherError

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


class EndpointTeacher:
    """A teacher served elsewhere: each sample's tokens scored through ``POST {endpoint}/completions`` with
    ``prompt_logprobs=0`` (vLLM's extension, which ``agl engine serve`` also answers), a few at a time,
    before the step's policy update; the log-probs ride on the samples (``Sample.teacher_logprobs``)."""

    def __init__(
        self,
        endpoint: str,
        model: str,
        tokenizer: Any,
        api_key: str | None = None,
        concurrency: int = 4,
        timeout_s: float = 300.0,
    ) -> None:
        self.endpoint, self.model, self.tokenizer = endpoint.rstrip("/"), model, tokenizer
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.checked = False  # the endpoint's tokens compared with the student's (on its first reply)

    async def score(self, samples: Sequence[Sample]) -> list[Sample]:
        """``samples`` with the teacher's log-prob of each model token (0 on prompt and tool tokens)."""
        gate = asyncio.Semaphore(self.concurrency)
        async with httpx.AsyncClient(headers=self.headers, timeout=self.timeout_s) as client:

            async def one(sample: Sample) -> Sample:
                async with gate:
                    scored = await self._prompt_logprobs(client, list(sample.input_ids))
                mine = tuple(lp if m else 0.0 for lp, m in zip(scored, sample.loss_mask, strict=True))
                return dataclasses.replace(sample, teacher_logprobs=mine)

            if not samples:
                return []
            first = await one(samples[0])  # checks the tokens before the rest are sent
            return [first, *await asyncio.gather(*(one(s) for s in samples[1:]))]

    async def _prompt_logprobs(self, client: httpx.AsyncClient, ids: list[int]) -> list[float]:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
        where = f"the distillation teacher at {self.endpoint}"
        try:
            response = await client.post(f"{self.endpoint}/completions", json=body)
        except httpx.HTTPError as exc:
            raise TeacherError(f"{where} could not be reached: {exc!r}") from exc
        if response.status_code >= 400:
            raise TeacherError(f"{where} answered {response.status_code}: {response.text[:300]}")
        choices = response.json().get("choices") or [{}]
        entries = choices[0].get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(ids):
            raise TeacherError(
                f"{where} returned no prompt_logprobs for the {len(ids)} prompt tokens: on-policy "
                "distillation needs an endpoint that scores prompt tokens (vLLM, or agl engine serve)"
            )
        out, decoded = [0.0], {}
        for token, entry in zip(ids[1:], entries[1:], strict=True):
            found = entry.get(str(token)) if isinstance(entry, dict) else None
            if not isinstance(found, dict) or not isinstance(found.get("logprob"), int | float):
                raise TeacherError(f"{where} gave no log-prob for prompt token {token}: got {entry!r:.200}")
            out.append(float(found["logprob"]))
            decoded[token] = found.get("decoded_token")
        if not self.checked:
            self._check_tokens(decoded)
            self.checked = True
        return out

    def _check_tokens(self, decoded: dict[int, Any]) -> None:
        """A ConfigError unless the endpoint decodes each token id as the student's tokenizer does (ids whose
        text is a partial UTF-8 character are skipped: servers render those differently)."""
        differ = []
        for token, theirs in decoded.items():
            mine = self.tokenizer.decode([token])
            if isinstance(theirs, str) and "\ufffd" not in mine + theirs and theirs != mine:
                differ.append(f"{token}={theirs!r} there, {mine!r} here")
        if differ:
            raise ConfigError(
                f"{FIELD}: the teacher at {self.endpoint} ({self.model}) decodes token ids otherwise than the "
                f"student ({len(differ)} of {len(decoded)} tokens, e.g. {'; '.join(differ[:3])}); on-policy "
                "distillation scores the student's token ids, so it needs a teacher sharing its tokenizer"
            )


__all__ = ["FIELD", "EndpointTeacher", "check_same_tokenizer", "load_teacher"]
