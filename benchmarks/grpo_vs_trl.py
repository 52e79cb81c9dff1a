"""GRPO step speed on CPU: agl (built-in engine + ``Policy.step``) vs TRL's ``GRPOTrainer``, same everything.
TRL and datasets come with the bench extra (agl[bench]): ``pip install -e '.[bench]'``.

Part 1, single turn: the same model, prompts, reward, group size, completion length, learning rate and number of
steps through both, one after the other; seconds per step (generation + update, + weight sync for agl), trained
tokens/s (prompt + completion tokens of the batch / step time) and the reward of the last steps.
Part 2, a synthetic 5-turn agent (5 calls whose prompts extend each other): one ``Policy.step`` on trajectory-level
samples (one merged sequence per rollout) vs transition-level samples (one per call): tokens processed, step time.

    .venv/bin/python benchmarks/grpo_vs_trl.py --model tiny --steps 3
    .venv/bin/python benchmarks/grpo_vs_trl.py --model smollm2 --steps 4 --json results/grpo_vs_trl.jsonl

TRL runs with ``use_cpu=True, bf16=False``, no vLLM, ``report_to="none"``, ``loss_type="dapo"`` (token mean, as
agl's default), ``beta=0`` and ``gradient_checkpointing=False`` (agl does not checkpoint; TRL 1.x enables it
by default, which only makes TRL slower; pass ``--trl-gradient-checkpointing`` to measure that).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import re
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from agl import semconv as sc  # noqa: E402
from agl.schemas import Rollout, RolloutStatus, Span  # noqa: E402


def make_tasks(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Small sums: a chat prompt and the expected answer."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        a, b = rng.randrange(1, 20), rng.randrange(1, 20)
        content = f"What is {a} + {b}? Reply with the number only."
        tasks.append({"prompt": [{"role": "user", "content": content}], "answer": str(a + b)})
    return tasks


def reward_text(text: str, answer: str) -> float:
    """1 for the right number in the reply, 0.1 for some other number, 0 otherwise (shared by both sides)."""
    numbers = re.findall(r"-?\d+", text)
    return 1.0 if answer in numbers else (0.1 if numbers else 0.0)


def emit(row: dict[str, Any], json_path: Path | None) -> None:
    line = json.dumps(row, sort_keys=True)
    print(line, flush=True)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        with json_path.open("a") as fh:
            fh.write(line + "\n")


def _summary(side: str, args: argparse.Namespace, steps: list[dict[str, float]]) -> dict[str, Any]:
    times = [s["step_s"] for s in steps]
    steady = times[1:] or times
    tokens = sum(s["tokens"] for s in steps[1:] or steps)
    # agl skips the update when every group tied (nothing to learn); TRL always runs it: compare like with like
    updated = [s for s in steps[1:] if s.get("update_s", 1.0) > 0] or [
        s for s in steps if s.get("update_s", 1.0) > 0
    ]
    return {
        "bench": "grpo_single_turn",
        "side": side,
        "model": args.model,
        "prompts_per_step": args.prompts,
        "group_size": args.group,
        "max_tokens": args.max_tokens,
        "steps": len(steps),
        "threads": args.threads,
        "first_step_s": round(times[0], 3),
        "step_s": round(statistics.mean(steady), 3),
        "trained_tokens_per_s": round(tokens / sum(steady), 1),
        "steps_with_update": len(updated),
        "step_s_with_update": round(statistics.mean(s["step_s"] for s in updated), 3) if updated else None,
        "trained_tokens_per_s_with_update": (
            round(sum(s["tokens"] for s in updated) / sum(s["step_s"] for s in updated), 1)
            if updated
            else None
        ),
        "tokens_per_step": round(statistics.mean(s["tokens"] for s in steps), 1),
        "reward_first": round(steps[0]["reward"], 3),
        "reward_last": round(steps[-1]["reward"], 3),
        **(
            {
                k: round(statistics.mean(s[k] for s in steps), 3)
                for k in ("gen_s", "update_s", "sync_s")
                if k in steps[0]
            }
        ),
    }


# ----- agl ---------------------------------------------------------------------------------------------------
def _spans(rollout_id: str, prompt: list[int], choice: Any, version: str, reward: float) -> list[Span]:
    call = Span.new(
        rollout_id,
        "at-1",
        sc.SPAN_LLM_CALL,
        {
            sc.LLM_API: "chat.completions",
            sc.LLM_PROMPT_TOKEN_IDS: prompt,
            sc.LLM_COMPLETION_TOKEN_IDS: choice.token_ids,
            sc.LLM_LOGPROBS: choice.logprobs,
            sc.LLM_RESPONSE_ID: f"{rollout_id}-r",
            sc.LLM_SOURCE: "gateway",
            sc.LLM_MODEL_VERSION: version,
        },
        sequence_id=1,
    )
    return [call, Span.new(rollout_id, "at-1", sc.SPAN_REWARD, {sc.REWARD_VALUE: reward}, sequence_id=2)]


async def run_agl(
    args: argparse.Namespace, path: Path, tasks: list[dict[str, Any]]
) -> list[dict[str, float]]:
    """Each step: P x G completions from the engine, spans -> ``build_batch`` -> ``Policy.step`` -> weight sync."""
    from agl.algorithm.grpo import GRPOConfig, build_batch
    from agl.algorithm.grpo.policy import Policy, PolicyConfig
    from agl.engines.builtin import Engine, SamplingParams

    config = GRPOConfig(model_path=str(path), group_size=args.group, lr=args.lr, max_sample_tokens=100_000)
    policy = Policy(
        PolicyConfig(model_path=str(path), lr=args.lr, micro_batch_tokens=args.micro_batch_tokens),
        config.loss,
    )
    engine = Engine(path, max_batch_size=args.prompts * args.group, default_max_tokens=args.max_tokens)
    steps = []
    for step in range(args.steps):
        batch_tasks = tasks[step * args.prompts : (step + 1) * args.prompts]
        started = time.perf_counter()
        prompts = [engine.encode_chat(t["prompt"]) for t in batch_tasks]
        params = [
            SamplingParams(
                temperature=1.0, max_tokens=args.max_tokens, n=args.group, seed=args.seed + 97 * step + i
            )
            for i in range(len(prompts))
        ]
        gens = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)))
        generated = time.perf_counter()
        rollouts, spans, rewards = [], {}, []
        for i, (task, gen) in enumerate(zip(batch_tasks, gens, strict=True)):
            for c in gen.choices:
                rid = f"s{step}-p{i}-c{c.index}"
                reward = reward_text(c.text, task["answer"])
                rewards.append(reward)
                spans[rid] = _spans(rid, gen.prompt_token_ids, c, gen.model_version, reward)
                rollouts.append(
                    Rollout(
                        rollout_id=rid,
                        group_id=f"s{step}-p{i}",
                        status=RolloutStatus.SUCCEEDED,
                        created_at=0.0,
                        updated_at=0.0,
                    )
                )
        batch = build_batch(rollouts, spans, config)
        tokens = sum(len(gen.prompt_token_ids) + len(c.token_ids) for gen in gens for c in gen.choices)
        update_s = sync_s = 0.0
        if batch.samples:  # a step whose groups all tied has nothing to learn from; TRL still runs its update
            t = time.perf_counter()
            policy.step(batch.samples, batch.advantages, batch.rollout_index)
            update_s = time.perf_counter() - t
            t = time.perf_counter()
            await engine.update_weights(policy.engine_weights())
            sync_s = time.perf_counter() - t
        step_s = time.perf_counter() - started
        steps.append(
            {
                "step_s": step_s,
                "gen_s": generated - started,
                "update_s": update_s,
                "sync_s": sync_s,
                "tokens": float(tokens),
                "reward": sum(rewards) / len(rewards),
            }
        )
        print(f"  agl step {step + 1}: {step_s:.2f}s reward {steps[-1]['reward']:.3f}", flush=True)
    del policy, engine
    gc.collect()
    return steps


# ----- TRL ---------------------------------------------------------------------------------------------------
def run_trl(args: argparse.Namespace, path: Path, tasks: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The same steps through TRL's GRPOTrainer: one generation round and one optimizer step per step."""
    try:
        from datasets import Dataset
        from trl import GRPOConfig as TRLConfig
        from trl import GRPOTrainer
    except ImportError as exc:
        raise SystemExit(
            f"{exc.name} is not installed: pip install -e '.[bench]' (agl[bench]: trl, datasets)"
        ) from exc
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    rewards_seen: list[list[float]] = []

    def reward_func(completions: list[Any], answer: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        out = [reward_text(t, a) for t, a in zip(texts, answer, strict=True)]
        rewards_seen.append(out)
        return out

    class Timer(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.began = 0.0
            self.times: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.began = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.times.append(time.perf_counter() - self.began)

        def on_log(self, *a: Any, logs: dict[str, float] | None = None, **k: Any) -> None:
            if logs and "num_tokens" in logs:
                self.logs.append(dict(logs))

    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    data = Dataset.from_list(tasks[: args.steps * args.prompts])
    out_dir = Path(args.trl_output)
    config = TRLConfig(
        output_dir=str(out_dir),
        use_cpu=True,
        bf16=False,
        use_vllm=False,
        report_to="none",
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        learning_rate=args.lr,
        max_steps=args.steps,
        beta=0.0,
        loss_type="dapo",
        logging_steps=1,
        save_strategy="no",
        shuffle_dataset=False,
        gradient_checkpointing=args.trl_gradient_checkpointing,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    timer = Timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_func,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    trainer.train()
    steps = []
    previous = 0.0
    for i, seconds in enumerate(timer.times):
        total = timer.logs[i]["num_tokens"] if i < len(timer.logs) else previous
        rs = rewards_seen[i] if i < len(rewards_seen) else [float("nan")]
        steps.append({"step_s": seconds, "tokens": float(total - previous), "reward": sum(rs) / len(rs)})
        previous = total
        print(f"  trl step {i + 1}: {seconds:.2f}s reward {steps[-1]['reward']:.3f}", flush=True)
    del trainer, model
    gc.collect()
    return steps


# ----- 5-turn: trajectory vs transition -----------------------------------------------------------------------
def multi_turn_samples(
    level: str, args: argparse.Namespace, vocab: int
) -> tuple[list[Any], list[float], list[int]]:
    """``--rollouts`` synthetic 5-call rollouts (prompts extend each other) turned into samples at ``level``."""
    from agl.adapter import llm_calls, to_samples
    from agl.algorithm.grpo import group_advantages

    rng = random.Random(args.seed)
    samples, advantages, index = [], [], []
    rewards = [float(i % 2) for i in range(args.rollouts)]
    advs = group_advantages(rewards, ["g"] * len(rewards))
    for r in range(args.rollouts):
        context = [rng.randrange(vocab) for _ in range(args.system_tokens)]
        spans = []
        for turn in range(args.turns):
            reply = [rng.randrange(vocab) for _ in range(args.reply_tokens)]
            attrs = {
                sc.LLM_API: "chat.completions",
                sc.LLM_PROMPT_TOKEN_IDS: list(context),
                sc.LLM_COMPLETION_TOKEN_IDS: reply,
                sc.LLM_LOGPROBS: [-1.0] * len(reply),
                sc.LLM_RESPONSE_ID: f"r{r}-{turn}",
                sc.LLM_SOURCE: "gateway",
            }
            spans.append(Span.new(f"ro-{r}", "at-1", sc.SPAN_LLM_CALL, attrs, sequence_id=turn + 1))
            context += reply + [rng.randrange(vocab) for _ in range(args.tool_tokens)]
        made, _ = to_samples(llm_calls(spans), rewards[r], level=level)  # type: ignore[arg-type]
        samples += made
        advantages += [advs[r]] * len(made)
        index += [r] * len(made)
    return samples, advantages, index


def run_multi_turn(args: argparse.Namespace, path: Path, json_path: Path | None) -> dict[str, float]:
    from agl.algorithm.grpo import LossConfig
    from agl.algorithm.grpo.policy import Policy, PolicyConfig

    policy = Policy(
        PolicyConfig(model_path=str(path), lr=args.lr, micro_batch_tokens=args.micro_batch_tokens),
        LossConfig(aggregation="rollout_mean"),
    )
    vocab = int(policy.model.config.vocab_size)
    results = {}
    for level in ("trajectory", "transition"):
        samples, adv, index = multi_turn_samples(level, args, vocab)
        policy.step(samples, adv, index)  # warm-up
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            policy.step(samples, adv, index)
            times.append(time.perf_counter() - t)
        results[level] = statistics.mean(times)
        emit(
            {
                "bench": "grpo_multi_turn",
                "level": level,
                "model": args.model,
                "turns": args.turns,
                "rollouts": args.rollouts,
                "samples": len(samples),
                "processed_tokens": sum(len(s.input_ids) for s in samples),
                "model_tokens": sum(s.num_model_tokens for s in samples),
                "step_s": round(results[level], 3),
            },
            json_path,
        )
    del policy
    gc.collect()
    return results


def run_single_turn(args: argparse.Namespace, path: Path, tasks: list[dict[str, Any]]) -> None:
    """agl then TRL on the same tasks, and their ratio."""
    ours = _summary("agl", args, asyncio.run(run_agl(args, path, tasks)))
    emit(ours, args.json)
    if not args.skip_trl:
        torch.manual_seed(args.seed)
        theirs = _summary("trl", args, run_trl(args, path, tasks))
        theirs["gradient_checkpointing"] = args.trl_gradient_checkpointing
        emit(theirs, args.json)
        emit(
            {
                "bench": "grpo_single_turn_speedup",
                "model": args.model,
                "speedup_step": round(theirs["step_s"] / ours["step_s"], 2),
                "speedup_step_with_update": round(
                    theirs["step_s"] / (ours["step_s_with_update"] or ours["step_s"]), 2
                ),
                "speedup_tokens_per_s": round(
                    (ours["trained_tokens_per_s_with_update"] or ours["trained_tokens_per_s"])
                    / theirs["trained_tokens_per_s"],
                    2,
                ),
                "target": 2.0,
            },
            args.json,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--skip-single-turn", action="store_true")
    parser.add_argument("--skip-multi-turn", action="store_true")
    parser.add_argument("--trl-gradient-checkpointing", action="store_true")
    parser.add_argument("--trl-output", default="/tmp/agl-bench-trl")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--tool-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="append one JSON line per measurement")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    from agl.models import smollm2, tiny_model

    path = smollm2() if args.model == "smollm2" else tiny_model()
    tasks = make_tasks(args.steps * args.prompts, args.seed)

    if not args.skip_single_turn:
        run_single_turn(args, path, tasks)
    if not args.skip_multi_turn:
        times = run_multi_turn(args, path, args.json)
        emit(
            {
                "bench": "grpo_multi_turn_speedup",
                "model": args.model,
                "trajectory_vs_transition": round(times["transition"] / times["trajectory"], 2),
                "target": 2.0,
            },
            args.json,
        )


if __name__ == "__main__":
    main()
