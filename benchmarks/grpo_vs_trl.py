"""GRPO step speed on CPU: agl through ``Trainer.fit``, agl in process, and TRL's ``GRPOTrainer``, same everything.

TRL runs in its own venv so it never moves agl's torch or transformers: ``bash scripts/setup_trl.sh`` makes
``.venv-trl`` (pinned torch, trl, datasets), found by default (``AGL_TRL_VENV`` names another such venv, as it
does for the script); ``--trl-python`` names another interpreter (one with ``pip install -e '.[bench]'``, say).

Part 1, single turn, three sides on the same model, prompts, reward, group size, completion length, learning
rate and steps; each side a fresh process per round, rounds in alternating order (reversed every other round):
- ``fit``: ``agl.Trainer(algorithm=agl.GRPO(...)).fit(agent, tasks)`` with an ``@agl.rollout`` agent calling the
  model through the openai SDK: store, runners, gateway and built-in engine, exactly what a user runs;
- ``fit_async``: the same with ``GRPOConfig(async_rollouts=True, max_staleness=1)``: step n+1's rollouts are
  generated while step n trains (one weight version off-policy at most); its last step has nothing left to
  overlap with, so it is left out of the medians like the first;
- ``inproc``: the built-in engine called in process, spans, ``build_batch``, ``Policy.step``, weight sync
  (the same policy settings as ``fit``; the gap to ``fit`` is what the store, runners and gateway cost);
- ``trl``: ``GRPOTrainer`` (``benchmarks/_trl_side.py``), ``use_cpu=True``, no vLLM, ``loss_type="dapo"`` (token
  mean, as agl's default), ``beta=0``, ``gradient_checkpointing=False`` unless ``--trl-gradient-checkpointing``,
  the step's samples in one forward/backward unless ``--trl-micro-batch N`` (gradients accumulated over them),
  ``bf16`` as agl's ``--precision`` (fp32 by default, as agl's ``auto``; ``--trl-precision bf16`` runs TRL in
  bf16, its own default, as a variant: the result file's name says each side's precision).
The first step of each round is warm-up and left out. Per side: medians over the other steps of ``step_s`` (the
side's own step time: generation + update (+ sync)) and ``wall_s`` (step start to next step start: everything the
loop does between steps too), and of trained tokens/s (the prompt + completion tokens of the samples the step
trained / ``step_s``). Then the ratios: each round's own (its sides ran back to back), their median and range
(min-max), and the ratio of the medians over all rounds. The reward (right number 1, other number 0.1, less a hair
per character) rarely ties a group; agl skips a tied group, TRL trains it, so the run fails, naming the round and
step, when the sides trained different sample counts in a step.
Part 1 with ``--task tools``, a 5-turn tool agent: add five numbers with an ``add`` tool, two at a time, then
reply with the total (``_tool_task.py``). SmolLM2 gets Qwen 2.5's chat template (TRL parses tool calls only from
templates it knows) and a short tool-calling SFT warm start, cached; every side loads that model. The agl
agent loops over openai-SDK calls with ``tools=`` (``--max-tokens`` each); TRL runs its own tool loop
(``tools=[add]``, ``max_tool_calling_iterations`` = turns - 1, ``max_completion_length`` the whole
conversation's budget). Trained tokens are the prompt's and the generated ones (TRL leaves tool results out).
Part 2, a synthetic 5-turn agent (5 calls whose prompts extend each other): one ``Policy.step`` on trajectory-level
samples (one merged sequence per rollout) vs transition-level samples (one per call): tokens processed, step time.

    .venv/bin/python benchmarks/grpo_vs_trl.py --model tiny --steps 3 --rounds 1 --skip-multi-turn
    .venv/bin/python benchmarks/grpo_vs_trl.py --model smollm2 --steps 4 --rounds 3 --skip-multi-turn --sides fit,trl
    .venv/bin/python benchmarks/grpo_vs_trl.py --model smollm2 --steps 4 --skip-multi-turn --sides fit,trl \
        --trl-precision bf16
    .venv/bin/python benchmarks/grpo_vs_trl.py --task tools --steps 5 --skip-multi-turn \
        --sides fit_async,fit,trl
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agl import semconv as sc  # noqa: E402
from agl.schemas import Rollout, RolloutStatus, Span  # noqa: E402
from benchmarks import _results  # noqa: E402
from benchmarks import _tool_task as tool_task  # noqa: E402
from benchmarks._grpo_summary import (  # noqa: E402
    RATIOS,
    SIDES,
    Seen,
    agl_precision,
    ratios,
    require_same_samples,
    sample_mismatches,
    split_steps,
    summarize,
    table,
    trained_rollouts,
    trl_precision,
    variant_name,
)
from benchmarks._trl_side import reward_text  # noqa: E402

TOOL_RESULT_TOKENS = 16  # a tool result between two turns, as Qwen's template wraps it: about 15 tokens
# the TRL side's interpreter: scripts/setup_trl.sh's venv, which AGL_TRL_VENV moves as it moves the script's target
TRL_PYTHON = Path(os.environ.get("AGL_TRL_VENV") or ROOT / ".venv-trl") / "bin" / "python"


def make_pool(n: int, seed: int, task: str = "sums") -> list[dict[str, Any]]:
    """Small sums: a chat prompt, the expected answer and an id (to check every side got the same prompts).

    ``task="tools"``: the 5-turn tool task of ``_tool_task.py`` instead."""
    if task == "tools":
        return tool_task.make_pool(n, seed)
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        a, b = rng.randrange(1, 20), rng.randrange(1, 20)
        content = f"What is {a} + {b}? Reply with the number only."
        tasks.append({"id": f"t{i}", "prompt": [{"role": "user", "content": content}], "answer": str(a + b)})
    return tasks


def plan_steps(pool: list[dict[str, Any]], steps: int, prompts: int, seed: int) -> list[list[dict[str, Any]]]:
    """Each step's tasks, drawn as GRPO in ``fit`` draws them (``random.Random(seed)``, ``sample`` per step).

    The fit side records the tasks its agent saw, and the summary says whether they matched this plan.
    """
    rng = random.Random(seed)
    return [rng.sample(pool, min(prompts, len(pool))) for _ in range(steps)]


EMITTED: list[dict[str, Any]] = []  # every row printed, for the result file


def emit(row: dict[str, Any], json_path: Path | None) -> None:
    EMITTED.append(row)
    line = json.dumps(row, sort_keys=True)
    print(line, flush=True)
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        with json_path.open("a") as fh:
            fh.write(line + "\n")


def _walls(starts: list[float], last_step_s: float) -> list[float]:
    """Step start to the next step's start; the last step, with no next one, counts its own time."""
    return [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)] + [last_step_s]


# ----- the tool task's model -----------------------------------------------------------------------------------
def tool_model(args: argparse.Namespace, base: Path) -> Path:
    """``base`` with Qwen 2.5's chat template and a tool-calling SFT warm start: the model all sides load.

    TRL parses tool calls only from chat templates it knows, so the template is TRL's own copy of Qwen 2.5's
    (read from ``--trl-python``); SmolLM2 shares its ``<|im_start|>``/``<|im_end|>`` tokens. The warm start
    (agl's SFT step on correct conversations of other tasks) teaches the tool-call format, so that rollouts
    take all five turns. Cached under ``~/.cache/agl/bench`` by base, template and warm-start settings.
    """
    import hashlib
    import shutil

    if not args.trl_python.exists():
        raise SystemExit(f"--task tools takes Qwen 2.5's template from TRL: {args.trl_python} is missing")
    template = subprocess.run(
        [
            str(args.trl_python),
            "-c",
            "import trl.chat_template_utils as u; print(u.qwen2_5_chat_template, end='')",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    settings = f"{base.resolve()}|{template}|{args.warm_steps}|{args.seed}|{args.precision}|v1"
    out = (
        Path.home()
        / ".cache"
        / "agl"
        / "bench"
        / f"tools-{hashlib.sha256(settings.encode()).hexdigest()[:12]}"
    )
    if (out / "config.json").exists():
        return out
    from transformers import AutoTokenizer

    from agl.algorithm.grpo import LossConfig, WarmStart
    from agl.algorithm.grpo.warm_start import train_warm_start
    from agl.algorithm.policy import Policy, PolicyConfig

    started = time.perf_counter()
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(base, staging)
    tokenizer = AutoTokenizer.from_pretrained(staging)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(staging)
    policy = Policy(
        PolicyConfig(model_path=str(staging), lr=1e-4, precision=args.precision, seed=args.seed), LossConfig()
    )
    warm = WarmStart(
        conversations=[tool_task.trace(t) for t in tool_task.make_pool(256, args.seed + 1)],
        tools=[tool_task.tool_schema()],
        steps=args.warm_steps,
        batch_size=16,
        seed=args.seed,
    )
    rows = train_warm_start(policy, warm)
    policy.model.save_pretrained(staging)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    losses = ", ".join(f"{r['sft_loss']:.3f}" for r in rows[:: max(1, len(rows) // 8)])
    print(
        f"tool model: {args.warm_steps} warm-start steps in {time.perf_counter() - started:.0f}s "
        f"(loss {losses}): {out}",
        flush=True,
    )
    return out


# ----- agl through Trainer.fit --------------------------------------------------------------------------------
def run_fit(
    args: argparse.Namespace, path: Path, pool: list[dict[str, Any]], overlap: bool = False
) -> dict[str, Any]:
    """``Trainer.fit`` on ``pool`` as a user calls it; the agent records when each rollout began and its tokens.

    ``overlap``: async rollouts, one step ahead of training."""
    import openai

    import agl
    from agl.algorithm.grpo import GRPO, GRPOConfig

    per_step = args.prompts * args.group
    seen: list[Seen] = []  # every rollout, in finishing order
    sampling = {} if args.temperature is None else {"temperature": args.temperature}

    def client_for(llm: agl.LLM) -> openai.AsyncOpenAI:
        """The rollout's client: over the runner's shared connections, or (``fresh``) a new one per rollout."""
        if args.agent_client == "fresh":  # ~30 ms of CPU each for its SSL context, on the runner's loop
            return openai.AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key or "unused", max_retries=0)
        return agl.openai_client(llm, max_retries=0)

    @agl.rollout
    async def agent(task: dict[str, Any], llm: agl.LLM, rollout: Rollout) -> float:
        began = time.perf_counter()
        async with client_for(llm) as client:
            reply = await client.chat.completions.create(
                model=llm.model, messages=task["prompt"], max_tokens=args.max_tokens, **sampling
            )
        tokens = reply.usage.total_tokens if reply.usage else 0
        reward = reward_text(reply.choices[0].message.content or "", task["answer"])
        seen.append(Seen.of(rollout, began, task["id"], tokens, reward))
        return reward

    @agl.rollout
    async def tool_agent(task: dict[str, Any], llm: agl.LLM, rollout: Rollout) -> float:
        """Up to ``--turns`` model calls: run the tool calls of each reply, stop at a reply without any."""
        began = time.perf_counter()
        async with client_for(llm) as client:
            answer, tokens = await tool_task.converse(
                client, llm.model, task, turns=args.turns, max_tokens=args.max_tokens, **sampling
            )
        reward = reward_text(answer, task["answer"])
        seen.append(Seen.of(rollout, began, task["id"], tokens, reward))
        return reward

    config = GRPOConfig(
        model_path=str(path),
        steps=args.steps,
        tasks_per_step=args.prompts,
        group_size=args.group,
        lr=args.lr,
        micro_batch_tokens=args.micro_batch_tokens,
        eval_every=0,  # no validation: only training steps are timed
        export_model=False,  # writing the model after the last step is not a step
        precision=args.precision,  # the built-in engine resolves "auto" as the policy does
        seed=args.seed,
        async_rollouts=overlap,
        max_staleness=1,
        checkpoint_every=args.checkpoint_every,  # time_to_accuracy.py evaluates them after the run
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agl-bench-fit-") as temporary:
        out = args.output_dir or temporary
        # one runner slot per rollout of a step: a step's rollouts are generated together, as on the other sides
        trainer = agl.Trainer(algorithm=GRPO(config), n_runners=per_step, output_dir=out)
        result = trainer.fit(tool_agent if args.task == "tools" else agent, pool)
    history = result["history"]
    if len(seen) != per_step * len(history):
        raise RuntimeError(f"{len(seen)} rollouts finished for {len(history)} steps of {per_step}")
    chunks = split_steps(seen, per_step, len(history))
    starts = [min(c.began for c in chunk) for chunk in chunks]
    steps = []
    walls = _walls(starts, history[-1]["step_time_s"]) if history else []
    for i, (row, chunk, wall) in enumerate(zip(history, chunks, walls, strict=True)):
        trained = trained_rollouts(chunk)
        if args.task == "sums" and len(trained) != row["samples"]:  # one sample per rollout here
            raise RuntimeError(
                f"step {i + 1}: {len(trained)} rollouts in groups whose rewards differ, but agl trained "
                f"{row['samples']:g} samples: the benchmark's tie rule no longer matches build_batch's"
            )
        steps.append(
            {
                "step_s": row["step_time_s"],
                "wall_s": wall,
                "gen_s": row["rollout_time_s"],
                "update_s": row.get("update_time_s", 0.0),
                # the step without its checkpoint's saving (time_to_accuracy.py's clocks)
                "train_s": row["step_time_s"] - row.get("checkpoint_time_s", 0.0),
                "cpu_s": row["cpu_time_s"] - row.get("checkpoint_cpu_s", 0.0),
                "tokens": float(sum(c.tokens for c in trained)),  # the trained samples' alone
                "generated_tokens": float(sum(c.tokens for c in chunk)),
                "reward": row["reward_mean"],
                "samples": row["samples"],
                "task_ids": sorted({c.task_id for c in chunk}),
            }
        )
    return {"steps": steps, "setup_s": starts[0] - started if starts else None}


# ----- agl in process -----------------------------------------------------------------------------------------
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


async def run_inproc(
    args: argparse.Namespace, path: Path, plan: list[list[dict[str, Any]]]
) -> dict[str, Any]:
    """Each step: P x G completions from the engine, spans -> ``build_batch`` -> ``Policy.step`` -> weight sync."""
    from agl.algorithm.grpo import GRPOConfig, build_batch
    from agl.algorithm.policy import Policy, PolicyConfig
    from agl.engines.builtin import Engine, SamplingParams

    started = time.perf_counter()
    config = GRPOConfig(
        model_path=str(path),
        group_size=args.group,
        lr=args.lr,
        micro_batch_tokens=args.micro_batch_tokens,
        precision=args.precision,
        seed=args.seed,
    )
    policy = Policy(  # the policy GRPO builds in fit, from the same config
        PolicyConfig(
            model_path=str(path),
            lr=config.lr,
            max_grad_norm=config.max_grad_norm,
            micro_batch_tokens=config.micro_batch_tokens,
            activation_checkpointing=config.activation_checkpointing,
            precision=config.precision,
            seed=config.seed,
        ),
        config.loss,
    )
    engine = Engine(path, precision=config.precision)  # as fit serves it
    setup_s = time.perf_counter() - started
    steps: list[dict[str, Any]] = []
    starts: list[float] = []
    for step, batch_tasks in enumerate(plan):
        began = time.perf_counter()
        starts.append(began)
        prompts = [engine.encode_chat(t["prompt"]) for t in batch_tasks]
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, n=args.group)
        gens = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
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
        update_s = sync_s = 0.0
        if batch.samples:  # a step whose groups all tied has nothing to learn from, as in fit
            t = time.perf_counter()
            policy.step(batch.samples, batch.advantages, batch.rollout_index)
            update_s = time.perf_counter() - t
            t = time.perf_counter()
            await engine.update_weights(policy.engine_weights())
            sync_s = time.perf_counter() - t
        steps.append(
            {
                "step_s": time.perf_counter() - began,
                "gen_s": generated - began,
                "update_s": update_s,
                "sync_s": sync_s,
                "tokens": float(sum(len(x.input_ids) for x in batch.samples)),  # trained: prompt + completion
                "generated_tokens": float(
                    sum(len(g.prompt_token_ids) + len(c.token_ids) for g in gens for c in g.choices)
                ),
                "reward": sum(rewards) / len(rewards),
                "samples": float(len(batch.samples)),
                "task_ids": sorted(t["id"] for t in batch_tasks),
            }
        )
    for s, wall in zip(steps, _walls(starts, steps[-1]["step_s"]), strict=True):
        s["wall_s"] = wall
    del policy, engine
    gc.collect()
    return {"steps": steps, "setup_s": setup_s}


# ----- one side, in its own process ---------------------------------------------------------------------------
def side_command(side: str, args: argparse.Namespace, path: Path, plan_file: Path, result: Path) -> list[str]:
    """The command line of one side's process: the shared settings, then the side's own."""
    shared = ["--steps", str(args.steps), "--prompts", str(args.prompts), "--group", str(args.group)]
    shared += ["--lr", str(args.lr), "--threads", str(args.threads), "--seed", str(args.seed)]
    shared += ["--result", str(result)]
    shared += [] if args.temperature is None else ["--temperature", str(args.temperature)]
    if side == "trl":
        own = [
            "--model-path",
            str(path),
            "--tasks",
            str(plan_file),
            "--output",
            str(result.with_suffix(".out")),
        ]
        own += ["--gradient-checkpointing"] if args.trl_gradient_checkpointing else []
        own += ["--micro-batch", str(args.trl_micro_batch)] if args.trl_micro_batch else []
        own += ["--bf16"] if trl_precision(args) == "bf16" else []
        if args.task == "tools":  # TRL's budget is the whole conversation's: every turn and tool result
            own += ["--tools", "--max-tool-calls", str(args.turns - 1)]
            own += ["--max-tokens", str(args.turns * args.max_tokens + (args.turns - 1) * TOOL_RESULT_TOKENS)]
        else:
            own += ["--max-tokens", str(args.max_tokens)]
        return [str(args.trl_python), str(ROOT / "benchmarks" / "_trl_side.py"), *shared, *own]
    own = ["--model", args.model, "--side", side, "--pool-size", str(args.pool_size)]
    own += ["--micro-batch-tokens", str(args.micro_batch_tokens), "--precision", args.precision]
    own += ["--max-tokens", str(args.max_tokens), "--task", args.task, "--turns", str(args.turns)]
    own += ["--model-dir", str(path), "--agent-client", args.agent_client]
    return [sys.executable, str(Path(__file__).resolve()), *shared, *own]


def run_side(
    side: str, args: argparse.Namespace, path: Path, work: Path, round_: int, extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """One side for ``--steps`` steps in a fresh process (``extra``: more of its options); its output goes to a
    log file, its steps come back."""
    plan_file, result = work / "plan.json", work / f"{side}-r{round_}.json"
    log = work / f"{side}-r{round_}.log"
    started = time.perf_counter()
    with log.open("w") as fh:
        proc = subprocess.run(
            [*side_command(side, args, path, plan_file, result), *extra],
            stdout=fh,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
            timeout=args.side_timeout,
        )
    if proc.returncode != 0 or not result.exists():
        tail = log.read_text(errors="replace")[-3000:]
        return {"error": f"{side} exited with {proc.returncode}; the end of {log}:\n{tail}"}
    out: dict[str, Any] = json.loads(result.read_text())
    out["process_s"] = time.perf_counter() - started
    out["round"] = round_
    return out


def run_single_turn(args: argparse.Namespace, path: Path) -> tuple[bool, dict[str, list[dict[str, Any]]]]:
    """Every side ``--rounds`` times, order reversed every other round; False when a side failed, and each
    side's rounds. Exits (after the table) when the sides trained different sample counts in a step."""
    sides = [s for s in SIDES if s in args.sides]
    pool = make_pool(args.pool_size, args.seed, args.task)
    plan = plan_steps(pool, args.steps, args.prompts, args.seed)
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    ok = True
    with tempfile.TemporaryDirectory(prefix="agl-bench-grpo-") as tmp:
        work = Path(args.log_dir) if args.log_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        trl_tasks = [{k: t[k] for k in ("id", "prompt", "answer")} for step in plan for t in step]
        (work / "plan.json").write_text(json.dumps(trl_tasks))
        for round_ in range(args.rounds):
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                print(f"round {round_ + 1}/{args.rounds}: {side} ...", flush=True)
                got = run_side(side, args, path, work, round_)
                if "error" in got:
                    print(got["error"], file=sys.stderr, flush=True)
                    ok = False
                    continue
                runs[side].append(got)
                times = ", ".join(f"{s['step_s']:.2f}" for s in got["steps"])
                samples = ", ".join(f"{s['samples']:g}" for s in got["steps"])
                print(
                    f"  {side}: step s [{times}], samples [{samples}], process {got['process_s']:.1f}s",
                    flush=True,
                )
    rows = {s: summarize(s, args, r, plan) for s, r in runs.items() if r}
    per_round = [
        {s: summarize(s, args, [run], plan) for s, got in runs.items() for run in got if run["round"] == i}
        for i in range(args.rounds)
    ]
    for row in rows.values():
        emit(row, args.json)
    ratio_rows = ratios(rows, per_round)
    for q in ratio_rows:
        emit(q, args.json)
    print(table(rows, ratio_rows), flush=True)
    if args.allow_unequal_samples:  # a smoke run: say so, go on
        for line in sample_mismatches(runs):
            print(f"unequal samples (allowed): {line}", flush=True)
    else:
        require_same_samples(runs)
    return ok, runs


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
    from agl.algorithm.policy import Policy, PolicyConfig

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


def _micro_batch_tokens(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _sides(value: str) -> list[str]:
    names = [s.strip() for s in value.split(",") if s.strip()]
    unknown = sorted(set(names) - set(SIDES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"--sides takes a comma-separated subset of {','.join(SIDES)}, got {value!r}"
        )
    return names


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument(
        "--sides", type=_sides, default=list(SIDES), help="comma-separated: fit_async,fit,inproc,trl"
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="steps per side and round (the first is warm-up)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="times each side runs, the sides back to back, alternating the order; ratios per round",
    )
    parser.add_argument("--prompts", type=int, default=2, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument(
        "--task",
        choices=["sums", "tools"],
        default="sums",
        help="sums: one call per rollout; tools: --turns calls with an add tool, after a warm start",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="completion tokens per model call (32; tools: 48)"
    )
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--pool-size", type=int, default=64, help="tasks the steps draw their prompts from")
    parser.add_argument("--micro-batch-tokens", type=_micro_batch_tokens, default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--agent-client",
        choices=["shared", "fresh"],
        default="shared",
        help="fit's agent: agl.openai_client(llm) (shared connections) or a new openai.AsyncOpenAI per rollout",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-python", type=Path, default=TRL_PYTHON, help="an interpreter with trl, datasets"
    )
    parser.add_argument("--trl-gradient-checkpointing", action="store_true")
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=0,
        help="TRL's samples per forward/backward, a multiple of --group (0: the whole step at once)",
    )
    parser.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16"],
        default="fp32",
        help="agl's GRPOConfig.precision (auto: agl's default, bf16 on a CPU with native bf16, else fp32)",
    )
    parser.add_argument(
        "--trl-precision",
        choices=["same", "fp32", "bf16"],
        default="same",
        help="TRL's bf16 flag: same (as agl's --precision), fp32 (bf16=False) or bf16 (bf16=True, TRL's default)",
    )
    parser.add_argument("--side-timeout", type=float, default=3600.0, help="seconds one side's run may take")
    parser.add_argument("--log-dir", default=None, help="keep each side's log here (default: a temp folder)")
    parser.add_argument("--skip-single-turn", action="store_true")
    parser.add_argument("--skip-multi-turn", action="store_true")
    parser.add_argument(
        "--allow-unequal-samples",
        action="store_true",
        help="report, instead of failing on, steps where the sides trained different sample counts "
        "(smoke runs on the tiny model, whose groups may tie on one side only)",
    )
    parser.add_argument("--turns", type=int, default=5, help="model calls per rollout (tools; Part 2)")
    parser.add_argument(
        "--warm-steps", type=int, default=8, help="tools: SFT steps of the tool-calling warm start"
    )
    parser.add_argument("--rollouts", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=64)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--tool-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="append one JSON line per measurement")
    parser.add_argument(
        "--side", choices=["fit_async", "fit", "inproc"], help=argparse.SUPPRESS
    )  # a side's own process
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="agl sides' sampling temperature (default: the engine's)",
    )
    # a fit side's checkpoints, for time_to_accuracy.py: every N steps under OUTPUT_DIR/checkpoints/
    parser.add_argument("--checkpoint-every", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)  # the model a side loads
    _results.add_arguments(parser)
    args = parser.parse_args()
    if args.max_tokens is None:
        args.max_tokens = 48 if args.task == "tools" else 32
    if args.task == "tools" and "inproc" in args.sides and args.side is None:
        parser.error("--task tools runs the fit_async, fit and trl sides (inproc has no multi-turn agent)")
    for name in ("steps", "rounds", "prompts", "group", "max_tokens", "pool_size", "threads", "turns"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.pool_size < args.prompts:
        parser.error(f"--pool-size ({args.pool_size}) must be >= --prompts ({args.prompts})")
    if args.side is not None and args.result is None:
        parser.error("--side runs one side for the benchmark, which passes --result")
    wants_trl = args.side is None and not args.skip_single_turn and "trl" in args.sides
    if wants_trl and not args.trl_python.exists():
        raise SystemExit(
            f"the trl side needs {args.trl_python}: run `bash scripts/setup_trl.sh` (makes .venv-trl), "
            "pass --trl-python, or leave it out with --sides fit,inproc"
        )

    import torch

    torch.set_num_threads(args.threads)
    from agl.models import smollm2, tiny_model

    path = smollm2() if args.model == "smollm2" else tiny_model()
    if args.model_dir is not None:
        path = args.model_dir
    elif args.task == "tools" and not args.skip_single_turn:
        path = tool_model(args, path)
    if args.side is not None:  # one side's process: run it, hand its steps back through --result
        pool = make_pool(args.pool_size, args.seed, args.task)
        plan = plan_steps(pool, args.steps, args.prompts, args.seed)
        if args.side == "inproc":
            got = asyncio.run(run_inproc(args, path, plan))
        else:
            got = run_fit(args, path, pool, overlap=args.side == "fit_async")
        args.result.write_text(json.dumps(got))
        return
    recorder = _results.Recorder("grpo_vs_trl", args)
    ok, runs = True, dict[str, list[dict[str, Any]]]()
    if not args.skip_single_turn:
        ok, runs = run_single_turn(args, path)
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
    save(recorder, args, runs)
    if not ok:
        raise SystemExit("a side failed: see its log above")


def save(
    recorder: _results.Recorder, args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]
) -> None:
    """The result file. Its headline: each round's step speed-up of the first side over TRL (else over the
    next side); one side alone, its step times (every round's steps after the first); else Part 2's ratio."""
    paired = [r for r in EMITTED if r.get("bench", "").endswith("_ratio") and r.get("speedup_step_median")]
    pick = next((r for r in paired if r["over"] == "trl"), paired[0] if paired else None)
    side = next((s for s in SIDES if runs.get(s)), None)
    if pick is not None:
        metric = f"{pick['side']} over {pick['over']} speed-up per step"
        unit = f"x ({pick['over']} s/step / {pick['side']} s/step, one value per round)"
        values, better = [v for v in pick["speedup_step_rounds"] if v is not None], "higher"
    elif side is not None:
        metric, unit = f"{side} step_s", "s per GRPO step (steps after each round's first)"
        values = [s["step_s"] for run in runs[side] for s in run["steps"][1:]]
        values = values or [s["step_s"] for run in runs[side] for s in run["steps"]]
        better = "lower"
    else:
        multi = [r for r in EMITTED if r.get("bench") == "grpo_multi_turn_speedup"]
        if not multi:
            return
        metric, unit, better = "trajectory_vs_transition", "x, 5-turn step speed-up", "higher"
        values = [multi[0]["trajectory_vs_transition"]]
    summary: dict[str, Any] = {"rows": EMITTED}
    summary["precision"] = {"agl": agl_precision(args), "trl": trl_precision(args)}
    summary["ratios"] = {
        f"{q['side']}/{q['over']}": {
            name: {
                "median_of_rounds": q[f"{name}_median"],
                "range_of_rounds": q[f"{name}_range"],
                "rounds": q[f"{name}_rounds"],
                "of_medians": q[name],
            }
            for name in RATIOS
        }
        for q in paired
    }
    rounds = [{"side": s, "round": i, **run} for s, got in runs.items() for i, run in enumerate(got)]
    recorder.save(
        metric=metric,
        unit=unit,
        values=values,
        runs=rounds or EMITTED,
        summary=summary,
        variant=variant_name(args),
        better=better,
    )


if __name__ == "__main__":
    main()
