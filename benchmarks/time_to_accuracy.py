"""Time to accuracy: how long agl's ``fit`` and TRL's ``GRPOTrainer`` take to bring one tool agent to a held-out score.

The task is ``grpo_vs_trl.py --task tools`` (``_tool_task.py``): add five numbers with an ``add`` tool, two at a
time, then say the total. TRL cannot run a LangGraph agent (it runs its own tool loop), so the agent is this one
on both sides: agl's an ``@agl.rollout`` loop of openai-SDK calls through ``Trainer.fit``, TRL's its
``tools=[add]`` loop. Both sides start from the same model (SmolLM2 with Qwen 2.5's template and a short
tool-calling SFT warm start, made once by ``grpo_vs_trl.tool_model``), see the same tasks in the same order and
use the same group size, tasks per step, completion budget (per call on agl's side; the whole conversation's on
TRL's, as ``grpo_vs_trl.py`` sets it), learning rate and sampling temperature; agl skips groups whose rewards tie
(nothing to learn), TRL trains them. Each side keeps its memory bounded its own way: agl's token-sized
micro-batches, TRL a group per forward/backward with the gradients accumulated over the step.

Each side runs in its own process and saves its model every ``--eval-every`` steps; the saving is outside its
clocks. After both sides finish, one evaluator scores every saved model, and the shared starting model, on the
same held-out tasks (greedy, ``agl.evaluate_models``, exact total = 1): accuracy against each side's cumulative
training time (wall seconds of its steps) and CPU seconds (all its threads; agl's include its in-process engine).
From those curves: the time each side took to reach each ``--targets`` score and the best score both reached, and
agl's time over TRL's (the goal: <= 0.5). Seeds change the training (task order, sampling), never the held-out set.
``--earlier FILE`` adds a committed result's seeds (made with the same settings, read back from its command) to
the report, so the seeds of a run this long can be run and committed one at a time.

    python benchmarks/time_to_accuracy.py                                   # SmolLM2, 2 seeds
    python benchmarks/time_to_accuracy.py --seeds 0 --out DIR --no-save     # a seed a command (over an hour each),
    python benchmarks/time_to_accuracy.py --seeds 0,1 --out DIR --reuse     # ... then one report of both
    python benchmarks/time_to_accuracy.py --seeds 1 --earlier benchmarks/results/time_to_accuracy/SEED0.json
    python benchmarks/time_to_accuracy.py --model tiny --steps 2 --eval-every 1 --test 4 --seeds 0 --no-save
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks import _results, grpo_vs_trl  # noqa: E402
from benchmarks import _tool_task as tool_task  # noqa: E402

SIDES = ("fit", "trl")
HELD_OUT_SEED = 10_000  # the held-out tasks' seed: fixed, whatever the training seed
WARM_START_SEED = 1000  # the shared starting model's, likewise (apart from the training seeds' tasks)

#: what a seed's run depends on besides the seed: a run reused with ``--reuse`` must match them all
RUN_SETTINGS = (
    "model",
    "steps",
    "eval_every",
    "test",
    "prompts",
    "group",
    "lr",
    "temperature",
    "max_tokens",
    "turns",
    "warm_steps",
    "precision",
    "threads",
)


def side_args(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """``grpo_vs_trl.py``'s settings for one side's run of the tool task."""
    bench = argparse.Namespace(**vars(args))
    bench.seed, bench.task, bench.pool_size = seed, "tools", args.steps * args.prompts
    bench.agent_client, bench.micro_batch_tokens, bench.trl_gradient_checkpointing = "shared", "auto", False
    # TRL trains a group at a time (gradients accumulated over the step): its whole step at once, 16 five-turn
    # conversations without checkpointing, held 19.5 GB on SmolLM2 and was killed on a 24 GB machine
    bench.trl_micro_batch = args.group
    return bench


def run_side(side: str, args: argparse.Namespace, model: Path, seed: int, out: Path) -> dict[str, Any]:
    """One side's training run (``grpo_vs_trl.run_side``, saving every ``--eval-every`` steps): its steps
    (clocks, reward) and its saved models by step."""
    print(f"seed {seed}: {side} training {args.steps} steps (log: {out / side}-r0.log)", flush=True)
    if side == "trl":
        extra = ("--save-every", str(args.eval_every), "--output", str(out / "trl"))
    else:
        extra = ("--checkpoint-every", str(args.eval_every), "--output-dir", str(out / "fit"))
    got = grpo_vs_trl.run_side(side, side_args(args, seed), model, out, 0, extra)
    if "error" in got:
        raise SystemExit(f"seed {seed}: {got['error']}")
    if side == "trl":
        saved = {int(p.name.split("-")[1]): p for p in (out / "trl").glob("step-*")}
    else:
        saved = {int(p.name.split("-")[1]): p for p in (out / "fit").rglob("checkpoints/step-*")}
    return {"steps": got["steps"], "saved": dict(sorted(saved.items()))}


def evaluate(
    args: argparse.Namespace, models: dict[str, Path], test: list[dict[str, Any]], out: Path
) -> dict[str, Any]:
    """Every model on the held-out tasks, greedy, by one evaluator: the share answered with the exact total."""
    import agl

    @agl.rollout
    async def adder(task: dict[str, Any], llm: agl.LLM) -> float:
        async with agl.openai_client(llm, max_retries=0) as client:
            answer, _ = await tool_task.converse(
                client,
                llm.model,
                task,
                turns=args.turns,
                max_tokens=args.max_tokens,
                **llm.sampling_parameters,
            )
        return float(task["answer"] in tool_task.numbers_in(answer))

    result = agl.evaluate_models(
        adder,
        test,
        models,
        output_dir=out,
        serving=agl.Serving(sampling={"temperature": 0.0}),
        n_runners=min(16, len(test)),
    )
    return {
        m.label: {"accuracy": m.mean_reward, "failed": m.failures.failed, "rollouts": m.failures.total}
        for m in result.models
    }


def curve(
    side: dict[str, Any], scores: dict[str, Any], prefix: str, start: dict[str, Any]
) -> list[dict[str, Any]]:
    """(step, cumulative training wall and CPU seconds, held-out accuracy), from the start to each saved model."""
    points = [{"step": 0, "train_s": 0.0, "cpu_s": 0.0, **start}]
    train_s = cpu_s = 0.0
    for number, step in enumerate(side["steps"], start=1):
        train_s += step["train_s"]
        cpu_s += step["cpu_s"]
        if number in side["saved"]:
            points.append(
                {"step": number, "train_s": train_s, "cpu_s": cpu_s, **scores[f"{prefix}-{number}"]}
            )
    return points


def time_to(points: list[dict[str, Any]], target: float, clock: str) -> float | None:
    """The ``clock`` seconds at the first evaluation at or above ``target``; None if none reached it."""
    return next((p[clock] for p in points if p["accuracy"] is not None and p["accuracy"] >= target), None)


def best_accuracy(points: list[dict[str, Any]]) -> float:
    """The best held-out accuracy of one side's curve (an unscored point counts as 0)."""
    return max(p["accuracy"] or 0.0 for p in points)


def per_target(runs: list[dict[str, Any]], key: str) -> list[float]:
    """Every run's and target's training-time ``key`` (``fit_over_trl``, ``fit_over_trl_at_most``) where set."""
    return [
        row["train_s"][key]
        for run in runs
        for row in run["targets"].values()
        if row["train_s"].get(key) is not None
    ]


def compare(curves: dict[str, list[dict[str, Any]]], targets: list[float]) -> dict[str, Any]:
    """Per target (and the best score both sides reached, where it beats the start): each side's time to it and
    agl's over TRL's; where only agl reached it, ``fit_over_trl_at_most``: agl's time over TRL's whole run (TRL
    would have needed longer still, so the ratio is at most that)."""
    best = min(best_accuracy(curves[s]) for s in SIDES)
    start = curves[SIDES[0]][0]["accuracy"] or 0.0
    out: dict[str, Any] = {"best_both": best, "targets": {}}
    for target in [*targets, *([best] if best > start else [])]:
        key = f"{target:.3f}" + (" (best both)" if target == best else "")
        row: dict[str, Any] = {}
        for clock in ("train_s", "cpu_s"):
            fit, trl = (time_to(curves[s], target, clock) for s in SIDES)
            row[clock] = {
                "fit": fit,
                "trl": trl,
                "fit_over_trl": fit / trl if fit is not None and trl else None,
            }
            if fit is not None and trl is None:
                row[clock]["fit_over_trl_at_most"] = fit / curves["trl"][-1][clock]
        out["targets"][key] = row
    return out


def reused_run(path: Path, settings: dict[str, str]) -> dict[str, Any] | None:
    """A seed's finished run from ``path`` (``--reuse``); None if there is none. A run made with other
    settings is refused rather than mixed into this report."""
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    differ = {k: (saved["settings"].get(k), v) for k, v in settings.items() if saved["settings"].get(k) != v}
    if differ:
        raise SystemExit(f"--reuse: {path} was made with other settings (saved, now): {differ}")
    run: dict[str, Any] = saved["run"]
    return run


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Accuracy against training wall seconds and CPU seconds, one line per side and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, clock, label in zip(
        axes, ("train_s", "cpu_s"), ("training wall s", "training CPU s"), strict=True
    ):
        for run in runs:
            for side, color in zip(SIDES, ("tab:blue", "tab:orange"), strict=True):
                pts = run["curves"][side]
                ax.plot(
                    [p[clock] for p in pts],
                    [p["accuracy"] for p in pts],
                    marker="o",
                    color=color,
                    alpha=0.9 if run["seed"] == runs[0]["seed"] else 0.5,
                    label=f"{'agl fit' if side == 'fit' else 'TRL'} seed {run['seed']}",
                )
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out accuracy")
    axes[1].legend(fontsize=8)
    fig.suptitle("Time to accuracy: the 5-turn add-tool agent")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The command line (also how ``--earlier`` reads back the settings of a committed result's command)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--seeds", default="0,1", help="training seeds, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help="training steps per side")
    parser.add_argument("--eval-every", type=int, default=4, help="save and evaluate every N steps")
    parser.add_argument("--test", type=int, default=32, help="held-out tasks")
    parser.add_argument("--targets", default="0.5,0.7", help="held-out accuracies to time, comma-separated")
    parser.add_argument("--prompts", type=int, default=4, help="tasks per step")
    parser.add_argument("--group", type=int, default=4, help="rollouts per task")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument(
        "--temperature", type=float, default=0.7, help="training rollouts' sampling temperature"
    )
    parser.add_argument("--max-tokens", type=int, default=48, help="completion tokens per model call")
    parser.add_argument("--turns", type=int, default=5, help="model calls per rollout at most")
    parser.add_argument("--warm-steps", type=int, default=8, help="SFT steps of the shared starting model")
    parser.add_argument(
        "--precision", choices=["fp32", "bf16"], default="fp32", help="both sides' (agl's default is fp32)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--trl-python", type=Path, default=grpo_vs_trl.TRL_PYTHON)
    parser.add_argument("--side-timeout", type=float, default=5400.0, help="seconds one side's run may take")
    parser.add_argument(
        "--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)"
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="take a seed's finished run from --out (its run.json, made with the same settings) instead of "
        "running it again: seeds run as separate commands, then one command with all of them reports together",
    )
    parser.add_argument(
        "--earlier",
        type=Path,
        action="append",
        default=[],
        help="a committed result file whose seeds (run before, with the same settings) join this report",
    )
    _results.add_arguments(parser)
    return parser


def earlier_runs(files: list[Path], settings: dict[str, str], seeds: list[int]) -> list[dict[str, Any]]:
    """The runs that committed result ``files`` hold for seeds other than ``seeds``, each marked with its file
    and machine. A file whose command had other settings is refused rather than mixed into this report."""
    runs = []
    for path in files:
        record = json.loads(path.read_text())
        made = build_parser().parse_args(shlex.split(record["command"])[2:])
        had = {name: str(getattr(made, name)) for name in RUN_SETTINGS}
        differ = {k: (had[k], v) for k, v in settings.items() if had[k] != v}
        if differ:
            raise SystemExit(f"--earlier: {path} was made with other settings (then, now): {differ}")
        for run in record["runs"]:
            if run["seed"] not in seeds:
                runs.append({**run, "from": str(path), "machine": record["machine"]})
    return runs


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.reuse and args.out is None:
        parser.error("--reuse reads finished runs from --out: pass --out DIR")
    for name in ("steps", "eval_every", "test", "prompts", "group", "max_tokens", "turns"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.trl_python.exists():
        raise SystemExit(
            f"the TRL side needs {args.trl_python}: run `bash scripts/setup_trl.sh` or pass --trl-python"
        )
    seeds = [int(s) for s in args.seeds.split(",")]
    targets = [float(t) for t in args.targets.split(",")]
    args.trl_precision = "same"
    recorder = _results.Recorder("time_to_accuracy", args)

    from agl.models import smollm2, tiny_model

    base = smollm2() if args.model == "smollm2" else tiny_model()
    warm = argparse.Namespace(**{**vars(args), "seed": WARM_START_SEED})
    model = grpo_vs_trl.tool_model(warm, base)
    test = tool_task.make_pool(args.test, HELD_OUT_SEED)
    work = args.out or Path(tempfile.mkdtemp(prefix="agl-tta-"))
    runs = []
    settings = {name: str(getattr(args, name)) for name in RUN_SETTINGS}
    for seed in seeds:
        out = work / f"seed-{seed}"
        if args.reuse and (finished := reused_run(out / "run.json", settings)) is not None:
            print(f"seed {seed}: reusing the finished run in {out}", flush=True)
            runs.append(finished)
            continue
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        pool = tool_task.make_pool(args.steps * args.prompts, seed)  # the fit side's own draw of it
        plan = grpo_vs_trl.plan_steps(pool, args.steps, args.prompts, seed)
        trl_tasks = [{k: t[k] for k in ("id", "prompt", "answer")} for step in plan for t in step]
        (out / "plan.json").write_text(json.dumps(trl_tasks))
        sides = {side: run_side(side, args, model, seed, out) for side in SIDES}
        models = {"start": model} | {
            f"{side}-{step}": path for side in SIDES for step, path in sides[side]["saved"].items()
        }
        began = time.perf_counter()
        scores = evaluate(args, models, test, out / "eval")
        print(
            f"seed {seed}: {len(models)} models evaluated in {time.perf_counter() - began:.0f}s", flush=True
        )
        curves = {side: curve(sides[side], scores, side, scores["start"]) for side in SIDES}
        run = {"seed": seed, "made_at": _results.commit(), "curves": curves, **compare(curves, targets)}
        runs.append(run)
        (out / "run.json").write_text(json.dumps({"settings": settings, "run": run}, indent=1))
        for key, row in run["targets"].items():
            print(f"seed {seed}: target {key}: {json.dumps(row)}", flush=True)
    # reused and earlier runs were compared at their own report's targets: compare every run at this one's
    runs = [
        {**run, **compare(run["curves"], targets)}
        for run in earlier_runs(args.earlier, settings, seeds) + runs
    ]
    plot(runs, work / "time_to_accuracy.png")
    print(f"plot: {work / 'time_to_accuracy.png'}", flush=True)
    ratios, bounds = per_target(runs, "fit_over_trl"), per_target(runs, "fit_over_trl_at_most")
    summary = {
        "targets": targets,
        "seeds": sorted(run["seed"] for run in runs),
        "start_accuracy": runs[0]["curves"]["fit"][0]["accuracy"],
        "best": {side: [best_accuracy(run["curves"][side]) for run in runs] for side in SIDES},
        "earlier": [str(path) for path in args.earlier],
    }
    if ratios:
        metric, unit = (
            "agl fit's training time to a held-out target over TRL's",
            "x (a value per seed and target)",
        )
    elif bounds:  # agl reached targets that TRL never did: its time over TRL's whole run bounds the ratio
        metric, unit = (
            "agl fit's training time to a held-out target over TRL's whole run, which never reached it",
            "x, at most (a value per seed and target)",
        )
        ratios = bounds
    else:  # no target reached by both sides: the headline is how far they got
        metric, unit = "best held-out accuracy both sides reached", "share (a value per seed)"
        ratios = [run["best_both"] for run in runs]
    recorder.save(
        metric=metric,
        unit=unit,
        values=ratios,
        runs=runs,
        summary=summary,
        variant=args.model,
        better="lower" if metric.startswith("agl") else "higher",
    )


if __name__ == "__main__":
    main()
