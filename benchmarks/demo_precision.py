"""The calc demo's held-out accuracy in bf16 and fp32 over training seeds: base, after the warm start, after GRPO.

Each (precision, seed) is one `python -m examples.calc.train --seed S --precision P` process under
`/usr/bin/time -v`, run one after another so they never share the cores; the held-out split is the same for
every seed (`--split-seed 0`). Reports per run the three accuracies, CPU seconds (user + system) and peak RSS,
and per precision the mean and range.

    python benchmarks/demo_precision.py                          # seeds 0,1,2 in bf16 and fp32 (~2 h on 2 cores)
    python benchmarks/demo_precision.py --seeds 0 --precisions fp32 --model tiny   # a minute's smoke run
    python benchmarks/demo_precision.py --logs DIR               # summarise runs already in DIR, run nothing
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

PHASES = ("val_accuracy_before", "val_accuracy_after_sft", "val_accuracy_after")


def run_one(out: Path, precision: str, seed: int, model: str) -> None:
    """One demo run into ``out/calc-<precision>-s<seed>`` with its ``/usr/bin/time -v`` log beside it."""
    run_dir = out / f"calc-{precision}-s{seed}"
    command = ["/usr/bin/time", "-v", sys.executable, "-m", "examples.calc.train", "--seed", str(seed)]
    command += ["--model", model, "--out", str(run_dir), "--precision", precision]
    with (out / f"calc-{precision}-s{seed}.log").open("w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False, cwd=_results.ROOT)


def read_run(out: Path, precision: str, seed: int) -> dict[str, Any]:
    """One run's accuracies (its ``summary.json``) and resources (its ``/usr/bin/time -v`` log)."""
    resources = _results.timed_run(out / f"calc-{precision}-s{seed}.log")
    summary = json.loads((out / f"calc-{precision}-s{seed}" / "summary.json").read_text())
    return {
        "precision": precision,
        "seed": seed,
        **{k: summary[k] for k in PHASES},
        **resources,
        "wall_time_s": summary.get("wall_time_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    parser.add_argument("--precisions", default="bf16,fp32", help="--precision values, comma-separated")
    parser.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2")
    parser.add_argument("--out", type=Path, default=Path("results/demo_precision"), help="the runs' folders")
    parser.add_argument("--logs", type=Path, default=None, help="read runs already in DIR; run nothing")
    parser.add_argument("--note", default="", help="what the runs were (kept in the result's summary)")
    _results.add_arguments(parser)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    precisions = args.precisions.split(",")
    recorder = _results.Recorder("demo_precision", args)
    out = args.logs or args.out
    if args.logs is None:
        out.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            for precision in precisions:
                print(f"running seed {seed} in {precision}", flush=True)
                run_one(out, precision, seed, args.model)
    runs = [read_run(out, p, s) for p in precisions for s in seeds]
    summary: dict[str, Any] = {"model": args.model, "seeds": seeds, "note": args.note}
    for precision in precisions:
        mine = [r for r in runs if r["precision"] == precision]
        summary[precision] = {k: _results.spread(mine, k) for k in (*PHASES, "cpu_s", "peak_rss_gb")}
        print(
            f"{precision}: held-out base {summary[precision]['val_accuracy_before']}, after warm start "
            f"{summary[precision]['val_accuracy_after_sft']}, after GRPO {summary[precision]['val_accuracy_after']}"
        )
    for precision in precisions:
        mine = [r for r in runs if r["precision"] == precision]
        recorder.save(
            metric="held-out accuracy after GRPO",
            unit="share",
            values=[r["val_accuracy_after"] for r in mine],
            runs=mine,
            summary=summary,
            variant=f"{args.model}-{precision}",
        )


if __name__ == "__main__":
    main()
