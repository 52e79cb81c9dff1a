"""What a bf16 forward pass keeps of training: the calc demo's trained models scored when served in fp32 and in bf16.

A run trained in bf16 keeps fp32 weights (``agl/compute/precision.py``); only its matmuls, and the engine's
copy of the weights, are bf16. Scoring one saved model both ways tells whether a weak score comes from what
was learned or from the bf16 rounding of the weights it was served with. Each model is scored on the demo's
held-out tasks (``--split-seed 0``) by the built-in engine in each precision, at the demo's validation sampling
(temperature 0.7, one fixed sampling seed for every model), so the only difference is the serving precision.

    python benchmarks/serving_precision.py --warm-start --seeds 0,1,2   # the demo's warm start alone, trained
                                                                        # in fp32 and in bf16 (~20 min)
    python benchmarks/serving_precision.py --runs bf16:DIR fp32:DIR     # fit output folders (model/ inside)
    python benchmarks/serving_precision.py --warm-start --seeds 0 --model tiny --no-save   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _results  # noqa: E402

PRECISIONS = ("fp32", "bf16")
SAMPLING_SEED = 1234


def train_warm_start(out: Path, precision: str, seed: int, model: str) -> Path:
    """The demo with no GRPO step (its warm start alone) trained in ``precision``; returns its run folder."""
    run_dir = out / f"warm-{precision}-s{seed}"
    command = [sys.executable, "-m", "examples.calc.train", "--steps", "0", "--seed", str(seed)]
    command += ["--model", model, "--out", str(run_dir), "--precision", precision]
    log = out / f"warm-{precision}-s{seed}.log"
    with log.open("w") as sink:
        done = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, cwd=_results.ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the warm start in {precision}, seed {seed} failed: see {log}")
    return run_dir


def score(run_dir: Path, model: str) -> dict[str, float]:
    """The run's saved model's held-out accuracy served by the built-in engine in fp32 and in bf16."""
    import agl
    from agl.engines import BuiltinEngine
    from examples.calc.agent import calc_agent
    from examples.calc.train import calc_tasks

    _, held_out, _ = calc_tasks(0, 8 if model == "tiny" else 64)
    scores = {}
    for precision in PRECISIONS:
        serving = agl.Serving(engine=BuiltinEngine({"precision": precision}), sampling={"temperature": 0.7})
        result = agl.evaluate_models(
            calc_agent, held_out, {precision: run_dir / "model"}, serving=serving, n_runners=32,
            sampling_seed=SAMPLING_SEED,
        )  # fmt: skip
        scores[f"served_{precision}"] = result.models[0].mean_reward
    return scores


def run_record(run_dir: Path, trained: str, model: str) -> dict[str, Any]:
    summary = json.loads((run_dir / "summary.json").read_text())
    phase = "after_grpo" if summary.get("grpo_steps") else "after_warm_start"
    reported = summary["val_accuracy_after"] if phase == "after_grpo" else summary["val_accuracy_after_sft"]
    record = {"run": str(run_dir), "trained": trained, "seed": summary.get("seed"), "phase": phase}
    record |= {"reported_by_fit": reported, **score(run_dir, model)}
    record["fp32_minus_bf16"] = round(record["served_fp32"] - record["served_bf16"], 4)
    print(json.dumps(record), flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--warm-start", action="store_true", help="train the demo's warm start in both")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds of --warm-start, comma-separated")
    parser.add_argument("--runs", nargs="*", default=[], help="PRECISION:DIR, a fit run trained in PRECISION")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument(
        "--out", type=Path, default=Path("results/serving_precision"), help="--warm-start's runs"
    )
    parser.add_argument("--variant", default=None, help="the result's name (default: warm-start or runs)")
    _results.add_arguments(parser)
    args = parser.parse_args()
    runs: list[tuple[str, Path]] = []
    for spec in args.runs:
        trained, sep, folder = spec.partition(":")
        if not sep or trained not in PRECISIONS or not (Path(folder) / "model").is_dir():
            parser.error(
                f"--runs {spec!r}: give PRECISION:DIR, PRECISION fp32 or bf16, DIR a fit run with model/"
            )
        runs.append((trained, Path(folder)))
    if not args.warm_start and not runs:
        parser.error("give --warm-start, --runs or both")
    recorder = _results.Recorder("serving_precision", args)
    if args.warm_start:
        args.out.mkdir(parents=True, exist_ok=True)
        for seed in (int(s) for s in args.seeds.split(",")):
            runs += [(p, train_warm_start(args.out, p, seed, args.model)) for p in PRECISIONS]
    records = [run_record(folder, trained, args.model) for trained, folder in runs]
    keys = ("reported_by_fit", "served_fp32", "served_bf16", "fp32_minus_bf16")
    summary = {  # per (training precision, phase): a warm start alone and a whole run apart
        f"trained_{p}_{phase}": {
            k: _results.spread([r for r in records if (r["trained"], r["phase"]) == (p, phase)], k)
            for k in keys
        }
        for p in PRECISIONS
        for phase in ("after_warm_start", "after_grpo")
    }
    print(json.dumps(summary, indent=2))
    variant = args.variant or ("warm-start" if args.warm_start else "runs")
    recorder.save(
        metric="held-out accuracy served in fp32 minus served in bf16",
        unit="share",
        values=[r["fp32_minus_bf16"] for r in records],
        runs=records,
        summary=summary,
        variant=f"{args.model}-{variant}",
    )


if __name__ == "__main__":
    main()
