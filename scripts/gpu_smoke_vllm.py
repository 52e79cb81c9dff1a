"""``gpu_smoke.py``'s ``vllm`` part: the CUDA build of vLLM serving agl's ``Trainer.fit`` behind its gateway.

Checks, each passing or failing with its figure: ``fit`` (a LoRA GRPO step on the tiny model, every call
carrying token ids and logprobs), ``token_ids`` and ``logprobs`` (the engine's, against the trainer's own
tokenizer and log-probs of the same tokens), ``lora`` (the hot-loaded adapter changes greedy validation
outputs), ``reload`` (a full-weight restart on new weights changes greedy outputs and the version) and
``throughput`` (generation tokens/s of the SmolLM2-shaped model). Runs only where ``import vllm`` finds the
CUDA build and torch sees a GPU; elsewhere it says why not and counts as no failure.
"""

from __future__ import annotations

import asyncio
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import torch

import agl
from agl import semconv as sc

PROMPT = "what is two plus three"
_PROBE = (
    "import torch, vllm; from vllm.platforms import current_platform as p; "
    "print(vllm.__version__, p.device_type, torch.cuda.is_available())"
)


@dataclass
class Check:
    """One check's outcome: ``ok`` and the figure that decided it."""

    ok: bool
    figure: str

    def line(self, name: str) -> str:
        return f"  vllm.{name}: {'pass' if self.ok else 'fail'} ({self.figure})"


def availability() -> tuple[Path | None, str]:
    """(a Python whose ``import vllm`` is the CUDA build, its version) or (None, why vLLM can't run here)."""
    from agl.engines.vllm import find_vllm_python

    if not torch.cuda.is_available():
        return None, f"no CUDA device visible to torch {torch.__version__}"
    python = Path(sys.executable) if importlib.util.find_spec("vllm") else find_vllm_python()
    if python is None:
        return None, "import vllm fails in this Python and no AGL_VLLM_PYTHON/.venv-vllm Python has it"
    try:
        probe = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return None, f"import vllm in {python} took over 180 s"
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"import vllm failed in {python}: {last}"
    version, device_type, cuda = (probe.stdout.split() + ["?", "?", "?"])[:3]
    if device_type != "cuda" or cuda != "True":
        return None, f"vllm {version} in {python} is not the CUDA build (platform {device_type}, cuda {cuda})"
    return python, f"vllm {version} ({python})"


@agl.rollout
async def vllm_agent(task: str, llm: agl.LLM, rollout: agl.Rollout) -> float:
    """One chat call; greedy for validation (comparable across versions), sampled for training."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=3)
    try:
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": f"{PROMPT} {task}"}],
            max_tokens=16,
            temperature=0.0 if rollout.mode == "val" else 1.0,
            seed=zlib.crc32(rollout.rollout_id.encode()) % 1000,
        )
    finally:
        await client.close()
    return zlib.crc32((reply.choices[0].message.content or "").encode()) % 100 / 100  # varies by answer


async def _calls(db: Path) -> list[tuple[Any, dict[str, Any]]]:
    """(rollout, the gateway span's attributes) of every model call the fit recorded."""
    from agl.store.sqlite import SqliteLightningStore

    store = SqliteLightningStore(db)
    try:
        out = []
        for rollout in (await store.query_rollouts(limit=1000)).items:
            spans = (await store.query_spans(rollout_id=rollout.rollout_id, limit=1000)).items
            out += [(rollout, s.attributes) for s in spans if s.attributes.get(sc.LLM_SOURCE) == "gateway"]
        return out
    finally:
        await store.aclose()


def _trainer_view(tiny: str, calls: list[tuple[Any, dict[str, Any]]], device: str) -> tuple[Check, Check]:
    """Prompt ids against the trainer's tokenizer, and v0 calls' logprobs against the trainer's own."""
    from transformers import AutoTokenizer

    from agl.algorithm.grpo import LossConfig
    from agl.algorithm.policy.logprobs import token_logprobs
    from agl.algorithm.policy.model import Policy, PolicyConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    same = 0
    for rollout, attrs in calls:
        messages = [{"role": "user", "content": f"{PROMPT} {rollout.input}"}]
        expected: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        expected = expected["input_ids"] if hasattr(expected, "keys") else expected  # a BatchEncoding
        same += list(attrs[sc.LLM_PROMPT_TOKEN_IDS]) == list(expected)
    ids_check = Check(same == len(calls) > 0, f"{same}/{len(calls)} prompts tokenized as the trainer does")
    policy = Policy(PolicyConfig(model_path=tiny, device=device), LossConfig())  # the base weights (v0)
    diffs: list[float] = []
    with torch.no_grad():
        for _, attrs in calls:
            if attrs.get(sc.LLM_MODEL_VERSION) != "v0":
                continue
            prompt, completion = (
                list(attrs[sc.LLM_PROMPT_TOKEN_IDS]),
                list(attrs[sc.LLM_COMPLETION_TOKEN_IDS]),
            )
            ids = torch.tensor([prompt + completion], device=device)
            mine, _ = token_logprobs(policy.model, ids, torch.ones_like(ids))
            ours = mine[0, len(prompt) - 1 :].float().cpu().tolist()
            diffs += [abs(a - b) for a, b in zip(ours, attrs[sc.LLM_LOGPROBS], strict=True)]
    del policy
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    if not diffs:
        return ids_check, Check(False, "no v0 call to compare")
    worst, mean = max(diffs), statistics.fmean(diffs)
    figure = f"|engine - trainer| mean {mean:.4f}, max {worst:.4f} over {len(diffs)} tokens"
    return ids_check, Check(mean <= 0.05 and worst <= 0.5, figure)


def _gpu_args(device: str, share: float) -> tuple[str, ...]:
    return ("--gpu-memory-utilization", str(share)) if device.startswith("cuda") else ()


def fit_checks(
    python: Path, tiny: str, timeout_s: float, device: str = "cuda", dtype: str = "bfloat16"
) -> dict[str, Check]:
    """One LoRA GRPO step through ``Trainer.fit`` on a vLLM replica of the tiny model, then its records."""
    from agl.algorithm.grpo import GRPO, GRPOConfig
    from agl.engines import VllmEngine

    config = GRPOConfig(
        model_path=tiny,
        steps=1,
        tasks_per_step=2,
        group_size=4,
        lr=2e-2,
        lora_rank=8,
        eval_every=1,
        seed=0,
        device=device,
        export_model=False,
    )
    engine = VllmEngine(
        python=str(python),
        dtype=dtype,
        max_model_len=512,
        extra_args=_gpu_args(device, 0.25),
        start_timeout_s=timeout_s,
    )
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = agl.Trainer(
            GRPO(config), n_runners=4, output_dir=out, serving=agl.Serving(engine=engine)
        ).fit(vllm_agent, ["a", "b"], ["v"])
        fit_s = time.perf_counter() - started
        calls = asyncio.run(_calls(Path(out) / "store.db"))
    history = result["history"]
    faithful = [
        a
        for _, a in calls
        if a.get(sc.LLM_STATUS_CODE) == 200
        and a.get(sc.LLM_HAS_TOKEN_IDS) is True
        and a.get(sc.LLM_COMPLETION_TOKEN_IDS)
        and len(a.get(sc.LLM_LOGPROBS) or ()) == len(a[sc.LLM_COMPLETION_TOKEN_IDS])
    ]
    trained = len(history) == 1 and history[0].get("trained_tokens", 0) > 0
    checks = {
        "fit": Check(
            trained and len(faithful) == len(calls) == 2 * 4 + 2,
            f"{len(history)} step in {fit_s:.1f} s; {len(faithful)}/{len(calls)} calls with token ids and "
            "logprobs (10 expected)",
        )
    }
    checks["token_ids"], checks["logprobs"] = _trainer_view(tiny, calls, device)
    val = {a.get(sc.LLM_MODEL_VERSION): a for r, a in calls if r.mode == "val"}
    if set(val) != {"v0", "v1"}:
        checks["lora"] = Check(False, f"validation ran on versions {sorted(map(str, val))}, not v0 and v1")
    else:
        before, after = val["v0"], val["v1"]
        moved = max(
            (abs(a - b) for a, b in zip(before[sc.LLM_LOGPROBS], after[sc.LLM_LOGPROBS], strict=False)),
            default=0.0,
        )
        changed = before[sc.LLM_COMPLETION_TOKEN_IDS] != after[sc.LLM_COMPLETION_TOKEN_IDS] or moved > 1e-3
        figure = f"greedy validation after the v1 adapter hot-load: logprobs moved {moved:.4f}"
        checks["lora"] = Check(changed, figure)
    return checks


async def _generate(url: str, requests: int, tokens: int) -> tuple[int, float]:
    """``requests`` concurrent sampled completions of ``tokens`` each (EOS ignored): (tokens made, seconds)."""
    body = {"model": "policy", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens}
    body.update(temperature=1.0, ignore_eos=True)
    async with httpx.AsyncClient(timeout=300) as client:
        started = time.perf_counter()
        replies = await asyncio.gather(
            *(client.post(f"{url}/chat/completions", json={**body, "seed": i}) for i in range(requests))
        )
        seconds = time.perf_counter() - started
    made = sum(r.json()["usage"]["completion_tokens"] for r in replies if r.status_code == 200)
    return made, seconds


def _greedy(url: str) -> dict[str, Any]:
    body = {"model": "policy", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 16}
    body.update(temperature=0.0, return_token_ids=True)
    return dict(httpx.post(f"{url}/chat/completions", json=body, timeout=120).json())


async def serve_checks(
    python: Path,
    shaped: str,
    timeout_s: float,
    load: tuple[int, int] = (64, 128),
    device: str = "cuda",
    dtype: str = "bfloat16",
) -> dict[str, Check]:
    """Generation tokens/s of the SmolLM2-shaped model (``load``: requests, tokens each; CUDA graphs on),
    then a full-weight reload on perturbed weights."""
    from transformers import AutoModelForCausalLM

    from agl.engines import VllmEngine
    from agl.engines.launch import StateDict, start_engines

    spec = VllmEngine(
        python=str(python),
        dtype=dtype,
        max_model_len=1024,
        enforce_eager=not device.startswith("cuda"),  # what a GPU run uses: CUDA graphs for decode
        extra_args=_gpu_args(device, 0.3),
        start_timeout_s=timeout_s,
    )
    checks: dict[str, Check] = {}
    with tempfile.TemporaryDirectory() as work:
        started = time.perf_counter()
        engines = await start_engines(spec, shaped, work_dir=Path(work))
        start_s = time.perf_counter() - started
        try:
            url = engines.upstreams[0].url
            await _generate(url, 4, 8)  # warm-up
            requests, tokens = load
            made, seconds = await _generate(url, requests, tokens)
            rate = made / seconds if seconds else 0.0
            figure = f"{rate:.0f} tokens/s ({requests} requests x {tokens} tokens in {seconds:.2f} s; "
            figure += f"server start {start_s:.0f} s)"
            checks["throughput"] = Check(made == requests * tokens, figure)
            before = _greedy(url)
            model: Any = AutoModelForCausalLM.from_pretrained(shaped, dtype=getattr(torch, dtype))
            torch.manual_seed(1)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 0.05)
            reloaded = time.perf_counter()
            version = await engines.sync(StateDict(dict(model.state_dict())))
            reload_s = time.perf_counter() - reloaded
            after = _greedy(url)
            ids = [reply["choices"][0].get("token_ids") for reply in (before, after)]
            versions = (before.get("model_version"), after.get("model_version"))
            ok = versions == ("v0", "v1") and version == "v1" and ids[0] is not None and ids[0] != ids[1]
            figure = f"restart on new weights in {reload_s:.1f} s; versions {versions[0]} -> {versions[1]}; "
            figure += f"greedy tokens {'changed' if ids[0] != ids[1] else 'unchanged'}"
            checks["reload"] = Check(ok, figure)
        finally:
            engines.stop()
    return checks


__all__ = ["Check", "availability", "fit_checks", "serve_checks", "vllm_agent"]
