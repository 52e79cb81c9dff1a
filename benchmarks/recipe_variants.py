"""A recipe run in variants from the same training seeds: held-out scores, steps without an update, cost.

Each (variant, seed) is one ``python -m examples.<recipe>.train --seed S <the variant's options>`` under
``/usr/bin/time -v``, run one after another so they never share the cores, into ``OUT/<name>-<variant>-s<S>/``
with its log beside it (``<name>`` is ``--name``, by default the recipe). Reported per run, from its
``summary.json``, ``metrics.csv`` and log: the held-out score of the base model, after the warm start (and the
teacher's own, for a teacher warm start) and after GRPO; the GRPO steps that trained no sample, the extra
rollouts dynamic sampling drew and the share of rollouts merged into one sample; for a teacher warm start, the
conversations kept and how many of them call a tool; CPU seconds and peak RSS.
A run that stopped before its summary (a teacher that kept no rollout) is recorded as failed, with its
error and the teacher's own score when its log has it, never as a score of 0. Per variant: the mean and
range over the runs that finished.

    python benchmarks/recipe_variants.py --recipe sql_agent --variants plain=,refill=--refill --seeds 0,1,2
    python benchmarks/recipe_variants.py --recipe sql_agent --variants "teacher=--teacher qwen-coder" --seeds 0
    python benchmarks/recipe_variants.py --recipe sql_agent --name sql --variants plain=,refill= --logs DIR
    python benchmarks/recipe_variants.py ... --seeds 1,2 --earlier benchmarks/results/recipe_variants/SEED0.json

``--earlier`` adds a committed result's runs of the same variants (seeds run before) to the summary, each
marked with the file it came from, so seeds run in separate commands report together.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _results  # noqa: E402

SCORES = ("test_base", "test_teacher", "test_after_warm_start", "test_after_grpo")
#: the calc demo names its held-out scores after its "val" split
CALC_SCORES = {
    "test_base": "val_accuracy_before",
    "test_teacher": "val_accuracy_teacher",
    "test_after_warm_start": "val_accuracy_after_sft",
    "test_after_grpo": "val_accuracy_after",
}


def variants_of(text: str) -> dict[str, list[str]]:
    """``plain=,refill=--refill`` as ``{"plain": [], "refill": ["--refill"]}``; a comma that no ``name=``
    follows stays in the options (``team=--agents solver,checker``)."""
    out = {}
    for part in re.split(r",(?=[a-z0-9_]+=)", text):
        name, _, options = part.partition("=")
        if not re.fullmatch(r"[a-z0-9_]+", name):
            raise SystemExit(
                f"--variants: a variant name is lower-case letters, digits and '_', got {name!r}"
            )
        out[name] = shlex.split(options)
    return out


def run_one(recipe: str, out: Path, stem: str, seed: int, options: list[str]) -> None:
    """One recipe run into ``out/stem`` with its ``/usr/bin/time -v`` log in ``out/stem.log``."""
    command = ["/usr/bin/time", "-v", sys.executable, "-m", f"examples.{recipe}.train", "--seed", str(seed)]
    command += [*options, "--out", str(out / stem)]
    with (out / f"{stem}.log").open("w") as log:
        subprocess.run(
            command, stdout=log, stderr=subprocess.STDOUT, check=False, cwd=_results.ROOT, env=os.environ
        )


def steps_of(metrics_csv: Path) -> dict[str, Any]:
    """From a run's ``metrics.csv``: its GRPO steps, those that trained no sample, refill's extra rollouts,
    the mean share of rollouts merged into one sample, and the highest RSS the steps saw (the whole run's
    peak may come before them: a teacher served beside the student)."""
    rows = [r for r in csv.DictReader(metrics_csv.open()) if r.get("samples")]
    number = lambda row, key: float(row.get(key) or 0.0)  # noqa: E731
    merged = [number(r, "merged_fraction") for r in rows if r.get("merged_fraction")]
    return {
        "steps": len(rows),
        "steps_without_update": sum(number(r, "samples") == 0 for r in rows),
        "refill_rollouts": sum(number(r, "refill_rollouts") for r in rows),
        "merged_fraction": round(statistics.fmean(merged), 4) if merged else None,
        "steps_peak_rss_gb": round(max(number(r, "peak_rss_gb") for r in rows), 2) if rows else None,
    }


#: the exception a failed run's log ends with, and the teacher's held-out score its log may hold
_ERROR = re.compile(r"^(?:\w+\.)*(\w*(?:Error|Exception)): (.+)$", re.MULTILINE)
_TEACHER_SCORE = re.compile(r"teacher: held-out score ([0-9.]+)")


def kept_traces(path: Path) -> dict[str, int | None]:
    """A taught run's kept conversations (``teacher_traces.jsonl``), and how many of them call a tool: a
    teacher that answers without its tools teaches the student to skip them."""
    if not path.exists():
        return {"teacher_kept": None, "teacher_kept_with_tool_calls": None}
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    called = [x for x in lines if any(m.get("tool_calls") for m in x.get("messages", []))]
    return {"teacher_kept": len(lines), "teacher_kept_with_tool_calls": len(called)}


def failed_run(log: Path, variant: str, seed: int) -> dict[str, Any]:
    """A run that stopped before its ``summary.json``: why (its last exception), and what it measured."""
    text = log.read_text(errors="replace")
    errors = _ERROR.findall(text)
    teacher = _TEACHER_SCORE.search(text)
    return {
        "variant": variant,
        "seed": seed,
        "failed": f"{errors[-1][0]}: {errors[-1][1]}" if errors else "no summary.json (see the log)",
        "test_teacher": float(teacher.group(1)) if teacher else None,
        **_results.timed_run(log, failed_ok=True),
    }


def read_run(out: Path, stem: str, variant: str, seed: int) -> dict[str, Any]:
    """One run's scores, steps and resources."""
    if not (out / stem / "summary.json").exists():
        return failed_run(out / f"{stem}.log", variant, seed)
    resources = _results.timed_run(out / f"{stem}.log")
    summary = json.loads((out / stem / "summary.json").read_text())
    return {
        "variant": variant,
        "seed": seed,
        **{k: summary.get(k, summary.get(CALC_SCORES[k])) for k in SCORES},
        "warm_start_from": summary.get("warm_start_from"),
        "precision": summary.get("precision"),
        **kept_traces(out / stem / "teacher_traces.jsonl"),  # the conversations the student learnt from
        **steps_of(out / stem / "metrics.csv"),
        **resources,
        "wall_time_s": summary.get("wall_time_s"),
    }


def earlier_runs(files: list[Path], variants: dict[str, list[str]], seeds: list[int]) -> list[dict[str, Any]]:
    """The runs of ``variants`` that committed result ``files`` hold, for seeds other than ``seeds``."""
    runs = []
    for path in files:
        for run in json.loads(path.read_text())["runs"]:
            if run["variant"] in variants and run["seed"] not in seeds:
                runs.append({**run, "from": str(path)})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--recipe", required=True, help="examples.<recipe>.train: sql_agent, calc, multi_agent, ..."
    )
    parser.add_argument("--name", default=None, help="the runs' folder prefix (default: the recipe)")
    parser.add_argument("--variants", required=True, help="name=options,...: e.g. plain=,refill=--refill")
    parser.add_argument("--seeds", default="0,1,2", help="training seeds, comma-separated")
    parser.add_argument("--out", type=Path, default=Path("results/recipe_variants"), help="the runs' folders")
    parser.add_argument("--logs", type=Path, default=None, help="read runs already in DIR; run nothing")
    parser.add_argument("--note", default="", help="what the runs were (kept in the result's summary)")
    parser.add_argument(
        "--earlier",
        type=Path,
        action="append",
        default=[],
        help="a committed result file whose runs of these variants (other seeds, run before) join the summary",
    )
    _results.add_arguments(parser)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    variants = variants_of(args.variants)
    name = args.name or args.recipe
    recorder = _results.Recorder("recipe_variants", args)
    out = args.logs or args.out
    if args.logs is None:
        out.mkdir(parents=True, exist_ok=True)
        for seed in seeds:
            for variant, options in variants.items():
                print(f"running {name}-{variant} seed {seed}", flush=True)
                run_one(args.recipe, out, f"{name}-{variant}-s{seed}", seed, options)
    runs = earlier_runs(args.earlier, variants, seeds)
    runs += [read_run(out, f"{name}-{v}-s{s}", v, s) for v in variants for s in seeds]
    summary: dict[str, Any] = {
        "recipe": args.recipe,
        "seeds": sorted({r["seed"] for r in runs}),
        "variants": variants,
        "note": args.note,
        "earlier": [str(path) for path in args.earlier],
    }
    keys = (
        *SCORES,
        "teacher_kept",
        "teacher_kept_with_tool_calls",
        "steps_without_update",
        "refill_rollouts",
        "merged_fraction",
        "cpu_s",
        "peak_rss_gb",
        "steps_peak_rss_gb",
    )
    for variant in variants:
        mine = [r for r in runs if r["variant"] == variant]
        finished = [r for r in mine if "failed" not in r]
        summary[variant] = {k: _results.spread(finished or mine, k) for k in keys}
        summary[variant]["failed_runs"] = len(mine) - len(finished)
        # the precision each run resolved "auto" to: a variant's seeds on different CPUs may differ
        summary[variant]["precision"] = sorted({str(r.get("precision")) for r in finished})
        print(variant, json.dumps(summary[variant]))
    for variant in variants:  # a result per variant, each with every variant's summary beside it
        mine = [r for r in runs if r["variant"] == variant]
        scores = [r["test_after_grpo"] for r in mine if "failed" not in r]
        headline = (  # a variant whose every run failed: the share that finished, not a score of 0
            {"metric": "held-out score after GRPO", "values": scores}
            if scores
            else {"metric": "share of runs that finished", "values": [0.0]}
        )
        recorder.save(
            **headline, unit="share", runs=mine, summary=summary, variant=f"{args.recipe}-{variant}"
        )


if __name__ == "__main__":
    main()
