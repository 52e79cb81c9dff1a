"""GPU smoke test: what a GPU user of agl runs, each part passing or failing with its figure, in <= 8 minutes.

    python scripts/gpu_smoke.py                  # every part, SmolLM2-135M's shape with random weights
    python scripts/gpu_smoke.py --plan           # what it would run, and each part's time budget; no GPU needed
    python scripts/gpu_smoke.py --model tiny --parts fit,bf16 --allow-cpu   # CPU figures, for testing it
    python scripts/gpu_smoke.py --bundle .whl    # the wheels a bare device machine needs (see below)

Parts (``--parts``, all by default), each with a time budget for one H100 (a part over it fails):

- ``fit``: a short GRPO loop through ``Trainer.fit`` with the built-in engine and the policy on CUDA:
  generation tokens/s (completion tokens / seconds generating) and training tokens/s, reward per step.
- ``bf16``: GRPO policy steps on a synthetic batch under ``torch.autocast(bfloat16)`` (fp32 weights).
- ``fsdp``: the same steps sharded with FSDP2 (bf16 compute) over all visible GPUs (one rank per GPU).
- ``vllm``: the CUDA build of vLLM behind agl's gateway (``scripts/gpu_smoke_vllm.py``): a LoRA GRPO step
  in ``fit`` on the tiny model, token ids and logprobs against the trainer's own, the adapter hot-load
  changing outputs, a full-weight reload, generation tokens/s. Without it: "vllm: not available (why)".

Models are built on the machine, nothing is downloaded: ``smollm2-shape`` (default) is SmolLM2-135M's
architecture (30 layers, 576 wide, 49,152-token vocabulary) with random weights, for throughput; the tiny
model (``agl.models.tiny_model``) is the vllm part's correctness model. ``--model smollm2`` takes the real
weights where they are cached. With no CUDA device it exits non-zero unless ``--allow-cpu`` (CPU figures,
no budgets). It prints one JSON line with every figure last, and exits 1 when a part failed.

On a lent device machine (no package index; the image has torch, transformers and peft but not agl's
serving stack), bundle the rest here and carry it: ``echo /.whl/ >> .git/info/exclude``, then
``python scripts/gpu_smoke.py --bundle .whl`` (about 9 MiB of the 64 MiB a call carries), and run
``sh .whl/install.sh && PYTHONUNBUFFERED=1 python3 scripts/gpu_smoke.py`` there with ``.whl`` carried.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "scripts"):  # run from a checkout without installing; the sibling part modules
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import openai  # noqa: E402
import torch  # noqa: E402

import agl  # noqa: E402
from agl.adapter import Sample  # noqa: E402
from agl.algorithm.grpo import GRPO, GRPOConfig, LossConfig  # noqa: E402
from agl.engines import BuiltinEngine  # noqa: E402

PARTS = ("fit", "bf16", "fsdp", "vllm")
# seconds on one H100, measured to hold with room; "setup" builds the models. Their sum stays <= 480 (8 min).
BUDGET_S = {"setup": 45, "fit": 90, "bf16": 30, "fsdp": 45, "vllm": 240}
TOTAL_BUDGET_S = 480
# SmolLM2-135M's architecture (HuggingFaceTB/SmolLM2-135M-Instruct config.json)
SMOLLM2_SHAPE: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}

_generated = {"tokens": 0}
_lock = threading.Lock()


@agl.rollout
async def smoke_agent(task: dict[str, Any], llm: agl.LLM) -> float:
    """Small sums: 1 for the right number, else half the share of digits; counts completion tokens."""
    client = openai.AsyncOpenAI(base_url=llm.endpoint, api_key="k", max_retries=0)
    try:
        reply = await client.chat.completions.create(
            model=llm.model,
            messages=[{"role": "user", "content": task["prompt"]}],
            max_tokens=task["max_tokens"],
        )
    finally:
        await client.close()
    with _lock:
        _generated["tokens"] += reply.usage.completion_tokens if reply.usage else 0
    text = reply.choices[0].message.content or ""
    if task["answer"] in [w.strip(".,!") for w in text.split()]:
        return 1.0
    return 0.5 * sum(c.isdigit() for c in text) / max(len(text), 1)  # dense: a random model still varies


def synthetic_batch(
    vocab: int, samples: int, tokens: int, seed: int = 0
) -> tuple[list[Sample], list[float], list[int]]:
    """``samples`` sequences of ``tokens`` random ids (first half prompt, second half trained), in groups
    of two with advantages +1 / -1: a real GRPO batch shape without an engine."""
    rng = random.Random(seed)
    batch = []
    for i in range(samples):
        ids = tuple(rng.randrange(3, vocab) for _ in range(tokens))
        mask = tuple(int(t >= tokens // 2) for t in range(tokens))
        batch.append(Sample(f"r{i}", f"g{i // 2}", ids, mask, None, float(i % 2)))
    return batch, [1.0 if i % 2 else -1.0 for i in range(samples)], [i // 2 for i in range(samples)]


def _peak_gib(device: str, rows: list[dict[str, float]]) -> float:
    if device.startswith("cuda"):
        return float(torch.cuda.max_memory_allocated()) / 2**30
    return max(r.get("update_peak_rss_gb", 0.0) for r in rows)


def _summary(rows: list[dict[str, float]]) -> dict[str, Any]:
    for row in rows:  # a smoke test must not pass on a step that computed nothing
        if not (row["grad_norm"] > 0 and row["loss"] == row["loss"]):
            raise RuntimeError(
                f"a policy step gave grad_norm={row['grad_norm']}, loss={row['loss']}: not a real step"
            )
    return {
        "steps": len(rows),
        "tokens_per_s": statistics.median(r["train_tokens_per_s"] for r in rows),
        "step_s_median": statistics.median(r["update_time_s"] for r in rows),
    }


def bf16_steps(path: str, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """GRPO policy steps with bf16 autocast (fp32 master weights and optimizer) on ``device``."""
    from agl.algorithm.policy.model import Policy, PolicyConfig

    policy = Policy(PolicyConfig(model_path=path, lr=args.lr, device=device), LossConfig())
    batch = synthetic_batch(policy.model.config.vocab_size, args.train_samples, args.train_tokens)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for _ in range(args.train_steps):
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            rows.append(policy.step(*batch))
    report = {**_summary(rows), "peak_mem_gib": _peak_gib(device, rows), "dtype": "bf16 autocast"}
    del policy
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return report


def fsdp_steps(path: str, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """GRPO policy steps sharded with FSDP2 over every visible GPU (one rank each; bf16 compute)."""
    import torch.distributed as dist

    from agl.algorithm.policy.collective import backend_for
    from agl.algorithm.policy.distributed import DistributedPolicy, _free_port
    from agl.algorithm.policy.model import Policy, PolicyConfig
    from agl.algorithm.policy.sharding import ShardedPolicy

    ranks = torch.cuda.device_count() if device.startswith("cuda") else 1
    config = PolicyConfig(model_path=path, lr=args.lr, device=device)
    policy = Policy(config, LossConfig())
    batch = synthetic_batch(policy.model.config.vocab_size, args.train_samples, args.train_tokens)
    if ranks >= 2:  # the other ranks are spawned processes, one per GPU
        handle = DistributedPolicy.start(policy, ranks, sharding="fsdp")
        step: Any = handle.step
        shards: Any = handle.memory_bytes
        peaks: Any = lambda: handle.collective("peak_memory", gather=True)  # noqa: E731
        close: Any = handle.close
    else:  # one GPU (or the CPU): a one-rank group, FSDP2's bf16 path without a second device
        init = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend_for(device), init_method=init, rank=0, world_size=1)
        sharded = ShardedPolicy.adopt(policy)
        step = sharded.step
        shards = lambda: [sharded.memory_bytes()]  # noqa: E731
        peaks = lambda: [sharded.peak_memory()]  # noqa: E731
        close = dist.destroy_process_group
    try:
        rows = [step(*batch) for _ in range(args.train_steps)]
        per_rank = [sum(s.values()) / 2**30 for s in shards()]
        peak = [p / 2**30 for p in peaks()]
    finally:
        close()
    return {
        **_summary(rows),
        "ranks": ranks,
        "backend": backend_for(device),
        "shard_gib_per_rank": per_rank,  # parameters + gradients + AdamW state each rank holds
        "peak_mem_gib_per_rank": peak,  # includes loading the full model before sharding
        "dtype": "bf16 compute, fp32 reduce" if device.startswith("cuda") else "fp32",
    }


def _shaped_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained here to exactly ``vocab_size`` ids on generated words (~2 s)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from agl.models.chatml import CHAT_TEMPLATE
    from agl.models.tiny import IM_END, IM_START, PAD

    rng = random.Random(0)
    letters = string.ascii_lowercase
    words = ["".join(rng.choice(letters) for _ in range(rng.randrange(3, 9))) for _ in range(40000)]
    corpus = [" ".join(str(i) for i in range(1000))]
    corpus += [" ".join(rng.choice(words) for _ in range(20)) for _ in range(8000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token=IM_END, pad_token=PAD, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _build_shaped(out: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _shaped_tokenizer(SMOLLM2_SHAPE["vocab_size"])
    if len(tokenizer) != SMOLLM2_SHAPE["vocab_size"]:
        raise RuntimeError(
            f"the shaped tokenizer has {len(tokenizer)} ids, not {SMOLLM2_SHAPE['vocab_size']}"
        )
    tokenizer.save_pretrained(out)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = LlamaConfig(**SMOLLM2_SHAPE, bos_token_id=None, eos_token_id=eos, pad_token_id=pad)
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad)
    model.save_pretrained(out)


def shaped_model() -> Path:
    """SmolLM2-135M's architecture with random weights and a tokenizer of its vocabulary size, built once
    into agl's model cache (no download: a bare GPU machine builds it in seconds)."""
    from agl.models.cache import build_once, cache_root

    return build_once(cache_root() / "smollm2-135m-shape-s0", _build_shaped)


def model_path(name: str) -> str:
    """The model folder for ``--model``, built here when it is one of the generated ones."""
    if name == "smollm2-shape":
        return str(shaped_model())
    if name == "tiny":
        return str(agl.models.tiny_model())
    if name == "smollm2":
        return str(agl.models.smollm2())
    return _checked_model(name)


def _checked_model(name: str) -> str:
    """``name`` when ``--model`` can use it; else a clear error naming the flag (before any work starts)."""
    if name not in ("smollm2-shape", "tiny", "smollm2") and not Path(name).is_dir():
        raise SystemExit(
            f"--model must be tiny, smollm2 or a local model folder, or smollm2-shape (random weights); "
            f"{name!r} is none of them"
        )
    return name


class PartTimeout(Exception):
    """A part ran past its hard limit: it fails, and the parts after it still run."""


@contextmanager
def _hard_limit(seconds: float | None) -> Iterator[None]:
    """SIGALRM after ``seconds`` (CUDA runs only): a hung part fails instead of eating the whole call."""
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"ran past its hard limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(int(seconds) + 1)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_part(
    name: str, work: Callable[[], Any], figure: Callable[[Any], str], cuda: bool, status: dict[str, Any]
) -> Any:
    """Run one part under its budget; print ``name: pass|fail (figure) [elapsed of budget]``; None on fail.

    On CUDA a part over its budget fails (the figures still print), and one at 1.5x budget + 30 s is cut.
    """
    budget = BUDGET_S[name]
    started = time.perf_counter()
    result: Any = None
    try:
        with _hard_limit(budget * 1.5 + 30 if cuda else None):
            result = work()
        ok, text = True, figure(result)
    except Exception as exc:  # a failing part is reported, and the next part still runs
        traceback.print_exc()
        result, ok, text = None, False, f"{type(exc).__name__}: {exc}"
    elapsed = time.perf_counter() - started
    if ok and cuda and elapsed > budget:
        ok, text = False, f"{text}; over its {budget} s budget"
    print(f"{name}: {'pass' if ok else 'fail'} ({text}) [{elapsed:.1f} s of {budget} s]", flush=True)
    status[name] = {"ok": ok, "figure": text, "elapsed_s": elapsed, "budget_s": budget}
    return result


def vllm_part(args: argparse.Namespace, cuda: bool, status: dict[str, Any]) -> dict[str, Any]:
    """The vllm part where the CUDA build of vLLM runs; elsewhere "not available (why)", not a failure."""
    import asyncio

    import gpu_smoke_vllm as gv

    started = time.perf_counter()
    python, about = gv.availability()
    if python is None:
        print(f"vllm: not available ({about})", flush=True)
        status["vllm"] = {"ok": None, "figure": f"not available ({about})", "elapsed_s": 0.0}
        status["vllm"].update(elapsed_s=time.perf_counter() - started, budget_s=BUDGET_S["vllm"])
        return {"available": False, "why": about}
    checks: dict[str, Any] = {}

    def work() -> dict[str, Any]:
        tiny, shaped = str(agl.models.tiny_model()), model_path("smollm2-shape")
        stages: list[tuple[str, Callable[[], dict[str, Any]]]] = [
            ("fit", lambda: gv.fit_checks(python, tiny, timeout_s=120)),
            ("serve", lambda: asyncio.run(gv.serve_checks(python, shaped, 150, args.vllm_load))),
        ]
        for stage, run in stages:
            try:
                checks.update(run())
            except Exception as exc:  # one stage failing still leaves the other's figures
                traceback.print_exc()
                checks[stage] = gv.Check(False, f"{type(exc).__name__}: {exc}")
        for name, check in checks.items():
            print(check.line(name), flush=True)
        failed = [name for name, check in checks.items() if not check.ok]
        if failed:
            raise RuntimeError(f"{', '.join(failed)} failed ({about})")
        return {"available": True, "vllm": about}

    report = run_part("vllm", work, lambda r: f"{len(checks)} checks pass; {about}", cuda, status) or {}
    report["checks"] = {name: {"ok": c.ok, "figure": c.figure} for name, c in checks.items()}
    return report


def plan(args: argparse.Namespace, parts: list[str]) -> None:
    """Print the parts ``args`` would run, their models and budgets, and whether vLLM can run here."""
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    where = (
        f"{gpus} x {torch.cuda.get_device_name()}" if cuda else "no CUDA device (the budgets assume one H100)"
    )
    print(f"gpu_smoke plan: torch {torch.__version__}, {where}")
    what = {
        "fit": f"GRPO through Trainer.fit, built-in engine + policy on CUDA: {args.model}, {args.steps} steps x "
        f"{args.tasks_per_step} tasks x {args.group_size} samples, {args.max_tokens} tokens each",
        "bf16": f"{args.train_steps} GRPO policy steps under bf16 autocast: {args.model}, "
        f"{args.train_samples} x {args.train_tokens} tokens",
        "fsdp": f"{args.train_steps} policy steps sharded with FSDP2 over {max(gpus, 1)} rank(s): {args.model}",
        "vllm": "vLLM behind agl's gateway: fit (LoRA GRPO step, tiny model), token_ids, logprobs, lora, "
        f"reload, throughput (smollm2-shape, {args.vllm_load[0]} requests x {args.vllm_load[1]} tokens)",
    }
    if args.model == "smollm2-shape":
        shape = SMOLLM2_SHAPE
        setup = (
            f"build smollm2-shape (SmolLM2-135M's architecture, random weights: {shape['num_hidden_layers']} "
        )
        setup += f"layers x {shape['hidden_size']}, vocabulary {shape['vocab_size']}) and the tiny model"
    else:
        setup = f"load {args.model}; build the tiny model"
    print(f"  setup {BUDGET_S['setup']:4d} s  {setup}")
    for part in parts:
        print(f"  {part:5s} {BUDGET_S[part]:4d} s  {what[part]}")
    if "vllm" in parts:
        import gpu_smoke_vllm as gv

        python, about = gv.availability()
        print(f"  vllm: {'available: ' if python else 'not available ('}{about}{'' if python else ')'}")
    total = BUDGET_S["setup"] + sum(BUDGET_S[p] for p in parts)
    print(f"expected time: at most {total} s ({total / 60:.1f} min) of the {TOTAL_BUDGET_S} s allowed")
    print(
        json.dumps({"plan": parts, "budget_s": {p: BUDGET_S[p] for p in ["setup", *parts]}, "total_s": total})
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="smollm2-shape", help="smollm2-shape, tiny, smollm2 or a local HF model folder"
    )
    parser.add_argument(
        "--plan", action="store_true", help="print the parts, models and budgets; run nothing"
    )
    parser.add_argument("--bundle", metavar="DIR", help="write the wheels a bare device machine needs to DIR")
    parser.add_argument("--bundle-python", default="3.12", help="--bundle: the target Python (the device's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runners", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument(
        "--dtype", default="float32", help="the engine's dtype (the policy trains in float32)"
    )
    parser.add_argument("--async-rollouts", action="store_true", help="GRPOConfig(async_rollouts=True)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument(
        "--allow-cpu", action="store_true", help="run on the CPU when no GPU is visible (CPU figures)"
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--train-samples", type=int, default=8, help="bf16/fsdp: samples per step")
    parser.add_argument("--train-tokens", type=int, default=512, help="bf16/fsdp: tokens per sample")
    parser.add_argument("--train-steps", type=int, default=2, help="bf16/fsdp: policy steps")
    parser.add_argument(
        "--vllm-load",
        type=int,
        nargs=2,
        default=(64, 128),
        metavar=("REQUESTS", "TOKENS"),
        help="vllm throughput: concurrent requests and tokens each",
    )
    return parser.parse_args(argv)


def _device(args: argparse.Namespace) -> str:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            f"--device {device} asked for, but torch sees no CUDA device (torch {torch.__version__})"
        )
    if device == "cpu" and not args.allow_cpu:
        raise SystemExit(
            f"no CUDA device visible (torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}): refusing to report CPU figures as GPU "
            "ones; pass --allow-cpu to run on the CPU anyway"
        )
    if device == "cpu":
        warnings.warn(
            "no CUDA device: running the GPU smoke test on the CPU (slow; figures are CPU figures)",
            stacklevel=1,
        )
    return device


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        raise SystemExit(
            f"--parts must be a comma-separated subset of {', '.join(PARTS)}, got {args.parts!r}"
        )
    _checked_model(args.model)
    if args.bundle:
        from gpu_smoke_bundle import write_bundle

        result = write_bundle(Path(args.bundle), args.bundle_python)
        print(json.dumps({"bundle": result}))
        return {"bundle": result}
    if args.plan:
        plan(args, parts)
        return {"plan": parts}
    device = _device(args)
    cuda = device.startswith("cuda")
    started = time.perf_counter()
    report: dict[str, Any] = {"model": args.model, "device": device, "parts": parts}
    report.update(torch=torch.__version__, cuda=torch.version.cuda)
    if cuda:
        report["gpu"] = torch.cuda.get_device_name()
        report["visible_gpus"] = torch.cuda.device_count()
    status: dict[str, Any] = {}
    where = report.get("gpu", "CPU")
    path = run_part(
        "setup",
        lambda: model_path(args.model),
        lambda p: f"{args.model} at {p}; torch {torch.__version__} on {where}",
        cuda,
        status,
    )
    if path is not None:
        if "fit" in parts:
            report.update(run_part("fit", lambda: fit(path, device, args), _fit_figure, cuda, status) or {})
        if "bf16" in parts:
            report["bf16"] = run_part(
                "bf16", lambda: bf16_steps(path, device, args), _step_figure, cuda, status
            )
        if "fsdp" in parts:
            report["fsdp"] = run_part(
                "fsdp", lambda: fsdp_steps(path, device, args), _step_figure, cuda, status
            )
        if "vllm" in parts:
            report["vllm"] = vllm_part(args, cuda, status)
    report["checks"] = status
    report["elapsed_s"] = time.perf_counter() - started
    report["ok"] = all(s["ok"] is not False for s in status.values())
    print(json.dumps(_rounded(report)), flush=True)
    return report


def _fit_figure(r: dict[str, Any]) -> str:
    return (
        f"generation {r['generation_tokens_per_s']:.0f} tokens/s, training {r['training_tokens_per_s']:.0f} "
        f"tokens/s, {r['steps']} steps, rewards {r['rewards']}"
    )


def _step_figure(r: dict[str, Any]) -> str:
    ranks = (
        f" over {r['ranks']} rank(s), {r['shard_gib_per_rank'][0]:.2f} GiB shard per rank"
        if "ranks" in r
        else ""
    )
    peak = f", peak {r['peak_mem_gib']:.2f} GiB" if "peak_mem_gib" in r else ""
    return f"{r['tokens_per_s']:.0f} tokens/s{ranks}{peak}, median step {r['step_s_median']:.2f} s"


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def fit(path: str, device: str, args: argparse.Namespace) -> dict[str, Any]:
    """A short GRPO loop through ``Trainer.fit``: the built-in engine and the policy on ``device``."""
    tasks = [
        {
            "prompt": f"What is {a} + {b}? Reply with the number only.",
            "answer": str(a + b),
            "max_tokens": args.max_tokens,
        }
        for a, b in [(2, 3), (7, 5), (11, 4), (6, 9), (13, 8), (3, 14), (10, 10), (1, 18)]
    ]
    config = GRPOConfig(
        model_path=path,
        steps=args.steps,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        lr=args.lr,
        eval_every=0,
        device=device,
        async_rollouts=args.async_rollouts,
    )
    engine = BuiltinEngine({"device": device, "dtype": args.dtype})
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        result = agl.Trainer(
            GRPO(config), n_runners=args.runners, output_dir=out, serving=agl.Serving(engine=engine)
        ).fit(smoke_agent, tasks, [])
        wall = time.perf_counter() - started
    history = result["history"]
    if len(history) != args.steps or not _generated["tokens"]:
        raise RuntimeError(
            f"{len(history)} of {args.steps} steps ran, {_generated['tokens']} tokens generated"
        )
    generating_s = sum(row["rollout_time_s"] for row in history)
    trained = [row for row in history if "train_tokens_per_s" in row]
    if not trained:
        raise RuntimeError("no step trained: every batch was empty")
    return {
        "steps": len(history),
        "generation_tokens_per_s": _generated["tokens"] / generating_s if generating_s else 0.0,
        "generated_tokens": _generated["tokens"],
        "training_tokens_per_s": statistics.median(r["train_tokens_per_s"] for r in trained)
        if trained
        else 0.0,
        "trained_steps": len(trained),
        "step_s_median": statistics.median(r["step_time_s"] for r in history) if history else 0.0,
        "rewards": [round(r["reward_mean"], 3) for r in history],
        "peak_gpu_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None,
        "wall_s": wall,
    }


if __name__ == "__main__":
    sys.exit(0 if main().get("ok", True) else 1)
