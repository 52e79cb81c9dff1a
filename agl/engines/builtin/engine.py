"""The built-in inference engine: an async, continuously batching generator over a local HF causal LM.

Requests are queued; one scheduler task admits them into the running batch between decode steps and runs
the model on a worker thread. Responses carry exact prompt/completion token ids, raw logprobs (see
:mod:`agl.engines.builtin.sampling`) and the ``model_version`` of the weights that produced them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agl.compute.memory import release_free_memory
from agl.compute.precision import resolve_precision
from agl.compute.thread import run_compute
from agl.engines.builtin.batch import RunningBatch, Sequence, cache_tokens, kv_bytes_per_token
from agl.engines.builtin.embeddings import pooled
from agl.engines.builtin.lean_decode import lean_decode_step
from agl.engines.builtin.matmul import use_weight_major_decode
from agl.engines.builtin.prefix_cache import PrefixCache
from agl.engines.builtin.prompts import render_chat
from agl.engines.builtin.reasoning import reasoning_tags
from agl.engines.builtin.sampling import SamplingParams, make_generator
from agl.engines.builtin.tools import parse_tool_calls
from agl.engines.builtin.weights import is_lora_dir, load_full, merge_lora, read_state_dict
from agl.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

#: positions whose log-softmax is taken at once when scoring a prompt (rows x vocabulary floats)
PROMPT_LOGPROB_ROWS = 256
#: one scored prompt token: its log-prob, its rank among the vocabulary, and its position's likeliest (id, logprob)
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass
class Choice:
    """One finished completion. ``token_ids`` include a generated EOS; ``text`` is cut before a stop string."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str  # "stop" | "length" | "tool_calls"
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Generation:
    """The answer to one request: exact prompt ids, its ``n`` choices, and the weights version used."""

    prompt_token_ids: list[int]
    choices: list[Choice]
    model_version: str
    created: int = field(default_factory=lambda: int(time.time()))


@dataclass
class StreamDelta:
    """New output of one choice since the previous delta (text held back while it may start a stop string)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    tools: list[dict[str, Any]] | None
    future: asyncio.Future[Generation]
    queue: asyncio.Queue[StreamDelta] | None = None
    seqs: list[Sequence] = field(default_factory=list)


class Engine:
    """``Engine(path)`` loads a local HF model folder; ``await engine.generate(ids, params)`` samples from it.

    ``precision``: ``"bf16"`` serves fp32 weights as bf16 (pushed fp32 weights are cast on load), ``"fp32"``
    keeps ``dtype``, ``"auto"`` is bf16 on a CPU with native bf16 (else fp32, or ``AGL_PRECISION``), resolved
    as the trained policy resolves it (:mod:`agl.compute.precision`).
    ``max_batch_size`` bounds the sequences decoded together, and ``kv_cache_gb`` their KV cache and the
    prefix cache together (None: a quarter of the process's memory budget, :mod:`agl.compute.memory`,
    which a trainer in the same process shares); ``default_max_tokens`` applies when a request sets none; an idle engine waits
    ``batch_wait_s`` after the first request so a burst is prefilled at once. ``prefix_cache_share``: the
    part of the KV budget that keeps finished sequences, so that an agent's next turn (or a sibling with the
    same system prompt) prefills only what is new (:mod:`.prefix_cache`; 0 turns it off). ``lean_decode``:
    Llama-family models decode one token per row through their own modules without the generic forward's
    per-call work (:mod:`.lean_decode`; checked against that forward at load). Never contacts a model hub
    (``local_files_only=True``).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        default_max_tokens: int = 256,
        model_name: str | None = None,
        batch_wait_s: float = 0.005,
        kv_cache_gb: float | None = None,
        precision: str = "auto",
        prefix_cache_share: float = 0.25,
        lean_decode: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{path} is not a local Hugging Face model folder (no config.json); pass a folder written by "
                "save_pretrained, e.g. agl.models.tiny_model() or agl.models.smollm2()"
            )
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ConfigError(
                f"dtype must be a torch dtype name such as 'float32' or 'bfloat16', got {dtype!r}"
            )
        self.precision = resolve_precision(precision, device)  # "auto": as the policy resolves it
        if self.precision == "bf16" and torch_dtype == torch.float32:
            # bf16 weights rather than autocast per step: autocast would re-cast every weight at every
            # decode step (generation on SmolLM2 slower than fp32 that way, faster with bf16 weights)
            torch_dtype = torch.bfloat16
        self.path = path
        self.model_name = model_name or path.name
        self.tokenizer: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        # a thinking model's <think>/</think> ids: chat replies then split the thinking off (.reasoning)
        self.reasoning_tags = reasoning_tags(self.tokenizer)
        self.model: Any = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch_dtype)
        self.model.to(device)  # type: ignore[arg-type]
        self.model.eval()
        # decode multiplies a few rows by every weight: some BLASes do that far faster as W @ x.T
        self.weight_major_decode = use_weight_major_decode(self.model)
        # a Llama-family model decodes through its own modules without the generic forward's per-call work
        self.decode_step = lean_decode_step(self.model) if lean_decode else None
        self.device = device
        self.max_batch_size = max_batch_size
        self.default_max_tokens = default_max_tokens
        self.batch_wait_s = batch_wait_s
        self.max_model_len = max_model_len or int(getattr(self.model.config, "max_position_embeddings", 2048))
        kv_tokens = self._kv_cache_tokens(kv_cache_gb, torch_dtype)
        if not 0 <= prefix_cache_share < 1:
            raise ConfigError(f"prefix_cache_share must be in [0, 1), got {prefix_cache_share}")
        # a sliding-window layer keeps only its window, so a stored prefix could not be handed back whole
        config = self.model.config
        sliding = any("sliding" in str(t) for t in getattr(config, "layer_types", None) or []) or (
            getattr(config, "sliding_window", None) is not None
            and getattr(config, "use_sliding_window", True)
        )
        self.prefix_cache = (
            PrefixCache(int(kv_tokens * prefix_cache_share))
            if prefix_cache_share > 0 and not sliding
            else None
        )
        # the running batch gets the rest of the budget: both together stay within kv_cache_gb
        self.kv_cache_tokens = max(
            1, kv_tokens - (self.prefix_cache.max_tokens if self.prefix_cache is not None else 0)
        )
        self.peak_batch_size = 0  # the most sequences decoded together so far
        self.eos_ids = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids))
        self.model_version = "v0"
        self._versions = 0
        self._base_state: dict[str, torch.Tensor] | None = None
        self._pending: list[_Request] = []
        self._task: asyncio.Task[None] | None = None
        self._updating = False
        # weight updates, releases and the one-pass requests (embed, prompt_logprobs) take turns
        self._update_lock = asyncio.Lock()
        # set while the model has weights; cleared by release_weights until the next full-weight update
        self._loaded = asyncio.Event()
        self._loaded.set()
        self._released: dict[str, tuple[torch.Size, torch.dtype]] | None = None

    def _kv_cache_tokens(self, kv_cache_gb: float | None, dtype: torch.dtype) -> int:
        from agl.compute.memory import ENGINE_SHARE, budget_bytes

        if kv_cache_gb is not None and kv_cache_gb <= 0:
            raise ConfigError(f"kv_cache_gb must be > 0, got {kv_cache_gb}")
        budget = (
            kv_cache_gb * 1024**3
            if kv_cache_gb is not None
            else ENGINE_SHARE * budget_bytes(self.device, None)
        )
        return max(1, int(budget // kv_bytes_per_token(self.model.config, dtype)))

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, list):
                ids.update(int(i) for i in source)
        if not ids:
            raise ConfigError(f"{self.path} defines no eos token; set eos_token in its tokenizer_config.json")
        return ids

    # ----- prompts -------------------------------------------------------------------------------
    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of ``messages`` (and ``tools``) rendered with the model's chat template, which gets
        ``template_kwargs`` too (a request's ``chat_template_kwargs``)."""
        return render_chat(self.tokenizer, messages, tools, template_kwargs)

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a text prompt (no special tokens added), or the ids themselves after a range check."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        vocab = int(self.model.config.vocab_size)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {vocab}), got {bad[:5]}", param="prompt"
            )
        return list(prompt)

    # ----- generation ----------------------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, tools: list[dict[str, Any]] | None = None
    ) -> Generation:
        """Sample ``params.n`` completions of ``prompt_ids``; tool calls are parsed when ``tools`` is given."""
        request = self._submit(prompt_ids, params, tools, stream=False)
        return await request.future

    def stream(
        self, prompt_ids: list[int], params: SamplingParams, *, tools: list[dict[str, Any]] | None = None
    ) -> AsyncIterator[StreamDelta | Generation]:
        """Queue the request now (bad input raises here), then yield deltas and finally the :class:`Generation`."""
        return self._iterate(self._submit(prompt_ids, params, tools, stream=True))

    async def _iterate(self, request: _Request) -> AsyncIterator[StreamDelta | Generation]:
        assert request.queue is not None
        waiter: asyncio.Future[StreamDelta] | None = None
        try:
            while True:
                waiter = asyncio.ensure_future(request.queue.get())
                waitables: list[asyncio.Future[Any]] = [waiter, request.future]
                await asyncio.wait(waitables, return_when=asyncio.FIRST_COMPLETED)
                if waiter.done():
                    yield waiter.result()
                    continue
                waiter.cancel()
                while not request.queue.empty():
                    yield request.queue.get_nowait()
                yield request.future.result()
                return
        finally:
            if waiter is not None and not waiter.done():
                waiter.cancel()
            if not request.future.done():  # the consumer stopped early: stop decoding its sequences
                request.future.cancel()

    def _submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        tools: list[dict[str, Any]] | None,
        *,
        stream: bool,
    ) -> _Request:
        params.validate()
        room = self.check_prompt(prompt_ids)
        loop = asyncio.get_running_loop()
        request = _Request(
            list(prompt_ids), params, tools, loop.create_future(), asyncio.Queue() if stream else None
        )
        max_tokens = min(params.max_tokens or self.default_max_tokens, room)
        request.seqs = [
            Sequence(request, i, request.prompt_ids, params, max_tokens, make_generator(params.seed, i), "")
            for i in range(params.n)
        ]
        self._pending.append(request)
        self._ensure_running()
        return request

    def check_prompt(self, prompt_ids: list[int], param: str = "prompt") -> int:
        """Raise InvalidRequestError (naming ``param``) unless the prompt fits; return the tokens left."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token", param=param)
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens, the model's context is {self.max_model_len}; "
                "shorten the prompt",
                param=param,
            )
        return room

    def _ensure_running(self) -> None:
        if (self._task is None or self._task.done()) and self._pending and not self._updating:
            self._task = asyncio.get_running_loop().create_task(self._schedule())

    async def _schedule(self) -> None:
        batch = RunningBatch(self.model, self.pad_id, self._on_token, self.prefix_cache, self.decode_step)
        if self.batch_wait_s > 0:
            # requests sent together over HTTP arrive a few ms apart: one prefill for all of them is cheaper
            await asyncio.sleep(self.batch_wait_s)
        while True:
            admit: list[Sequence] = []
            while self._pending and not self._updating:
                room = self.max_batch_size - len(batch.seqs) - len(admit)
                over_kv = cache_tokens(batch.seqs + admit + self._pending[0].seqs) > self.kv_cache_tokens
                if (len(self._pending[0].seqs) > room or over_kv) and (batch.seqs or admit):
                    break  # waits for running sequences to finish (a request alone is always admitted)
                request = self._pending.pop(0)
                for seq in request.seqs:
                    seq.version = self.model_version
                admit.extend(request.seqs)
            if not admit and not batch.seqs:
                break
            self.peak_batch_size = max(self.peak_batch_size, len(batch.seqs) + len(admit))
            try:
                finished = await run_compute(self._step, batch, admit)
            except Exception as exc:  # a failed forward pass fails its batch, never hangs the callers
                logger.exception("engine step failed")
                for seq in batch.seqs + admit:
                    if not seq.request.future.done():
                        seq.request.future.set_exception(exc)
                batch = RunningBatch(
                    self.model, self.pad_id, self._on_token, self.prefix_cache, self.decode_step
                )
                continue
            self._deliver(batch.seqs + finished)
        self._task = None

    def _step(self, batch: RunningBatch, admit: list[Sequence]) -> list[Sequence]:
        with torch.inference_mode():
            if admit:
                batch.add(admit)
            else:
                batch.decode()
            return batch.prune()

    def _on_token(self, seq: Sequence) -> None:
        """Decide whether ``seq`` just finished (EOS, stop string, max_tokens) and keep its text current."""
        if seq.request.future.cancelled():  # the caller went away (e.g. an HTTP client disconnected)
            seq.finish_reason = "abort"
            return
        last = seq.token_ids[-1]
        ids = seq.token_ids[:-1] if last in self.eos_ids else seq.token_ids
        if seq.params.stop or seq.request.queue is not None or last in self.eos_ids:
            seq.text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if last in self.eos_ids:
            seq.finish_reason = "stop"
            return
        for stop in seq.params.stop:
            cut = seq.text.find(stop)
            if cut >= 0:
                seq.text, seq.finish_reason = seq.text[:cut], "stop"
                return
        if len(seq.token_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
            if not (seq.params.stop or seq.request.queue is not None):
                seq.text = self.tokenizer.decode(ids, skip_special_tokens=True)

    def _deliver(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            request = seq.request
            if request.queue is not None:
                self._push_delta(seq)
            done = seq.finish_reason is not None and not request.future.done()
            if done and all(s.finish_reason is not None for s in request.seqs):
                try:
                    request.future.set_result(self._result(request))
                except Exception as exc:  # one bad request must not stop the scheduler serving the others
                    logger.exception("building a response failed")
                    request.future.set_exception(exc)

    def _push_delta(self, seq: Sequence) -> None:
        assert seq.request.queue is not None
        if seq.finish_reason is not None:
            safe = len(seq.text)
        else:
            hold = max((len(s) - 1 for s in seq.params.stop), default=0)
            safe = max(seq.streamed_chars, len(seq.text) - hold)
            while safe > seq.streamed_chars and seq.text[safe - 1] == "\ufffd":  # an incomplete UTF-8 char
                safe -= 1
        new_ids = seq.token_ids[seq.streamed_tokens :]
        if not new_ids and safe == seq.streamed_chars:
            return
        delta = StreamDelta(
            seq.index,
            seq.text[seq.streamed_chars : safe],
            new_ids,
            seq.logprobs[seq.streamed_tokens :],
            seq.finish_reason,
        )
        seq.streamed_tokens, seq.streamed_chars = len(seq.token_ids), safe
        seq.request.queue.put_nowait(delta)

    def _result(self, request: _Request) -> Generation:
        choices = []
        for seq in request.seqs:
            choice = Choice(
                seq.index, seq.text, seq.token_ids, seq.logprobs, seq.top, seq.finish_reason or "stop"
            )
            choice.content = seq.text
            if request.tools:
                parsed = parse_tool_calls(seq.text, request.tools)
                if parsed.tool_calls:
                    choice.content, choice.tool_calls, choice.finish_reason = (
                        parsed.content,
                        parsed.tool_calls,
                        "tool_calls",
                    )
            choices.append(choice)
        return Generation(request.prompt_ids, choices, request.seqs[0].version)

    # ----- embeddings ----------------------------------------------------------------------------
    async def embed(self, inputs: list[list[int]]) -> tuple[list[torch.Tensor], str]:
        """Embeddings of token-id inputs (see :mod:`.embeddings`) and the weights version that made them.

        Runs on its own worker thread beside decoding; a weight update waits for it, and it for an update.
        """
        async with self._weights_held():
            version = self.model_version
            vectors = await run_compute(self._embed, inputs)
        return vectors, version

    def _embed(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        with torch.inference_mode():
            return pooled(self.model, inputs, self.pad_id)

    async def prompt_logprobs(self, ids: list[int], top: int = 0) -> list[PromptLogprob]:
        """Each prompt token after the first scored under the model: ``(logprob, rank, top)`` with the
        position's ``top`` likeliest ``(id, logprob)``. One forward pass beside decoding, like ``embed``."""
        async with self._weights_held():
            return await run_compute(self._prompt_logprobs, ids, top)

    def _prompt_logprobs(self, ids: list[int], top: int) -> list[PromptLogprob]:
        out: list[PromptLogprob] = []
        with torch.inference_mode():
            tokens = torch.tensor([ids], device=self.device)
            logits = self.model(input_ids=tokens).logits[0, :-1]  # (T-1, V): position t predicts t+1
            for start in range(0, logits.shape[0], PROMPT_LOGPROB_ROWS):  # bounds the fp32 copy
                rows = logits[start : start + PROMPT_LOGPROB_ROWS].float().log_softmax(-1)
                wanted = tokens[0, start + 1 : start + 1 + rows.shape[0]]
                taken = rows.gather(1, wanted.unsqueeze(1)).squeeze(1)
                ranks = ((rows > taken.unsqueeze(1)).sum(1) + 1).tolist()
                lps_top, ids_top = rows.topk(top, dim=1) if top else (None, None)
                tops = (
                    [
                        list(zip(i, v, strict=True))
                        for i, v in zip(ids_top.tolist(), lps_top.tolist(), strict=True)
                    ]
                    if ids_top is not None and lps_top is not None
                    else [[] for _ in ranks]
                )
                out += list(zip(taken.tolist(), ranks, tops, strict=True))
        return out

    # ----- weights -------------------------------------------------------------------------------
    async def update_weights(
        self,
        source: dict[str, torch.Tensor] | str | Path,
        version: str | None = None,
        *,
        lora: bool | None = None,
    ) -> str:
        """Load full weights (state dict or folder) or a LoRA adapter folder; returns the new version.

        Requests already decoding finish on the old weights first; queued ones run on the new weights.
        """
        async with self._update_lock:
            self._updating = True
            try:
                if self._task is not None and not self._task.done():
                    await asyncio.shield(self._task)
                await run_compute(self._load, source, lora)
                self._loaded.set()
                self._versions += 1
                self.model_version = version or f"v{self._versions}"
                logger.info("engine weights updated to %s", self.model_version)
            finally:
                # after a release, a failed load leaves no usable weights: requests wait for one that works
                self._updating = not self._loaded.is_set()
                self._ensure_running()
        return self.model_version

    @contextlib.asynccontextmanager
    async def _weights_held(self) -> AsyncIterator[None]:
        """The update lock, taken once the model has weights (after a release, the next update's)."""
        while True:
            await self._loaded.wait()
            async with self._update_lock:
                if self._loaded.is_set():
                    yield
                    return

    async def release_weights(self) -> None:
        """Free the model's weights until the next full-weight update, and hand free memory back to the OS.

        A synchronous trainer in this process calls it before its policy update, whose new weights replace
        these anyway: the update's peak then has the copy's memory (0.5 GB for a 135M model in fp32).
        Requests that arrive meanwhile wait for the update; the prefix cache goes too.
        """
        async with self._update_lock:
            if self._released is not None:
                return
            self._updating = True  # the scheduler admits nothing until update_weights loads weights
            if self._task is not None and not self._task.done():
                await asyncio.shield(self._task)
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            self._loaded.clear()
            params = dict(self.model.named_parameters())  # a tied weight once
            self._released = {name: (p.shape, p.dtype) for name, p in params.items()}
            for p in params.values():
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        release_free_memory()

    def _restore(self) -> None:
        """Fresh (uninitialised) storage for released weights, for a load to fill."""
        assert self._released is not None
        for name, (shape, dtype) in self._released.items():
            param = self.model.get_parameter(name)
            param.data = torch.empty(shape, dtype=dtype, device=param.device)
        self._released = None

    async def drop_prefix_cache(self) -> None:
        """Empty the prefix cache now: a synchronous trainer calls it before its update, whose new weights
        make every entry stale anyway, so the update's peak can reuse the entries' memory."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _load(self, source: dict[str, torch.Tensor] | str | Path, lora: bool | None) -> None:
        if self.prefix_cache is not None:  # keys and values of the old weights
            self.prefix_cache.clear()
        if not self._loaded.is_set():  # released (and perhaps a failed load since): no weights to keep
            folder = Path(source) if not isinstance(source, dict) else None
            if folder is not None and self._base_state is None and (lora or is_lora_dir(folder)):
                raise ConfigError(
                    "the engine's weights were released for a full-weight update; a LoRA adapter needs "
                    "base weights: push a full state dict or a model folder"
                )
            if self._released is not None:
                self._restore()
        with torch.no_grad():
            if isinstance(source, dict):
                load_full(self.model, source)
                self._base_state = None
                return
            path = Path(source)
            if not path.is_dir():
                raise ConfigError(f"weights path {path} is not a folder; pass a model or LoRA adapter folder")
            if lora is True and not is_lora_dir(path):
                raise ConfigError(f"{path} has no adapter_config.json; it is not a PEFT LoRA adapter folder")
            if lora is None:
                lora = is_lora_dir(path)
            if lora:
                if self._base_state is None:
                    self._base_state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
                merge_lora(self.model, self._base_state, path)
            else:
                load_full(self.model, read_state_dict(path))
                self._base_state = None
