"""The TRL half of ``grpo_vs_trl.py``: TRL's ``GRPOTrainer`` on the given tasks; prints one JSON line of steps.

It runs in its own interpreter, ``.venv-trl`` (``scripts/setup_trl.sh``: torch, trl, datasets and transformers
pinned), so TRL never moves the versions under agl's ``.venv``; ``pip install -e '.[bench]'`` instead puts
trl and datasets beside agl. It imports nothing from agl: ``reward_text`` here is the reward both sides use.

    .venv-trl/bin/python benchmarks/_trl_side.py --model-path DIR --tasks tasks.json --prompts 2 --group 4
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def reward_text(text: str, answer: str) -> float:
    """1 for the right number in the reply, 0.1 for another number, 0 otherwise, less a hair per character.

    The length term only breaks ties: a group whose replies all score alike has nothing to learn, agl then
    skips its update while TRL runs it anyway, and the two would no longer train on the same samples.
    """
    numbers = re.findall(r"-?\d+", text)
    score = 1.0 if answer in numbers else (0.1 if numbers else 0.0)
    return score - len(text) / 10_000


def run(args: argparse.Namespace) -> dict[str, Any]:
    """``args.steps`` GRPO steps, one generation round and one optimizer step each, timed per step."""
    import importlib.metadata as md

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # _tool_task.py, beside this file
    from _tool_task import add

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tasks: list[dict[str, Any]] = json.loads(Path(args.tasks).read_text())
    if len(tasks) != args.steps * args.prompts:
        raise SystemExit(
            f"--tasks holds {len(tasks)} tasks; --steps x --prompts needs {args.steps * args.prompts}"
        )
    rewards_seen: list[list[float]] = []
    ids_seen: list[list[str]] = []  # the task ids of each generation round, to check the prompts match agl's

    def reward_func(completions: list[Any], answer: list[str], **columns: Any) -> list[float]:
        # a conversation's answer is its last assistant turn (tool results follow turns that call tools)
        texts = [
            next((m.get("content") or "" for m in reversed(c) if m.get("role") == "assistant"), "")
            if isinstance(c, list)
            else str(c)
            for c in completions
        ]
        out = [reward_text(t, a) for t, a in zip(texts, answer, strict=True)]
        rewards_seen.append(out)
        ids_seen.append(sorted(set(columns.get("id") or [])))
        return out

    class Timer(TrainerCallback):  # type: ignore[misc]
        """Step wall time (generation, reward, update: TRL generates inside the step) and the token counter."""

        def __init__(self) -> None:
            self.began = self.cpu_began = 0.0
            self.starts: list[float] = []
            self.times: list[float] = []
            self.cpu: list[float] = []
            self.tokens: list[float] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.began, self.cpu_began = time.perf_counter(), time.process_time()
            self.starts.append(self.began)

        def on_step_end(self, *a: Any, **k: Any) -> None:  # (training args, state, control)
            self.times.append(time.perf_counter() - self.began)
            self.cpu.append(time.process_time() - self.cpu_began)  # every thread of this process
            step = a[1].global_step
            if args.save_every and step % args.save_every == 0:
                # the model as it is after this step, for time_to_accuracy.py (outside the step's clocks)
                folder = Path(args.output) / f"step-{step}"
                k["model"].save_pretrained(folder)
                k["processing_class"].save_pretrained(folder)

        def on_log(self, *a: Any, logs: dict[str, float] | None = None, **k: Any) -> None:
            if logs and "num_tokens" in logs:  # cumulative prompt + completion tokens, padding excluded
                self.tokens.append(float(logs["num_tokens"]))

    batch = args.prompts * args.group
    micro = args.micro_batch or batch
    if batch % micro or micro % args.group:
        raise SystemExit(f"--micro-batch {micro} must divide a step's {batch} samples and hold whole groups")
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(args.model_path, local_files_only=True, dtype=torch.float32)
    config = GRPOConfig(
        output_dir=args.output,
        use_cpu=True,
        bf16=args.bf16,
        use_vllm=False,
        report_to="none",
        # a step's samples in micro-batches of --micro-batch (gradients accumulated), generated at once
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro,
        num_generations=args.group,
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # agl keeps the learning rate constant; TRL's default decays it to 0
        max_steps=args.steps,
        beta=0.0,
        loss_type="dapo",  # token mean, as agl's default loss
        logging_steps=1,
        save_strategy="no",
        shuffle_dataset=False,  # the tasks in the order given: the same prompts per step as the agl sides
        gradient_checkpointing=args.gradient_checkpointing,
        max_tool_calling_iterations=args.max_tool_calls if args.tools else None,
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    timer = Timer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_func,
        args=config,
        train_dataset=Dataset.from_list(tasks),
        processing_class=tokenizer,
        callbacks=[timer],
        tools=[add] if args.tools else None,
    )
    setup_s = time.perf_counter() - started
    trainer.train()
    steps, previous = [], 0.0
    # step start to the next one's (the last step, with no next one, counts its own time)
    walls = [b - a for a, b in zip(timer.starts[:-1], timer.starts[1:], strict=True)] + timer.times[-1:]
    for i, seconds in enumerate(timer.times):
        total = timer.tokens[i] if i < len(timer.tokens) else previous
        rewards = rewards_seen[i] if i < len(rewards_seen) else [float("nan")]
        steps.append(
            {
                "step_s": seconds,
                "train_s": seconds,
                "cpu_s": timer.cpu[i],
                "wall_s": walls[i],  # TRL's logging between steps too
                "tokens": total - previous,
                "reward": sum(rewards) / len(rewards),
                "samples": float(args.prompts * args.group),  # TRL trains every sample, tied groups too
                "task_ids": ids_seen[i] if i < len(ids_seen) else [],
            }
        )
        previous = total
    del trainer, model
    gc.collect()
    versions = {name: md.version(name) for name in ("trl", "transformers", "torch", "datasets")}
    return {"steps": steps, "setup_s": setup_s, "versions": versions}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument(
        "--tasks", required=True, help="JSON list of {prompt, answer}, steps x prompts, in order"
    )
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--prompts", type=int, required=True, help="prompts per step")
    parser.add_argument("--group", type=int, required=True, help="completions per prompt")
    parser.add_argument(
        "--max-tokens",
        type=int,
        required=True,
        help="max_completion_length (with --tools: the whole conversation's)",
    )
    parser.add_argument("--tools", action="store_true", help="the add tool of _tool_task.py (multi-turn)")
    parser.add_argument(
        "--max-tool-calls", type=int, default=4, help="max_tool_calling_iterations with --tools"
    )
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--micro-batch", type=int, default=0, help="samples per forward/backward (0: the whole step's)"
    )
    parser.add_argument("--bf16", action="store_true", help="bf16=True: mixed precision (autocast) on CPU")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument(
        "--save-every", type=int, default=0, help="save the model every N steps as OUTPUT/step-N (0: never)"
    )
    parser.add_argument(
        "--output",
        default="/tmp/agl-bench-trl",
        help="TRL's output_dir (only --save-every's models go there)",
    )
    parser.add_argument("--result", type=Path, default=None, help="write the JSON here instead of stdout")
    args = parser.parse_args()
    got = json.dumps(run(args))
    if args.result is None:
        print(got, flush=True)
    else:
        args.result.write_text(got)


if __name__ == "__main__":
    main()
